"""Park and resume on CUDA ([Note: parking] in runtime/parking.py): after ``engine.park()`` the
engine holds no GPU memory (``torch.cuda.memory_allocated`` is back at what it was before
``initialize``), the caching allocator has given it back to the driver (``mem_get_info``'s free
memory grew by it), the model's buffers live on the host; ``resume()`` brings everything back and
the next steps equal, bit for bit, those of an engine that never parked (BatchNorm's running
statistics included), for params and optimizer on the device (the GPU share), paged from the host,
and parked on NVMe. ``resume`` refuses, still parked, while another allocation holds the memory."""
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import zero_offload as zo
from zero_offload.runtime.checkpoint import chunk_state
from zero_offload.runtime.store import Tier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
MiB = 2 ** 20


class Net(nn.Module):
    """Linears around a BatchNorm: buffers that change every step (running statistics)."""

    def __init__(self, d=256):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(d, 4 * d)
        self.norm = nn.BatchNorm1d(4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, x):
        return self.fc2(F.gelu(self.norm(self.fc1(x)))) * self.scale


def _batches(n, d=256):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, d, generator=g), torch.randn(32, d, generator=g)) for _ in range(n)]


def _train(engine, batches) -> list:
    out = []
    for x, y in batches:
        loss = F.mse_loss(engine(x).float(), y.cuda())
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _state(engine) -> dict:
    out = {f"param {k}": v for k, v in engine.state_dict().items()}
    for layout in engine.partition.chunks:
        for k, v in chunk_state(engine.group, layout).items():
            out[f"chunk {layout.index} {k}"] = v
    return out


CASES = {
    "gpu-share": dict(params="gpu", optimizer="auto", dtype="bf16", gpu_budget=24 * MiB),  # one chunk of two
    "params-cpu": dict(params="cpu", optimizer="cpu", dtype="bf16"),
    "auto": dict(params="auto", optimizer="auto", dtype="bf16", gpu_budget=16 * MiB),  # params on the GPU, optimizer on the host
}


def _config(kw, tmp_path):
    return zo.OffloadConfig(**{**dict(chunk_mb=1, cpu_budget=1 << 30, nvme_dir=str(tmp_path)), **kw})


@pytest.mark.parametrize("target", ["cpu", "nvme"])
@pytest.mark.parametrize("case", list(CASES))
def test_park_frees_the_gpu_and_resume_goes_on_exactly(case, target, tmp_path):
    cfg, batches = _config(CASES[case], tmp_path), _batches(5)
    plain = zo.initialize(Net(), optimizer=SPEC, config=cfg, device="cuda")
    want = _train(plain, batches)
    want_state = _state(plain)
    plain.close()
    del plain
    torch.cuda.synchronize()
    torch.cuda.empty_cache()

    base = torch.cuda.memory_allocated()
    engine = zo.initialize(Net(), optimizer=SPEC, config=cfg, device="cuda")
    try:
        got = _train(engine, batches[:2])
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        assert held > 0
        free_before = torch.cuda.mem_get_info()[0]
        report = engine.park(target)
        assert report.where == target and engine.store.bytes(Tier.GPU) == 0
        left = torch.cuda.memory_allocated() - base
        assert left <= 64 * 1024, f"{left} bytes still allocated by the engine after park"
        assert torch.cuda.memory_reserved() <= base + 2 * MiB + left  # the allocator let it go
        gained = torch.cuda.mem_get_info()[0] - free_before
        assert gained >= 0.9 * held, (gained, held)  # back to the driver: another process can take it
        assert engine.module.norm.running_mean.device.type == "cpu"
        assert engine.module.scale.device.type == "cpu"
        engine.resume()
        assert engine.module.norm.running_mean.device.type == "cuda"
        got += _train(engine, batches[2:])
        assert got == want
        state = _state(engine)
        assert state.keys() == want_state.keys()
        for k in state:
            if isinstance(state[k], torch.Tensor):
                assert torch.equal(state[k], want_state[k]), k
            else:
                assert state[k] == want_state[k], k
    finally:
        engine.close()


def test_resume_refuses_while_another_allocation_holds_the_memory(tmp_path):
    # d=2048 in a 1 GiB budget: about 0.5 GB on the device, so that half of it is well above what
    # the driver keeps back (d=256 in 24 MiB, 8 MiB: the hog itself could not be allocated on an
    # H200, session 21)
    config = _config({**CASES["gpu-share"], "gpu_budget": 1 << 30}, tmp_path)
    engine = zo.initialize(Net(2048), optimizer=SPEC, config=config, device="cuda")
    try:
        _train(engine, _batches(1, d=2048))
        engine.park("cpu")
        free = torch.cuda.mem_get_info()[0]
        need = engine.store.gpu_home_bytes()
        assert need > 256 * MiB, need
        hog = torch.empty(free - need // 2, dtype=torch.uint8, device="cuda")  # "the inference engine"
        with pytest.raises(MemoryError, match=r"engine.resume: the state needs .* of GPU memory, and "
                                              r"cuda:\d has .* free .*still parked"):
            engine.resume()
        assert engine.parked == "cpu"
        del hog
        torch.cuda.empty_cache()
        engine.resume()
        _train(engine, _batches(1, d=2048))
    finally:
        engine.close()
