"""ZeroOffloadTrainer (zero_offload.integrations.hf): a transformers.Trainer whose params and
AdamW state the engine offloads trains like the same Trainer without offload (same seed, data,
arguments): per-step losses, grad norms and final weights, with gradient accumulation (including
the short last window of an epoch), clipping, the Trainer's lr scheduler with warmup, evaluation,
save_model that from_pretrained loads, checkpoints and resume_from_checkpoint; PEFT LoRA too.
Small Llama and GPT-2 built from configs (no downloads), on the CPU."""
import os

import pytest
import torch

import zero_offload as zo
from _engine_util import rel_err

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it (pyproject: test extra)
from transformers import Trainer, TrainingArguments  # noqa: E402

from zero_offload.integrations.hf import ENGINE_DIR, ZeroOffloadTrainer  # noqa: E402

from _engine_util import HF_TINY_CONFIGS as CONFIGS  # noqa: E402
OFFLOAD = dict(params="cpu", optimizer="cpu", chunk_mb=0.01, gpu_budget=1 << 24, cpu_budget=1 << 26,
               threads=1)


def model(kind: str):
    kwargs = dict(CONFIGS[kind])
    cfg = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def dataset(n: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (16,), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def arguments(out, **kw) -> TrainingArguments:
    """7 batches per epoch with accumulation 3: windows of 3, 3 and 1 micro-batches."""
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=3,
                num_train_epochs=2, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5,
                warmup_steps=2, lr_scheduler_type="linear", logging_steps=1, save_strategy="no",
                report_to=[], use_cpu=True, seed=0, disable_tqdm=True, per_device_eval_batch_size=4)
    base.update(kw)
    return TrainingArguments(**base)


def logged(trainer, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if key in h and "train_loss" not in h]


def params_of(m) -> dict:
    return {n: p.detach().float().cpu() for n, p in m.named_parameters()}


def assert_weights_close(got: dict, want: dict, rtol: float) -> None:
    for n, v in want.items():
        if n.endswith("c_attn.bias"):
            continue  # key part: zero grad up to rounding noise (tests/_engine_util.py)
        assert rel_err(got[n], v) <= rtol, (n, rel_err(got[n], v))


@pytest.mark.parametrize("kind, clip", [("llama", 0.5), ("gpt2", 0.5), ("llama", 0.0)],
                         ids=["llama-clipped", "gpt2-clipped", "llama-no_clip"])
def test_trainer_equals_plain_trainer(kind, clip, tmp_path):
    train, evaluation = dataset(14), dataset(8, seed=2)
    plain = Trainer(model=model(kind), args=arguments(tmp_path / "plain", max_grad_norm=clip),
                    train_dataset=train, eval_dataset=evaluation)
    plain.train()
    ours = ZeroOffloadTrainer(model=model(kind), args=arguments(tmp_path / "ours", max_grad_norm=clip),
                              train_dataset=train, eval_dataset=evaluation,
                              offload_config=zo.OffloadConfig(**OFFLOAD))
    ours.train()
    engine = ours.engine
    assert engine.config.grad_accum == 3 and engine.config.grad_clip == (clip or None)
    assert len(engine.partition.chunks) >= 3  # really paged, chunk by chunk
    assert engine.global_step == ours.state.global_step == 6  # 2 epochs of windows 3, 3, 1
    assert logged(ours, "loss") == pytest.approx(logged(plain, "loss"), rel=1e-5)
    assert logged(ours, "learning_rate") == pytest.approx(logged(plain, "learning_rate"), rel=1e-6)
    if clip:
        norms = logged(plain, "grad_norm")
        assert max(norms) > clip  # the clip was active
        assert logged(ours, "grad_norm") == pytest.approx(norms, rel=1e-5)
    assert_weights_close(engine.state_dict(), params_of(plain.model), rtol=1e-5)
    assert ours.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-5)

    ours.save_model(tmp_path / "export")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert_weights_close(params_of(loaded), params_of(plain.model), rtol=1e-5)
    ours.save_model()  # into output_dir, which holds files already: the weights land there too
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert_weights_close(params_of(again), params_of(plain.model), rtol=1e-5)
    assert not [f for f in os.listdir(tmp_path / "ours") if f.startswith(".")]
    engine.close()


def test_resume_from_checkpoint_lands_where_the_uninterrupted_run_does(tmp_path):
    train = dataset(14)
    kw = dict(save_strategy="steps", save_steps=2, num_train_epochs=2)
    whole = ZeroOffloadTrainer(model=model("llama"), args=arguments(tmp_path / "whole", **kw),
                               train_dataset=train, offload_config=zo.OffloadConfig(**OFFLOAD))
    whole.train()
    ckpt = tmp_path / "whole" / "checkpoint-4"  # mid-epoch 2 (an epoch has 3 updates)
    assert (ckpt / ENGINE_DIR).is_dir() and (ckpt / "scheduler.pt").is_file()
    # a Trainer checkpoint's weights load with from_pretrained
    assert transformers.AutoModelForCausalLM.from_pretrained(ckpt) is not None

    resumed = ZeroOffloadTrainer(model=model("llama"), args=arguments(tmp_path / "resumed", **kw),
                                 train_dataset=train, offload_config=zo.OffloadConfig(**OFFLOAD))
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == whole.state.global_step == 6
    assert logged(resumed, "loss")[-2:] == pytest.approx(logged(whole, "loss")[-2:], rel=1e-6)
    assert logged(resumed, "learning_rate")[-2:] == pytest.approx(logged(whole, "learning_rate")[-2:])
    want = whole.engine.state_dict()
    got = resumed.engine.state_dict()
    for n, v in want.items():
        assert torch.allclose(got[n], v, rtol=1e-6, atol=1e-7), n
    whole.engine.close()
    resumed.engine.close()


def test_lora_trainer_equals_plain_lora_trainer(tmp_path):
    peft = pytest.importorskip("peft")

    def lora():
        return peft.get_peft_model(model("llama"), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
            task_type="CAUSAL_LM"))

    train = dataset(14)
    plain = Trainer(model=lora(), args=arguments(tmp_path / "plain"), train_dataset=train)
    plain.train()
    ours = ZeroOffloadTrainer(model=lora(), args=arguments(tmp_path / "ours"), train_dataset=train,
                              offload_config=zo.OffloadConfig(**OFFLOAD))
    ours.train()
    assert logged(ours, "loss") == pytest.approx(logged(plain, "loss"), rel=1e-5)
    adapters = {n: v for n, v in params_of(plain.model).items() if "lora_" in n}
    assert len(adapters) == 8
    assert_weights_close(ours.engine.state_dict(), adapters, rtol=1e-5)
    ours.save_model(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()  # the base is not written
    loaded = peft.PeftModel.from_pretrained(model("llama"), tmp_path / "adapter")
    assert_weights_close(params_of(loaded), adapters, rtol=1e-5)
    ours.engine.close()


def test_bf16_trains_with_bf16_weights_and_fp32_master(tmp_path):
    train = dataset(14)
    ours = ZeroOffloadTrainer(model=model("llama"), args=arguments(tmp_path / "ours", bf16=True),
                              train_dataset=train, offload_config=zo.OffloadConfig(**OFFLOAD))
    ours.train()
    plain = Trainer(model=model("llama"), args=arguments(tmp_path / "plain"), train_dataset=train)
    plain.train()
    assert ours.engine.dtype is torch.bfloat16
    # bf16 compute against fp32: close, not equal
    assert logged(ours, "loss") == pytest.approx(logged(plain, "loss"), rel=2e-2)
    ours.save_model(tmp_path / "export")  # in the model's dtype (fp32 here), from the fp32 master
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert next(loaded.parameters()).dtype is torch.float32
    assert_weights_close(ours.engine.state_dict(), params_of(loaded), rtol=1e-6)
    ours.engine.close()


@pytest.mark.parametrize("args, config, match", [
    (dict(fp16=True), {}, "fp16=True"),
    (dict(optim="sgd"), {}, "optim='sgd'"),
    ({}, dict(grad_accum=2), r"offload_config.grad_accum=2 but TrainingArguments gives 3"),
    ({}, dict(dtype="fp16"), r"offload_config.dtype='fp16'"),
    ({}, dict(grad_clip=2.0), r"offload_config.grad_clip=2.0 but TrainingArguments gives 0.5"),
])
def test_refusals_name_the_setting_and_the_fix(args, config, match, tmp_path):
    kw = dict(use_cpu=False) if args.get("fp16") else {}
    with pytest.raises(ValueError, match=match):
        ZeroOffloadTrainer(model=model("llama"), args=arguments(tmp_path, **args, **kw),
                           train_dataset=dataset(4), offload_config={**OFFLOAD, **config})


def test_resume_from_a_plain_checkpoint_is_refused(tmp_path):
    plain = Trainer(model=model("llama"), args=arguments(tmp_path / "plain", save_strategy="steps",
                                                         save_steps=2), train_dataset=dataset(14))
    plain.train()
    ours = ZeroOffloadTrainer(model=model("llama"), args=arguments(tmp_path / "ours"),
                              train_dataset=dataset(14), offload_config=zo.OffloadConfig(**OFFLOAD))
    with pytest.raises(FileNotFoundError, match="holds no zero_offload/ engine checkpoint"):
        ours.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-2"))
    ours.engine.close()


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path):
    kw = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
              load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=False,
              learning_rate=0.2)  # a rate that overshoots: the last checkpoint is not the best
    ours = ZeroOffloadTrainer(model=model("llama"), args=arguments(tmp_path / "ours", **kw),
                              train_dataset=dataset(14), eval_dataset=dataset(8, seed=2),
                              offload_config=zo.OffloadConfig(**OFFLOAD))
    ours.train()
    best = ours.state.best_model_checkpoint
    losses = {h["step"]: h["eval_loss"] for h in ours.state.log_history if "eval_loss" in h}
    assert best.endswith(f"checkpoint-{min(losses, key=losses.get)}")
    assert min(losses, key=losses.get) != ours.state.global_step, losses  # else nothing to restore
    saved = transformers.AutoModelForCausalLM.from_pretrained(best)
    assert_weights_close(ours.engine.state_dict(), params_of(saved), rtol=1e-6)
    ours.engine.close()


def test_torch_compile_compiles_each_block_and_trains_like_the_compiled_plain_trainer(tmp_path):
    """torch_compile=True: the plain Trainer compiles the whole model; ours compiles it region by
    region before the engine is built (the engine's units are modules), with the same backend,
    and the run equals the plain compiled one."""
    kw = dict(torch_compile=True, torch_compile_backend="aot_eager", num_train_epochs=1)
    plain = Trainer(model=model("llama"), args=arguments(tmp_path / "plain", **kw), train_dataset=dataset(14))
    plain.train()
    ours = ZeroOffloadTrainer(model=model("llama"), args=arguments(tmp_path / "ours", **kw),
                              train_dataset=dataset(14), offload_config=zo.OffloadConfig(**OFFLOAD))
    ours.train()
    layers = ours.model.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)  # compiled, in place
    assert ours.model.lm_head._compiled_call_impl is not None
    assert ours.engine.global_step == plain.state.global_step == 3
    assert logged(ours, "loss") == pytest.approx(logged(plain, "loss"), rel=1e-5)
    assert_weights_close(ours.engine.state_dict(), params_of(plain.model), rtol=1e-5)
    ours.engine.close()


def test_torch_compile_with_cuda_graphs_is_refused_with_the_fix(tmp_path):
    ours = ZeroOffloadTrainer(model=model("llama"), args=arguments(
        tmp_path, torch_compile=True, torch_compile_backend="inductor", torch_compile_mode="reduce-overhead"),
        train_dataset=dataset(4), offload_config=zo.OffloadConfig(**OFFLOAD))
    with pytest.raises(ValueError, match="CUDA graphs.*mode='default'"):
        ours.train()
