"""Mixed-precision pieces of the engine: input casting and fp16 loss scaling.

The recipe (the reference the tests compare against, done by hand in plain torch):

- the user's model is fp32; the engine keeps an fp32 *master* copy of every trainable parameter
  (with the Adam moments) and a *working* copy in ``OffloadConfig.dtype`` that the compute device
  runs on; floating-point inputs are cast to the working dtype;
- grads come out in the working dtype; CPU-Adam reads them, updates the fp32 master and writes
  the working copy rounded to nearest even;
- fp16 only: the loss is multiplied by a scale before backward and grads are divided by it in
  the update; on inf/NaN the step is skipped and the scale backs off, after ``growth_interval``
  clean steps it grows (``torch.amp.GradScaler`` rules, ``LossScaler`` below).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

__all__ = ["LossScaler", "cast_inputs"]


def _fp32(x: float) -> float:
    """Round to float32, as GradScaler keeps its scale in a float32 tensor."""
    return torch.tensor(x, dtype=torch.float32).item()


@dataclass(kw_only=True)
class LossScaler:
    """Loss scale for fp16 training with ``torch.amp.GradScaler``'s update rule.

    ``dynamic=False`` keeps ``scale`` fixed (steps with inf/NaN grads are still skipped, since
    applying them would corrupt the master weights).
    """

    scale: float
    dynamic: bool
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0
    """Clean steps since the last growth or backoff (GradScaler's ``_growth_tracker``)."""

    @classmethod
    def from_config(cls, config) -> "LossScaler | None":
        """The scaler an ``OffloadConfig`` asks for: None unless ``dtype == "fp16"``."""
        if config.torch_dtype is not torch.float16:
            return None
        if config.loss_scale == "dynamic":
            return cls(scale=_fp32(config.initial_scale), dynamic=True,
                       growth_factor=config.growth_factor, backoff_factor=config.backoff_factor,
                       growth_interval=config.growth_interval)
        return cls(scale=_fp32(config.loss_scale), dynamic=False)

    def update(self, *, found_inf: bool) -> None:
        """After a step: back off on overflow, grow after ``growth_interval`` clean steps."""
        if not self.dynamic:
            return
        if found_inf:
            self.scale = _fp32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale = _fp32(self.scale * self.growth_factor)
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])


def cast_inputs(obj, *, dtype: torch.dtype, device: torch.device):
    """Every tensor in a (nested) structure moved to ``device``; floating-point ones also cast to
    the working ``dtype`` (integer ids, masks and indices keep theirs)."""

    def cast(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_floating_point() and x.dtype is not dtype:
            return x.to(device=device, dtype=dtype, non_blocking=True)
        return x.to(device=device, non_blocking=True)

    return tree_map(cast, obj)
