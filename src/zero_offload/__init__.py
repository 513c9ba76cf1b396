"""zero_offload: single-node offload engine for PyTorch training.

Pages partitioned parameters, gradients and Adam state between GPU memory, pinned CPU memory and
NVMe files through asynchronous prefetch queues, while a vectorised C++ CPU-Adam updates
offloaded shards in parallel with GPU compute.

The public API is the names in ``__all__``; submodules load on first use, so ``import
zero_offload`` stays cheap and a CPU-only script never touches the I/O or engine code.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    # optimizer (issue 2)
    "CPUAdam": "cpu_adam",
    "CPUAdamW": "cpu_adam",
    # NVMe swap (issue 3)
    "SwapSpace": "swap_io",
    "AioEngine": "swap_io",
    # tiered store (issue 4)
    "Tier": "store",
    "ChunkStore": "store",
    "StoreConfig": "store",
    # engine (issue 5)
    "OffloadConfig": "config",
    "Adam": "config",
    "AdamW": "config",
    "initialize": "engine",
    "Engine": "engine",
    "OffloadAdam": "offload_optim",
    "OffloadAdamW": "offload_optim",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zero_offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
