"""The store's CUDA paths: copies on the H2D/D2H streams with events, the consumer's stream
waiting device-side, pinned CPU copies, and the dict-model property test with CUDA."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_store_model import ops, run_sequence
from zero_offload.prefetch import Prefetcher
from zero_offload.store import ChunkStore, Hop, PayloadSpec, Residency, StoreConfig, Tier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MiB = 1 << 20


def cuda_store(tmp_path=None, **budgets):
    b = {"gpu": 256 * MiB, "cpu": 512 * MiB, "nvme": 512 * MiB}
    b.update(budgets)
    return ChunkStore(StoreConfig(device="cuda", budgets=b, nvme_dir=tmp_path))


def test_cpu_copies_are_pinned_and_fetch_runs_on_h2d_stream():
    store = cuda_store()
    cid = store.add_chunk({"params": PayloadSpec(MiB, torch.bfloat16, Tier.CPU)})
    cpu = store.get(cid, "params", "cpu")
    assert cpu.is_pinned()
    cpu.copy_(torch.arange(MiB, dtype=torch.bfloat16))
    store.mark_dirty(cid, "params", "cpu")
    torch.cuda.synchronize()
    # Hold the H2D stream back with a long kernel: the fetch must queue behind it, and get()
    # must make the current stream wait for it without blocking the host.
    with torch.cuda.stream(store._streams.h2d):
        torch.cuda._sleep(200_000_000)
    h = store.fetch(cid, "params", "gpu")
    assert not h.done()
    gpu = store.get(cid, "params", "gpu")  # device-side wait
    out = gpu.float().sum()  # queued on the current stream behind the copy
    assert torch.equal(gpu.cpu(), torch.arange(MiB, dtype=torch.bfloat16))
    # (fp32 sums on GPU and CPU differ in summation order, hence the tolerance; a missing
    # device-side wait would sum uninitialised memory instead)
    torch.testing.assert_close(out.cpu(), torch.arange(MiB, dtype=torch.bfloat16).float().sum(), rtol=1e-5, atol=0)
    store.close()


def test_grads_written_on_compute_stream_flush_on_d2h_stream():
    store = cuda_store()
    cids = [store.add_chunk({"grads": PayloadSpec(4 * MiB, torch.float32, Tier.CPU)}) for _ in range(4)]
    for c in cids:
        g = store.allocate(c, "grads", "gpu")
        torch.cuda._sleep(20_000_000)  # the producer is slow: D2H must wait for it
        g.fill_(c + 1.5)
        store.flush(c, "grads")
        store.evict(c, "grads", "gpu")
    for c in cids:
        assert torch.equal(store.get(c, "grads", "cpu"), torch.full((4 * MiB,), c + 1.5))
    assert store.stats.bytes_moved[Hop.GPU_TO_CPU] == 4 * 16 * MiB
    store.synchronize()
    assert store.bytes("gpu") == 0
    store.close()


def test_nvme_to_gpu_with_cuda(tmp_path):
    store = cuda_store(tmp_path)
    cid = store.add_chunk({"params": PayloadSpec(8 * MiB, torch.float32, Tier.NVME)})
    data = torch.randn(8 * MiB)
    store.allocate(cid, "params", "gpu").copy_(data.cuda())
    store.evict(cid, "params", "gpu")
    store.evict(cid, "params", "cpu")
    store.synchronize()
    assert store.state(cid, "params", "cpu") is Residency.ABSENT
    store.fetch(cid, "params", "gpu")
    assert torch.equal(store.get(cid, "params", "gpu").cpu(), data)
    store.close()


def test_rehome_from_nvme_onto_the_gpu_and_back_with_cuda(tmp_path):
    """The measured share grows over NVMe state (placement.py, [Note: measured share]): the
    payload goes home to pinned host memory, then to the device, bytes intact; a written GPU
    home goes back to the disk the same way."""
    store = cuda_store(tmp_path)
    cid = store.add_chunk({"master": PayloadSpec(4 * MiB, torch.float32, Tier.NVME)})
    data = torch.randn(4 * MiB)
    store.allocate(cid, "master", "cpu").copy_(data)
    store.flush(cid, "master").wait()
    store.evict(cid, "master", "cpu")
    store.synchronize()
    store.rehome(cid, "master", Tier.CPU)
    assert store.get(cid, "master", "cpu").is_pinned()
    store.rehome(cid, "master", Tier.GPU)
    assert store.home(cid, "master") is Tier.GPU and store.bytes("cpu") == 0 and store.bytes("nvme") == 0
    store.get(cid, "master", "gpu", write=True).mul_(2.0)
    store.mark_dirty(cid, "master", "gpu")
    store.rehome(cid, "master", Tier.NVME)
    assert store.home(cid, "master") is Tier.NVME and store.bytes("gpu") == 0
    store.fetch(cid, "master", "gpu")
    assert torch.equal(store.get(cid, "master", "gpu").cpu(), data * 2.0)
    store.close()


def test_prefetch_hides_copies_behind_gpu_compute():
    def stall(depth):
        store = cuda_store(gpu=6 * 64 * MiB)
        cids = [store.add_chunk({"params": PayloadSpec(16 * MiB, torch.float32, Tier.CPU)}) for _ in range(8)]
        pf = Prefetcher(store, depth=depth)
        for _ in range(3):
            pf.start_pass()
            torch.cuda.synchronize()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            for c in cids:
                with pf.chunk(c) as t:
                    t["params"].add_(0)
                    torch.cuda._sleep(5_000_000)  # ~2-3 ms of "compute"
            ev1.record()
            torch.cuda.synchronize()
        store.close()
        return ev0.elapsed_time(ev1)
    serial, deep = stall(0), stall(2)
    assert deep < 0.9 * serial, (deep, serial)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=40))
def test_random_ops_match_dict_model_cuda(seq):
    # the CPU test's sequences and dict model, on CUDA (imported at module level: importing a
    # module that defines a @given test from inside a running @given test is "nested given")
    run_sequence(seq, device="cuda")


def test_copy_out_is_a_reader_a_write_and_an_eviction_wait_for_it():
    """copy_out (the optimizer's params copy-back) reads a pinned CPU copy on the H2D stream:
    held back by a long kernel, an eviction keeps the memory (EVICTING) and a later write into
    the copy waits for it, so the copied values are the ones before the write."""
    store = cuda_store()
    cid = store.add_chunk({"master": PayloadSpec(MiB, torch.float32, Tier.CPU),
                           "cache": PayloadSpec(MiB, torch.float32, Tier.GPU)})
    with store.use(cid, "master", "cpu", write=True) as buf:
        buf.copy_(torch.arange(MiB, dtype=torch.float32))
    store.mark_dirty(cid, "master", "cpu")
    dst = torch.zeros(MiB, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(store._streams.h2d):
        torch.cuda._sleep(200_000_000)
    with store.use(cid, "master", "cpu"):
        h = store.copy_out(cid, "master", "cpu", [(0, dst)])
    assert not h.done()
    buf = store.get(cid, "master", "cpu", write=True)  # waits (host) for the reader
    assert h.done()
    buf.fill_(-1.0)
    store.mark_dirty(cid, "master", "cpu")
    assert torch.equal(dst.cpu(), torch.arange(MiB, dtype=torch.float32))
    # A non-home CPU copy under a running copy_out: evicted, its memory stays until the copy ends.
    store.fetch(cid, "cache", "cpu").wait()
    with torch.cuda.stream(store._streams.h2d):
        torch.cuda._sleep(200_000_000)
    with store.use(cid, "cache", "cpu"):
        h = store.copy_out(cid, "cache", "cpu", [(0, dst)])
    store.evict(cid, "cache", "cpu")
    assert store.state(cid, "cache", "cpu") is Residency.EVICTING
    h.wait()
    assert store.state(cid, "cache", "cpu") is Residency.ABSENT
    store.close()


def test_copy_in_lands_after_the_producer_and_orders_its_reuse():
    store = cuda_store()
    cid = store.add_chunk({"grads": PayloadSpec(MiB, torch.float32, Tier.CPU)})
    store.get(cid, "grads", "cpu", write=True)
    src = torch.empty(MiB, device="cuda")
    torch.cuda._sleep(50_000_000)  # the producer is slow: the D2H copy must wait for it
    src.fill_(3.0)
    h = store.copy_in(cid, "grads", "cpu", [(0, src)])
    store.wait_copies_in()
    src.fill_(5.0)  # after the copy on the current stream: the copy still reads 3.0
    h.wait()
    store.mark_dirty(cid, "grads", "cpu")
    assert torch.equal(store.get(cid, "grads", "cpu"), torch.full((MiB,), 3.0))
    assert store.stats.bytes_moved[Hop.GPU_TO_CPU] == 4 * MiB
    store.close()
