"""zero_offload: single-node offload engine for PyTorch training.

Pages partitioned parameters, gradients and Adam state between GPU memory, pinned CPU memory and
NVMe files through asynchronous prefetch queues, while a vectorised C++ CPU-Adam updates
offloaded shards in parallel with GPU compute.

The public API is the names in ``__all__``; submodules load on first use, so ``import
zero_offload`` stays cheap and a CPU-only script never touches the I/O or engine code.
"""
import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

_EXPORTS = {
    # optimizer (issue 2)
    "CPUAdam": "ops.cpu_adam",
    "CPUAdamW": "ops.cpu_adam",
    # NVMe swap (issue 3)
    "SwapSpace": "runtime.swap_io",
    "AioEngine": "runtime.swap_io",
    # tiered store (issue 4)
    "Tier": "runtime.store",
    "ChunkStore": "runtime.store",
    "StoreConfig": "runtime.store",
    # engine (issue 5)
    "OffloadConfig": "config",
    "Adam": "config",
    "AdamW": "config",
    # optimizers beyond Adam (issue 25)
    "SGD": "config",
    "Lion": "config",
    "Adafactor": "config",
    "Muon": "config",
    "initialize": "engine",
    "Engine": "engine",
    "OffloadAdam": "offload_optim",
    "OffloadAdamW": "offload_optim",
    "OffloadSGD": "offload_optim",
    "OffloadLion": "offload_optim",
    "OffloadAdafactor": "offload_optim",
    "OffloadMuon": "offload_optim",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

_MOVED = {f"{__name__}.{old}": f"{__name__}.{new}" for old, new in {
    "store": "runtime.store", "swap_io": "runtime.swap_io", "prefetch": "runtime.prefetch",
    "pipeline": "runtime.pipeline", "cpu_adam": "ops.cpu_adam",
    "distributed": "runtime.distributed"}.items()}
"""Public paths (README) of modules that live in the layers below: ``zero_offload.store`` *is*
``zero_offload.runtime.store`` (the same module object), imported on first use."""


class _MovedPath(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        home = _MOVED.get(fullname)
        return None if home is None else importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # the import system set the alias's spec


sys.meta_path.append(_MovedPath())


def __getattr__(name):
    if f"{__name__}.{name}" in _MOVED:  # zero_offload.pipeline without importing it first
        return importlib.import_module(f"{__name__}.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zero_offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
