"""``engine.optimizer``: the torch.optim handle of the engine's hyperparameters, for lr
schedulers (``HyperParams``)."""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["HyperParams"]


class HyperParams(torch.optim.Optimizer):
    """The optimizer handle an lr scheduler drives: one param group per engine param group (group 0:
    the defaults), holding the hyperparameters of the update rule (its ``hyper_keys``; Adam: lr,
    betas, eps, weight_decay) that every update reads when it is queued. Each group holds one
    empty placeholder tensor, not the model's parameters (their values live in the engine's
    chunks); it cannot step by itself (``engine.step()`` does)."""

    def __init__(self, defaults: dict, overrides: Sequence[dict] = ()):
        super().__init__([{"params": [torch.zeros(0)]}]
                         + [{"params": [torch.zeros(0)], **o} for o in overrides], defaults)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, less its ``torch._disable_dynamo`` wrapper: that wrapper's first call in a
        process imports torch._dynamo, 3.7 s of ``initialize`` on the H200 hosts (session 21).
        The groups here are the engine's own (one new placeholder tensor each), so torch's
        checks of the params (leaves, duplicates, names) have nothing to find."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        param_group["params"] = list(param_group["params"])
        for name, default in self.defaults.items():
            param_group.setdefault(name, default)
        self.param_groups.append(param_group)

    def step(self, closure=None):
        raise RuntimeError("engine.optimizer holds hyperparameters only; call engine.step()")

    def note_update(self) -> None:
        """An update used these hyperparameters. torch's LRScheduler looks for this flag to tell
        a scheduler stepped after the optimizer from one stepped before it (and warns)."""
        self._opt_called = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # the engine consumes grads itself
