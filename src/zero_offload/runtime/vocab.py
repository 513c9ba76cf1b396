"""Words every layer uses: the O_DIRECT alignment and where a payload may be homed.

Kept apart so the I/O engine, the pool, the store, placement and the config share one copy
without importing each other."""
from __future__ import annotations

import enum

__all__ = ["ALIGNMENT", "Placement", "human_bytes", "round_up"]

ALIGNMENT = 4096
"""O_DIRECT rule used everywhere here: buffer addresses, file offsets and sizes are multiples."""


def round_up(nbytes: int, multiple: int = ALIGNMENT) -> int:
    """Smallest multiple of ``multiple`` that is >= ``nbytes``."""
    return -(-nbytes // multiple) * multiple


def human_bytes(n: float) -> str:
    """``n`` bytes for people: "512B", "1.5GiB" (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"


class Placement(enum.StrEnum):
    """Home tier of a payload, as a user asks for it. A ``StrEnum``: ``Placement.CPU == "cpu"``
    holds. The store's ``Tier`` has the same three places but no ``AUTO``: auto is a request that
    placement resolves, never a place a copy lives."""

    GPU = "gpu"
    """The compute device (CUDA; the CPU itself with its own budget when there is no CUDA)."""
    CPU = "cpu"
    """Pinned host memory."""
    NVME = "nvme"
    """Files under ``OffloadConfig.nvme_dir``, staged through pinned host memory."""
    AUTO = "auto"
    """Fill the fastest tier first within its budget, then the next, per chunk."""
