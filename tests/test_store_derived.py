"""Derived payloads ([Note: derived payloads] in runtime/store.py): a payload made from another
one of its chunk (the bf16 params from the fp32 master) holds no host memory; its GPU copy is the
source's CPU copy cast (round to nearest even, as torch casts), remade after every write of the
source, dropped on eviction with nothing written back; writing it, or reading it off the GPU
tier, raises before anything changes. The cast's exactness against the CPU kernels' copy-out is
tested on the CPU here and on CUDA (GPU-marked) below."""
import pytest
import torch

from zero_offload.ops import cpu_adam
from zero_offload.store import ChunkStore, Hop, PayloadSpec, Residency, StoreConfig, StoreError, Tier
from _cpu_adam_util import on_each_isa

N = 1000  # elements: not a multiple of 4 KiB in bytes


def _specs(numel=N, dtype=torch.bfloat16, **params):
    return {"master": PayloadSpec(numel, torch.float32, Tier.CPU),
            "params": PayloadSpec(numel, dtype, Tier.CPU, **{"source": "master", **params})}


def _store(device="cpu", chunks=2, dtype=torch.bfloat16):
    s = ChunkStore(StoreConfig(device=device, budgets={"gpu": 1 << 22, "cpu": 1 << 22}))
    for _ in range(chunks):
        s.add_chunk(_specs(dtype=dtype))
    return s


def _write_master(store, cid, values):
    store.allocate(cid, "master", Tier.CPU).copy_(values)
    store.mark_dirty(cid, "master", Tier.CPU)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_device_copy_is_the_master_cast_and_remade_after_each_write(dtype):
    store = _store(dtype=dtype)
    try:
        assert store.derived(0, "params") and not store.derived(0, "master")
        assert store.bytes(Tier.CPU) == 2 * 4096  # the masters only
        for step in range(3):
            values = torch.randn(N) * 10 ** step
            _write_master(store, 1, values)
            assert store.state(1, "params", Tier.GPU) in (Residency.ABSENT, Residency.STALE)
            moved = store.stats.bytes_moved[Hop.CPU_TO_GPU]
            with store.use(1, "params", Tier.GPU) as buf:
                assert buf.dtype is dtype and torch.equal(buf, values.to(dtype))
            assert store.stats.bytes_moved[Hop.CPU_TO_GPU] - moved == N * 4  # the master's bytes
            with store.use(1, "params", Tier.GPU):  # valid: no second move
                assert store.stats.bytes_moved[Hop.CPU_TO_GPU] - moved == N * 4
        assert store.state(1, "params", Tier.CPU) is Residency.ABSENT
        assert store.bytes(Tier.CPU) == 2 * 4096 and store.bytes(Tier.GPU) == 4096
    finally:
        store.close()


def test_eviction_drops_the_copy_and_writes_nothing_back():
    store = _store()
    try:
        _write_master(store, 0, torch.arange(N, dtype=torch.float32))
        store.fetch(0, "params", Tier.GPU).wait()
        store.evict(0, "params", Tier.GPU)
        store.synchronize()
        assert store.state(0, "params", Tier.GPU) is Residency.ABSENT
        assert store.state(0, "params", Tier.CPU) is Residency.ABSENT
        assert store.bytes(Tier.CPU) == 2 * 4096 and store.bytes(Tier.GPU) == 0
        assert store.stats.bytes_moved[Hop.GPU_TO_CPU] == 0
        with store.use(0, "params", Tier.GPU) as buf:  # made again
            assert torch.equal(buf, torch.arange(N, dtype=torch.float32).to(torch.bfloat16))
    finally:
        store.close()


def test_a_write_into_the_master_waits_for_the_cast_reading_it():
    """WAR: ``get(write=True)`` of the master waits for the move reading it."""
    store = _store()
    try:
        _write_master(store, 0, torch.ones(N))
        handle = store.fetch(0, "params", Tier.GPU)
        store.get(0, "master", Tier.CPU, write=True).fill_(2.0)
        assert handle.done()
        store.mark_dirty(0, "master", Tier.CPU)
        with store.use(0, "params", Tier.GPU) as buf:
            assert torch.equal(buf, torch.full((N,), 2.0, dtype=torch.bfloat16))
    finally:
        store.close()


@pytest.mark.parametrize("call", [
    lambda s: s.allocate(0, "params", Tier.GPU),
    lambda s: s.allocate(0, "params", Tier.CPU),
    lambda s: s.get(0, "params", Tier.GPU, write=True),
    lambda s: s.mark_dirty(0, "params", Tier.GPU),
    lambda s: s.flush(0, "params"),
    lambda s: s.fetch(0, "params", Tier.CPU),
    lambda s: s.rehome(0, "params", Tier.GPU),
    lambda s: s.rehome(0, "master", Tier.GPU),
], ids=["allocate-gpu", "allocate-cpu", "get-write", "mark-dirty", "flush", "fetch-cpu", "rehome", "rehome-source"])
def test_misuse_raises_before_any_change(call):
    store = _store()
    try:
        _write_master(store, 0, torch.ones(N))
        store.fetch(0, "params", Tier.GPU).wait()
        before = (store.bytes(Tier.CPU), store.bytes(Tier.GPU))
        with pytest.raises(StoreError, match="derived payloads"):
            call(store)
        assert (store.bytes(Tier.CPU), store.bytes(Tier.GPU)) == before
        assert store.state(0, "params", Tier.GPU) is Residency.VALID
        assert store.payload_spec(0, "master").home is Tier.CPU
    finally:
        store.close()


@pytest.mark.parametrize("specs,match", [
    ({"params": PayloadSpec(N, torch.bfloat16, Tier.CPU, source="master")}, "no such payload"),
    ({"master": PayloadSpec(N, torch.float32, Tier.GPU),
      "params": PayloadSpec(N, torch.bfloat16, Tier.GPU, source="master")}, "not the CPU"),
    ({"master": PayloadSpec(N, torch.float32, Tier.CPU),
      "params": PayloadSpec(N + 1, torch.bfloat16, Tier.CPU, source="master")}, "elements"),
    ({"master": PayloadSpec(N, torch.float32, Tier.CPU),
      "params": PayloadSpec(N, torch.bfloat16, Tier.GPU, source="master")}, "not with it"),
], ids=["missing", "source-on-gpu", "size", "home"])
def test_add_chunk_checks_the_source(specs, match):
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 1 << 22, "cpu": 1 << 22}))
    try:
        with pytest.raises(StoreError, match=match):
            store.add_chunk(specs)
        assert store.num_chunks == 0 and store.bytes(Tier.CPU) == 0
    finally:
        store.close()
    with pytest.raises(ValueError, match="transient"):
        PayloadSpec(N, torch.bfloat16, Tier.CPU, source="master", transient=True)


def _rounding_cases() -> torch.Tensor:
    """fp32 values at every rounding edge of bf16 and fp16: exact halves between neighbours with
    an even and an odd upper half, one ulp either side, subnormals, the largest finite values
    (which round to inf), infinities, zeros of both signs, and random values of many scales."""
    bits = []
    for upper in (0x3F80, 0x3F81, 0x0001, 0x8001, 0x7F7F, 0xFF7F, 0x4B00, 0x0080):
        for low in (0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF):
            bits.append((upper << 16) | low)
    special = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    edges = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 65504.0, 65520.0, 65519.99, 2.0 ** -24,
                          2.0 ** -25, 3 * 2.0 ** -26, 6.1e-5, -6.1e-5])
    g = torch.Generator().manual_seed(0)
    scales = torch.logspace(-30, 30, 61).repeat_interleave(200)
    rand = torch.randn(scales.numel(), generator=g) * scales
    return torch.cat([special, edges, rand])


def _copy_out(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the CPU-Adam kernel writes as the working copy of ``values`` (an update that leaves
    them unchanged: lr 0)."""
    param = values.clone()
    out = torch.empty(values.numel(), dtype=dtype)
    cpu_adam.adam_step(param, torch.zeros_like(param), torch.zeros_like(param), torch.zeros_like(param),
                       step=1, lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True,
                       out_lowp=out, threads=1)
    assert torch.equal(param.view(torch.int32), values.view(torch.int32))
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_cast_rounds_as_the_kernels_copy_out(dtype):
    """The store's cast (torch's ``copy_`` between dtypes, on the CPU here) gives the bits the
    native copy-out gives, on every ISA path; NaN stays NaN (its bit pattern may differ)."""
    values = _rounding_cases()
    cast = values.to(dtype)
    for isa, out in on_each_isa(lambda: _copy_out(values, dtype)):
        assert _same_bits(out, cast), isa
    nan = _copy_out(torch.tensor([float("nan")] * 16), dtype)
    assert torch.isnan(nan.float()).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_cast_rounds_as_the_kernels_copy_out(dtype):
    """On CUDA: the store's derive (the pinned master up into fp32 staging, one cast kernel on
    the H2D stream) gives the native copy-out's bits."""
    values = _rounding_cases()
    store = ChunkStore(StoreConfig(device="cuda", budgets={"gpu": 1 << 26, "cpu": 1 << 26}))
    try:
        cid = store.add_chunk(_specs(numel=values.numel(), dtype=dtype))
        _write_master(store, cid, values)
        with store.use(cid, "params", Tier.GPU) as buf:
            got = buf.cpu()
        assert _same_bits(got, _copy_out(values, dtype))
        assert _same_bits(got, values.cuda().to(dtype).cpu())
    finally:
        store.close()
