"""What both front ends (engine.py's ``Engine``, offload_optim.py's ``OffloadAdam``) do the same way
for a chunk's update, written once: the update segments of a chunk and the Adam arguments of a
param group.

This is the first part of the chunk-group runtime (issue 11; FSDP2's ``FSDPParamGroup`` is the
model); slot and chunk records, grad staging, copy-back and per-chunk state I/O still live in
each front end.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from .pipeline import AdamArgs

__all__ = ["adam_args", "update_segments"]


def update_segments(spans: Iterable[tuple[int, int, int, Any]]) -> list[tuple[int, int, int, Any]]:
    """Maximal runs ``(lo, hi, step, key)`` of the element ranges ``(lo, hi, step, key)`` of the
    slots one update covers (in offset order): touching ranges with the same step count (after
    this update) and the same ``key`` (e.g. the param group) merge, so each run is one CPU-Adam
    call (normally one per chunk)."""
    out: list[list] = []
    for lo, hi, step, key in spans:
        last = out[-1] if out else None
        if last is not None and last[1] == lo and last[2] == step and last[3] == key:
            last[1] = hi
        else:
            out.append([lo, hi, step, key])
    return [tuple(r) for r in out]


def adam_args(group: Mapping, *, adamw: bool, grad_scale: float = 1.0) -> AdamArgs:
    """The ``AdamArgs`` of a torch param group, read now (an lr scheduler may have changed it);
    a tensor lr (``torch.optim`` allows one) is unwrapped to a float."""
    lr = group["lr"]
    return AdamArgs(lr=float(lr.item() if hasattr(lr, "item") else lr),
                    betas=tuple(float(b) for b in group["betas"]), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), adamw=adamw, grad_scale=grad_scale)
