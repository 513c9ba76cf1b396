"""OffloadConfig / Adam / AdamW validation, size strings, dict/JSON/DeepSpeed translation."""
import json
import warnings

import pytest
import torch

from zero_offload.config import (Adam, AdamW, OffloadConfig, Placement, Precision, load_config,
                                 parse_bytes, translate_deepspeed)


# -- optimizer specs ---------------------------------------------------------------------------

def test_adam_specs_defaults_match_torch():
    p = [torch.nn.Parameter(torch.zeros(1))]
    for spec, ref in ((Adam(), torch.optim.Adam(p)), (AdamW(), torch.optim.AdamW(p))):
        d = ref.defaults
        assert (spec.lr, spec.betas, spec.eps, spec.weight_decay) == (
            d["lr"], tuple(d["betas"]), d["eps"], d["weight_decay"])
    assert Adam().adamw is False and AdamW().adamw is True


@pytest.mark.parametrize("kw, field", [
    ({"lr": -1e-3}, "lr"), ({"lr": float("nan")}, "lr"), ({"lr": "0.1"}, "lr"),
    ({"betas": (0.9, 1.0)}, "betas[1]"), ({"betas": (-0.1, 0.9)}, "betas[0]"),
    ({"betas": (0.9,)}, "betas"), ({"betas": "ab"}, "betas"),
    ({"eps": -1.0}, "eps"), ({"weight_decay": -0.1}, "weight_decay"), ({"lr": True}, "lr"),
])
@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_adam_spec_rejects(cls, kw, field):
    with pytest.raises(ValueError) as e:
        cls(**kw)
    assert f"{cls.__name__}.{field}=" in str(e.value)


def test_adam_spec_normalises_and_is_frozen():
    s = AdamW(lr=1, betas=[0.8, 0.9])
    assert s.lr == 1.0 and isinstance(s.lr, float) and s.betas == (0.8, 0.9)
    with pytest.raises(Exception):
        s.lr = 2.0
    with pytest.raises(TypeError):
        AdamW(1e-3)  # keyword-only


# -- OffloadConfig field validation ------------------------------------------------------------

BAD = [
    ("params", "disk"), ("params", 3), ("optimizer", "gpu"), ("optimizer", "ram"),
    ("nvme_dir", ""), ("nvme_dir", 5), ("dtype", "fp8"), ("dtype", torch.bfloat16),
    ("chunk_mb", 0), ("chunk_mb", -1.0), ("chunk_mb", "64"), ("chunk_mb", float("inf")),
    ("prefetch_depth", -1), ("prefetch_depth", 1.5), ("prefetch_depth", True),
    ("gpu_budget", 0), ("gpu_budget", "8G"), ("gpu_budget", "lots"), ("gpu_budget", 1.5),
    ("cpu_budget", -5), ("nvme_budget", "-1GiB"), ("activation_reserve", -1), ("activation_reserve", "half"),
    ("grad_clip", 0.0), ("grad_clip", -1.0), ("grad_clip", "1"),
    ("grad_accum", 0), ("grad_accum", 2.0),
    ("loss_scale", "static"), ("loss_scale", 0.0), ("loss_scale", -2.0),
    ("initial_scale", 0.0), ("growth_factor", 1.0), ("growth_factor", 0.5),
    ("backoff_factor", 1.0), ("backoff_factor", 0.0), ("growth_interval", 0),
    ("threads", 0), ("threads", "4"), ("io_threads", 0), ("io_block_size", 5000),
    ("io_block_size", 1024), ("io_queue_depth", 0), ("overlap", 1), ("overlap", "yes"),
]


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_offload_config_rejects(name, value):
    with pytest.raises(ValueError) as e:
        OffloadConfig(**{name: value})
    assert f"OffloadConfig.{name}=" in str(e.value)


def test_nvme_placement_needs_dir(tmp_path):
    for name in ("params", "optimizer"):
        with pytest.raises(ValueError, match=rf"OffloadConfig\.{name}='nvme' needs a swap directory.*nvme_dir="):
            OffloadConfig(**{name: "nvme"})
        c = OffloadConfig(**{name: "nvme"}, nvme_dir=tmp_path)
        assert c.nvme_dir == str(tmp_path) and getattr(c, name) is Placement.NVME


def test_normalised_values():
    c = OffloadConfig(params="CPU", dtype="fp16", gpu_budget="1.5GiB", cpu_budget=4096,
                      nvme_budget="AUTO", grad_clip=1, loss_scale="Dynamic", chunk_mb=1)
    assert c.params is Placement.CPU and c.params == "cpu"
    assert c.dtype is Precision.FP16 and c.torch_dtype is torch.float16
    assert c.gpu_budget == 3 * 2**29 and c.cpu_budget == 4096 and c.nvme_budget == "auto"
    assert c.grad_clip == 1.0 and isinstance(c.grad_clip, float) and c.loss_scale == "dynamic"
    assert c.chunk_bytes == 2**20
    assert OffloadConfig(chunk_mb=0.001).chunk_bytes == 4096
    assert OffloadConfig(gpu_budget="1073741824") == OffloadConfig(gpu_budget="1GiB")
    with pytest.raises(TypeError):
        OffloadConfig("cpu")


@pytest.mark.parametrize("text, nbytes", [
    ("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1.5 TiB", 3 * 2**39), ("4kb", 4000),
    ("100", 100), ("100B", 100), (" 2 MiB ", 2 * 2**20), (".5GB", 5 * 10**8), (123, 123),
])
def test_parse_bytes(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["8G", "1.5 M", "GiB", "8 GiBs", "-1MB", "0", 0, 2.5, None, True])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text, name="size")


def test_ambiguous_unit_names_the_fix():
    with pytest.raises(ValueError, match="'GiB' for powers of 1024 or 'GB'"):
        OffloadConfig(cpu_budget="8G")


# -- dict / JSON round trips -------------------------------------------------------------------

def test_dict_and_json_round_trip(tmp_path):
    c = OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=str(tmp_path), dtype="fp16",
                      chunk_mb=16, prefetch_depth=3, gpu_budget="2GiB", grad_clip=0.5,
                      grad_accum=4, loss_scale=1024.0, threads=2, io_threads=8, overlap=False)
    d = c.to_dict()
    assert json.loads(json.dumps(d)) == d  # plain JSON values
    assert d["params"] == "nvme" and d["gpu_budget"] == 2 * 2**30
    assert OffloadConfig.from_dict(d) == c
    path = tmp_path / "cfg.json"
    c.to_json(path)
    assert OffloadConfig.from_json(path) == c
    assert load_config(str(path)) == (c, None)
    assert load_config(c) == (c, None)


def test_unknown_keys_suggest_close_match():
    with pytest.raises(ValueError, match=r"'prefetch_dept' \(did you mean 'prefetch_depth'\?\).*valid keys: .*chunk_mb"):
        OffloadConfig.from_dict({"prefetch_dept": 2})
    with pytest.raises(ValueError, match="unknown Adam key"):
        Adam.from_dict({"learning_rate": 1e-3})


def test_load_config_our_dict_with_optimizer():
    cfg, spec = load_config({"params": "cpu", "optim": {"type": "adam", "lr": 0.01, "betas": [0.8, 0.9]}})
    assert cfg.params is Placement.CPU and spec == Adam(lr=0.01, betas=(0.8, 0.9))
    assert type(spec) is Adam
    cfg, spec = load_config({"optim": AdamW(lr=0.5).to_dict()})
    assert spec == AdamW(lr=0.5) and type(spec) is AdamW
    cfg, spec = load_config({"optim": {"type": "sgd", "lr": 0.1, "momentum": 0.9}})  # (issue 25's rules)
    assert type(spec).__name__ == "SGD" and (spec.lr, spec.momentum) == (0.1, 0.9)
    with pytest.raises(ValueError, match="optimizer type 'rmsprop' is not supported: use one of 'adam', 'adamw', 'sgd'"):
        load_config({"optim": {"type": "rmsprop"}})


def test_load_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(bad)
    with pytest.raises(TypeError, match="load_config expects"):
        load_config(42)


# -- DeepSpeed ---------------------------------------------------------------------------------

DS_NVME = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                               "weight_decay": 0.1}},
    "zero_optimization": {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
        "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 1e6, "sub_group_size": 1e9,
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 40, "buffer_size": 1e8},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "ratio": 1.0, "pipeline_read": True},
    },
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 2, "single_submit": False,
            "overlap_events": True},
}


def test_deepspeed_nvme_translation(tmp_path):
    t = translate_deepspeed(DS_NVME)
    c = t.config
    assert (c.params, c.optimizer, c.nvme_dir, c.dtype) == ("nvme", "nvme", "/local_nvme", "bf16")
    assert (c.grad_clip, c.grad_accum) == (1.0, 4)
    assert (c.io_block_size, c.io_queue_depth, c.io_threads) == (262144, 32, 2)
    assert t.optimizer == AdamW(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for key in ("train_micro_batch_size_per_gpu", "zero_optimization.stage",
                "zero_optimization.offload_param.buffer_count", "aio.single_submit"):
        assert key in t.ignored
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_NVME))
    with pytest.warns(UserWarning, match="ignored DeepSpeed keys.*zero_optimization.overlap_comm"):
        assert OffloadConfig.from_deepspeed(path) == c
    with pytest.warns(UserWarning):
        assert load_config(str(path)) == (c, t.optimizer)


def test_deepspeed_adam_means_adamw_unless_disabled():
    base = {"zero_optimization": {"stage": 3}}
    t = translate_deepspeed({**base, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}})
    assert type(t.optimizer) is AdamW and t.optimizer.weight_decay == 0.0
    assert any("adam_w_mode" in n for n in t.notes)
    t = translate_deepspeed({**base, "optimizer": {"type": "Adam", "params": {
        "lr": 1e-4, "adam_w_mode": False, "weight_decay": 0.01}}})
    assert type(t.optimizer) is Adam and t.optimizer == Adam(lr=1e-4, weight_decay=0.01)


def test_deepspeed_fp16_and_defaults():
    t = translate_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                             "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                      "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1}})
    c = t.config
    assert (c.params, c.optimizer, c.dtype) == ("gpu", "cpu", "fp16")
    assert (c.loss_scale, c.initial_scale, c.growth_interval) == ("dynamic", 4096.0, 500)
    assert any("hysteresis" in n for n in t.notes) and any("min_loss_scale" in n for n in t.notes)
    c = translate_deepspeed({"zero_optimization": {}, "fp16": {"enabled": True, "loss_scale": 128}}).config
    assert c.loss_scale == 128.0
    c = translate_deepspeed({"zero_optimization": {"stage": 3}}).config
    assert (c.params, c.optimizer, c.dtype, c.grad_clip) == ("gpu", "auto", "fp32", None)
    c = translate_deepspeed({"zero_optimization": {"cpu_offload": True}, "gradient_clipping": 0}).config
    assert c.optimizer == "cpu" and c.grad_clip is None


def test_deepspeed_hf_auto_values_take_our_defaults():
    t = translate_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                             "train_batch_size": "auto", "gradient_clipping": "auto",
                             "gradient_accumulation_steps": "auto",
                             "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}})
    assert t.config.grad_clip is None and t.config.grad_accum == 1
    assert t.optimizer == AdamW(weight_decay=0.0)


@pytest.mark.parametrize("ds, match", [
    ({"zero_optimization": {"stage": 3, "offload_parm": {}}}, r"'offload_parm' \(did you mean 'offload_param'"),
    ({"zero_optimization": {}, "gradient_clip": 1.0}, r"'gradient_clip' \(did you mean 'gradient_clipping'"),
    ({"zero_optimization": {}, "scheduler": {"type": "WarmupLR"}}, "lr_scheduler"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "nvme_path"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "device='gpu' is invalid"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.3}}}, "ratio"),
    ({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/a"},
                            "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}}, "same path"),
    ({"zero_optimization": {}, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "enable one"),
    ({"zero_optimization": {}, "optimizer": {"type": "Lamb"}}, "'Lamb' is not supported"),
    ({"zero_optimization": {}, "optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "amsgrad"),
    ({"zero_optimization": {}, "optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, "bias_correction"),
    ({"zero_optimization": {}, "optimizer": {"type": "AdamW", "params": {"lr": -1}}}, r"AdamW\.lr=-1"),
    ({"zero_optimization": {}, "aio": {"block_size": 1000}}, r"OffloadConfig\.io_block_size=1000"),
    ({"zero_optimization": {}, "bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16_optimizer_states"),
])
def test_deepspeed_refuses(ds, match):
    with pytest.raises(ValueError, match=match):
        translate_deepspeed(ds)


def test_load_config_detects_deepspeed_and_warns():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg, spec = load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                       "offload_optimizer": {"device": "cpu"}},
                                 "bf16": {"enabled": True}})
    assert (cfg.params, cfg.optimizer, cfg.dtype, spec) == ("cpu", "cpu", "bf16", None)
    assert any("zero_optimization.stage" in str(x.message) for x in w)
