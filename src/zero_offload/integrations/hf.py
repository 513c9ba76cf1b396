"""Hugging Face ``transformers.Trainer`` with zero_offload: params, grads and Adam state offloaded.

    from zero_offload.integrations.hf import ZeroOffloadTrainer

    trainer = ZeroOffloadTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                                 offload_config=zo.OffloadConfig(params="cpu", optimizer="cpu"))
    trainer.train()                    # or trainer.train(resume_from_checkpoint=True)
    trainer.save_model("out/")         # from_pretrained("out/") loads it

Why a Trainer subclass. A callback only observes the loop (it cannot change how backward, the
optimizer step or saving run). Accelerate's plugins are a closed set the ``Accelerator``
recognises by type (DeepSpeed, FSDP, ...), and the Trainer branches on DeepSpeed by name in many
places: a third-party engine cannot plug in there without patching both. A ``Trainer``
subclass is how the ecosystem adds a training backend (TRL's trainers are subclasses too): the
user swaps one class name and adds one argument, keeps ``TrainingArguments``, datasets,
collators, callbacks and metrics, and every ``Trainer`` method (``train``, ``evaluate``,
``predict``, ``save_model``, checkpoints, ``resume_from_checkpoint``) keeps its meaning. The
subclass overrides the Trainer's documented hooks only where the engine does the work:

- ``create_optimizer``: builds the engine (``zero_offload.initialize``) on first use, from the
  model and ``TrainingArguments`` (AdamW with ``learning_rate``, ``adam_beta1/2``,
  ``adam_epsilon``, ``weight_decay`` and the Trainer's own no-decay group of biases and norms;
  ``gradient_accumulation_steps``, ``max_grad_norm`` and ``bf16`` become the engine's
  ``grad_accum``, ``grad_clip`` and ``dtype``). The optimizer the Trainer sees is a view of the
  engine's hyperparameters ([Note: the Trainer's optimizer]), so the Trainer's own lr scheduler
  (``lr_scheduler_type``, warmup) drives the engine's param groups.
- ``_wrap_model``: the model the Trainer calls is a small module whose forward is the engine's
  (the user's model is never moved to the GPU whole, nor wrapped by Accelerate).
- the Trainer's own ``training_step`` (loss, its accumulation scaling), with backward and
  clipping done by the engine ([Note: the Trainer's accelerator], [Note: accumulation windows]).
- ``save_model``, ``_save_optimizer_and_scheduler``, ``_load_optimizer_and_scheduler``,
  ``_load_from_checkpoint``: weights leave the engine chunk by chunk (``Engine.save_weights``;
  a PEFT model's adapters through ``PeftModel.save_pretrained``), and a checkpoint holds the
  engine's checkpoint (``checkpoint-N/zero_offload/``) beside the Trainer's files.

[Note: the Trainer's optimizer] ``_EngineOptimizer`` holds no parameters: its ``param_groups``
*are* the engine's hyperparameter groups (``engine.optimizer.param_groups``, read through on
every access, so a checkpoint load that replaces that list is seen at once). The scheduler the
Trainer builds on it writes ``lr`` there, and the engine reads it when it queues each update,
as torch's AdamW reads its groups in ``step()``. Its ``step()`` does no work: the engine
updated the parameters at the end of the window's last backward.

[Note: the Trainer's accelerator] The Trainer runs backward and clipping through its own
``Accelerator`` (``accelerator.backward(loss)`` in ``training_step``, ``accelerator.
clip_grad_norm_`` in its loop; in transformers 4.x inline, in 5.x through ``_clip_grad_norm``).
Once the engine exists, this trainer's accelerator has both as instance attributes that call
the engine instead (``_engine_backward``, ``_engine_grad_norm``): one place that holds in every
Trainer version, where overriding ``training_step`` or the loop would copy version-specific
code (the loss's accumulation scaling, the clip's call site). The accelerator is the Trainer's
own (``create_accelerator_and_postprocess``), made for this trainer alone.

[Note: accumulation windows] The engine counts micro-batches itself (``grad_accum``); the
Trainer says which micro-batch ends a window (``accelerator.sync_gradients``, set before each
``training_step``), and may end one early (the last window of an epoch with fewer batches than
``gradient_accumulation_steps``). So the trainer's backward runs the engine's backward and then
``engine.step()`` after every micro-batch, and before the last backward of a short window it
calls ``engine.step()`` once per missing micro-batch: an empty micro-batch (no grads), which
moves the engine's window to its last position, so the backward that follows ends the window
exactly where the Trainer does, with the grads it has. Clipping runs inside that last step
(exact global norm), so the Trainer's clip call only reports the engine's norm.

``torch_compile=True`` compiles the model region by region before the engine is built
([Note: the Trainer's torch_compile]).

Limits: ``fp16`` (the engine has its own loss scaler; use ``bf16`` or the engine directly),
optimizers other than AdamW, ``model_init``, ``optimizers=``, DeepSpeed/FSDP arguments and
``nn.DataParallel`` (several GPUs without a launcher) are refused at construction with the fix.
Several GPUs: launch with ``torchrun``; the engine takes the process group the Trainer starts
(untested with the Trainer here; the engine's own data parallelism is tested).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch
from torch import nn

from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

from ..config import AdamW, OffloadConfig, load_config
from ..runtime.checkpoint import chunk_state
from ..engine import Engine, initialize

__all__ = ["ZeroOffloadTrainer", "ENGINE_DIR", "ADAMW_OPTIMIZERS"]

ENGINE_DIR = "zero_offload"
"""The engine's checkpoint inside a Trainer checkpoint directory (``checkpoint-N/zero_offload``)."""

ADAMW_OPTIMIZERS = frozenset({"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused",
                              "adamw_torch_npu_fused", "adamw_torch_xla"})
"""``TrainingArguments.optim`` values that mean torch's AdamW rule, which the engine runs."""

_FROM_ARGS = {"dtype": "bf16=True", "grad_accum": "gradient_accumulation_steps",
              "grad_clip": "max_grad_norm"}
"""``OffloadConfig`` fields the Trainer's arguments set (and where)."""

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


class ZeroOffloadTrainer(Trainer):
    """``transformers.Trainer`` that trains through a zero_offload engine: the model's params,
    grads and AdamW state live where ``offload_config`` places them (GPU, pinned host memory,
    NVMe) and stream to the compute device. See the module docstring.

    Args:
        *args, **kwargs: ``transformers.Trainer``'s.
        offload_config: ``zero_offload.OffloadConfig``, a dict of its fields or a JSON file
            (None: ``OffloadConfig()``): placement, budgets, ``nvme_dir``, prefetch, chunk
            size, threads. Leave ``dtype``, ``grad_accum`` and ``grad_clip`` at their defaults:
            ``TrainingArguments`` sets them (``bf16``, ``gradient_accumulation_steps``,
            ``max_grad_norm``).
    """

    def __init__(self, *args, offload_config: Any = None, **kwargs):
        self._engine: Optional[Engine] = None
        self._module: Optional[_EngineModule] = None
        super().__init__(*args, **kwargs)
        self._offload_config = _resolve_config(offload_config, self.args)
        self._check_supported()
        self._model_dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()),
                                 torch.float32)

    # ---- the engine -------------------------------------------------------------------------

    @property
    def engine(self) -> Optional[Engine]:
        """The engine (built by the first ``train``/``evaluate``/``predict``), or None."""
        return self._engine

    def _ensure_engine(self) -> Engine:
        if self._engine is None:
            args = self.args
            spec = AdamW(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                         eps=args.adam_epsilon, weight_decay=args.weight_decay)
            if args.torch_compile:  # [Note: the Trainer's torch_compile]
                self._compile_regions()
            decay = set(self.get_decay_parameter_names(self.model))
            no_decay = [n for n, p in self.model.named_parameters() if p.requires_grad and n not in decay]
            # The Trainer's two groups, in its order: decay (group 0, the spec's), no decay.
            self._engine = initialize(self.model, optimizer=spec, config=self._offload_config,
                                      param_groups=[{"params": no_decay, "weight_decay": 0.0}],
                                      device=args.device)
            self._module = _EngineModule(self._engine)
            # [Note: the Trainer's accelerator]
            self.accelerator.backward = self._engine_backward
            self.accelerator.clip_grad_norm_ = self._engine_grad_norm
        return self._engine

    def _compile_regions(self) -> None:
        """[Note: the Trainer's torch_compile] ``torch_compile=True`` makes the plain Trainer's
        Accelerator wrap the whole model in ``torch.compile``; the engine's units are modules, so
        here the model is compiled region by region in place, before ``initialize``: each
        repeated block (the decoder layers) and each other leaf child (embeddings, final norm,
        head), with the arguments the Trainer would use (``torch_compile_backend``,
        ``torch_compile_mode``), through Accelerate's own regional compilation
        (``compile_regions_fsdp2``: ``module.compile()`` in place, names unchanged). A mode the
        engine cannot run (CUDA graphs: ``reduce-overhead``) is refused by ``initialize`` with
        the fix. The Trainer never sees an ``OptimizedModule`` (``_wrap_model`` returns the
        engine's module), so nothing is compiled twice."""
        try:
            from accelerate.utils import compile_regions_fsdp2
        except ImportError as e:  # an accelerate without regional compilation
            raise ValueError(f"ZeroOffloadTrainer: torch_compile=True needs accelerate's regional "
                             f"compilation ({e}); upgrade accelerate or set "
                             f"torch_compile=False") from None
        kwargs = self.accelerator.state.dynamo_plugin.to_kwargs()
        compile_regions_fsdp2(self.model, **kwargs)

    def _check_supported(self) -> None:
        args = self.args
        refusals = []
        if args.fp16:
            refusals.append("fp16=True: the engine scales fp16 losses itself; use bf16=True (bf16 "
                            "params, fp32 master weights) or the engine directly with "
                            "OffloadConfig(dtype='fp16')")
        optim = getattr(args.optim, "value", args.optim)
        if optim not in ADAMW_OPTIMIZERS or args.optim_args:
            refusals.append(f"optim={optim!r}{' with optim_args' if args.optim_args else ''}: the "
                            f"engine runs AdamW; use optim='adamw_torch' (the default)")
        if self.optimizer is not None or self.lr_scheduler is not None or self.optimizer_cls_and_kwargs:
            refusals.append("optimizers=/optimizer_cls_and_kwargs=: the engine owns the optimizer; "
                            "set its hyperparameters in TrainingArguments (learning_rate, "
                            "adam_beta1/2, adam_epsilon, weight_decay, lr_scheduler_type)")
        if self.model_init is not None:
            refusals.append("model_init=: pass the model itself")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or args.fsdp:
            refusals.append("deepspeed/fsdp arguments: ZeroOffloadTrainer replaces them; remove them")
        if args.n_gpu > 1:
            refusals.append(f"{args.n_gpu} GPUs in one process (nn.DataParallel): launch with torchrun, "
                            f"one process per GPU, or set CUDA_VISIBLE_DEVICES to one GPU")
        if refusals:
            raise ValueError("ZeroOffloadTrainer: " + "; ".join(refusals))

    def _move_model_to_device(self, model, device):
        """Not moved: the engine pages each chunk to the device when it is used (the whole model
        need not fit there)."""

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        self._ensure_engine()
        return self._module

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = _EngineOptimizer(self._ensure_engine())
        return self.optimizer

    # ---- a training step ([Note: the Trainer's accelerator]) -----------------------------------

    def _engine_backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``accelerator.backward`` for this trainer; see [Note: accumulation windows]."""
        if kwargs:
            raise TypeError(f"ZeroOffloadTrainer: backward got {sorted(kwargs)}, which the engine "
                            f"does not take")
        engine = self._engine
        last = engine.config.grad_accum - 1
        if self.accelerator.sync_gradients:
            while engine.micro_step < last:  # a shorter window: empty micro-batches first
                engine.step()
        elif engine.micro_step == last:
            raise RuntimeError(
                f"ZeroOffloadTrainer: micro-batch {last + 1} of {last + 1} does not end the Trainer's "
                f"accumulation window; the engine's window (grad_accum) and the Trainer's "
                f"(gradient_accumulation_steps) disagree. Please report this")
        engine.backward(loss)
        engine.step()

    def _engine_grad_norm(self, parameters=None, max_norm=None, norm_type=2):
        """``accelerator.clip_grad_norm_`` for this trainer: clipping ran in the engine's step
        (exact global norm); this returns that norm (None when no clipping asked for one)."""
        return self._engine.last_grad_norm

    # ---- saving and loading -----------------------------------------------------------------

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Write the model so that ``from_pretrained(output_dir)`` loads it: a PEFT model's
        adapters (``adapter_model.safetensors``), else the weights streamed chunk by chunk in the
        model's dtype (``Engine.save_weights``), plus the tokenizer and ``training_args.bin``.
        Collective with several ranks (call it on every rank, as the Trainer does)."""
        if self._engine is None:  # never trained: a plain model
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if _is_peft(self.model):
            values = self._trainable_values()
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                self.model.save_pretrained(output_dir, state_dict=values)
        elif _has_weight_conversions(self.model):  # on-disk names differ: HF's own save renames
            values = self._engine.state_dict(rank0_only=True)
            if self.args.should_save:
                self.model.save_pretrained(output_dir, state_dict=values)
        else:
            self._save_weights(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            elif getattr(self.data_collator, "tokenizer", None) is not None:
                self.data_collator.tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    def _trainable_values(self) -> dict:
        """{name: fp32 CPU tensor} of the trainable parameters only (every name of a tied one),
        read chunk by chunk from the engine; the frozen base is not gathered. Collective."""
        engine = self._engine
        names: dict = {}
        for name, slot in engine.partition.names.items():
            names.setdefault(slot.index, []).append(name)
        engine.synchronize()
        out = {}
        for layout in engine.partition.chunks:
            if not layout.trainable:
                continue
            flat = chunk_state(engine.group, layout)["master"]
            for s in layout.slots:
                value = flat[s.offset:s.end].view(s.shape).clone()
                for name in names[s.index]:
                    out[name] = value
        return out

    def _save_weights(self, output_dir: str) -> None:
        """``Engine.save_weights`` into ``output_dir``; a directory that holds files already (the
        run's output_dir) gets the new weight files moved in, replacing an earlier save's."""
        dtype = self._model_dtype if self._model_dtype in (torch.bfloat16, torch.float16) else None
        busy = os.path.isdir(output_dir) and bool(os.listdir(output_dir))
        target = os.path.join(output_dir, f".zero_offload-weights-{os.getpid()}") if busy else output_dir
        self._engine.save_weights(target, dtype=dtype)
        if busy and self.args.should_save:
            new = os.listdir(target)
            for name in os.listdir(output_dir):  # an earlier save's weight files (shards too)
                stem = name.split("-0")[0]
                if name not in new and (name in _WEIGHT_FILES or f"{stem}.safetensors" in _WEIGHT_FILES
                                        or f"{stem}.bin" in _WEIGHT_FILES):
                    os.remove(os.path.join(output_dir, name))
            for name in new:
                os.replace(os.path.join(target, name), os.path.join(output_dir, name))
            os.rmdir(target)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self._engine.save_checkpoint(os.path.join(output_dir, ENGINE_DIR))  # collective
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if os.path.isdir(os.path.join(resume_from_checkpoint, ENGINE_DIR)):
            return  # the engine's checkpoint holds the weights: loaded with the optimizer state
        if self._engine is not None:
            raise ValueError(f"ZeroOffloadTrainer: {resume_from_checkpoint} holds no {ENGINE_DIR}/ "
                             f"engine checkpoint; resume from a checkpoint this trainer wrote")
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, ENGINE_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"ZeroOffloadTrainer: {checkpoint} holds no {ENGINE_DIR}/ engine checkpoint (it was "
                f"not written by ZeroOffloadTrainer, or with save_only_model=True); resume from a "
                f"checkpoint this trainer wrote, or load its weights with from_pretrained and call "
                f"train() without resume_from_checkpoint")
        self._ensure_engine().load_checkpoint(path)
        scheduler = torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
        self.lr_scheduler.load_state_dict(scheduler)

    def _load_best_model(self) -> None:
        if self._engine is None:
            return super()._load_best_model()
        self._engine.load_checkpoint(os.path.join(self.state.best_model_checkpoint, ENGINE_DIR))


class _EngineModule(nn.Module):
    """The model as the Trainer calls it: its forward is the engine's. The user's model is not a
    submodule (Accelerate and ``.to()`` must not move or wrap it); ``parameters()`` lists its
    parameters (metadata only: counts, ``requires_grad``)."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.engine = engine

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def train(self, mode: bool = True) -> "_EngineModule":
        super().train(mode)
        self.engine.train(mode)
        return self

    def parameters(self, recurse: bool = True):
        return self.engine.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.engine.module.named_parameters(*args, **kwargs)

    def _get_name(self) -> str:  # the Trainer's label smoother asks the model's class name
        return self.engine.module._get_name()


class _EngineOptimizer(torch.optim.Optimizer):
    """The optimizer the Trainer steps and schedules; see [Note: the Trainer's optimizer]. It
    holds no parameters and does no work (``torch.optim.Optimizer.__init__`` is not called)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.defaults = engine.optimizer.defaults
        self.state: dict = {}

    @property
    def param_groups(self) -> list:
        return self.engine.optimizer.param_groups

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ZeroOffloadTrainer's optimizer takes no closure")
        if self.engine.micro_step != 0:
            raise RuntimeError(
                f"ZeroOffloadTrainer: optimizer.step() came {self.engine.micro_step} micro-batch(es) "
                f"into the engine's accumulation window; the engine updates at the end of the "
                f"window's last backward. Please report this")
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # the engine consumes grads as they land

    def state_dict(self) -> dict:
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.engine.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("ZeroOffloadTrainer's optimizer takes no param groups: the engine "
                           "holds the model's parameters")


def _resolve_config(offload_config: Any, args) -> OffloadConfig:
    """The user's ``OffloadConfig`` with ``dtype``, ``grad_accum`` and ``grad_clip`` from
    ``TrainingArguments``; a different value set in the config is refused (one place for each)."""
    cfg, spec = load_config(OffloadConfig() if offload_config is None else offload_config)
    if spec is not None:
        raise ValueError("ZeroOffloadTrainer: offload_config has an optimizer section; the optimizer "
                         "comes from TrainingArguments (learning_rate, adam_beta1/2, adam_epsilon, "
                         "weight_decay): remove it")
    wanted = dict(dtype="bf16" if args.bf16 else "fp32",
                  grad_accum=int(args.gradient_accumulation_steps),
                  grad_clip=float(args.max_grad_norm) if args.max_grad_norm and args.max_grad_norm > 0 else None)
    default = OffloadConfig()
    for name, value in wanted.items():
        have = getattr(cfg, name)
        have = getattr(have, "value", have)
        if have != getattr(getattr(default, name), "value", getattr(default, name)) and have != value:
            raise ValueError(f"ZeroOffloadTrainer: offload_config.{name}={have!r} but TrainingArguments "
                             f"gives {value!r}; set it in TrainingArguments ({_FROM_ARGS[name]}) and "
                             f"leave offload_config.{name} at its default")
    return dataclasses.replace(cfg, **wanted)


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _has_weight_conversions(model: nn.Module) -> bool:
    """Whether Hugging Face saves this model under names other than its parameters' (the weight
    conversions of transformers 5, e.g. fused MoE experts; ``_checkpoint_conversion_mapping``
    in 4.x): then ``save_pretrained`` must write it, from a whole state dict."""
    if getattr(model, "_checkpoint_conversion_mapping", None):
        return True
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return False
    try:
        return bool(get_model_conversion_mapping(model, add_legacy=False))
    except TypeError:  # another signature: assume it may rename
        return True
