"""Shared helpers of the test_aio_* / test_swap_* files (not a test module)."""
import os

import torch

from zero_offload.swap_io import aligned_empty


def random_buffer(nbytes: int) -> torch.Tensor:
    """An aligned_empty buffer of ``nbytes`` (>= 1) holding os.urandom bytes."""
    t = aligned_empty(nbytes)
    t.copy_(torch.frombuffer(bytearray(os.urandom(nbytes)), dtype=torch.uint8))
    return t


def open_direct(path) -> int:
    """An O_RDWR | O_CREAT | O_DIRECT descriptor of ``path`` (mode 0600)."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
