"""Property test: random sequences of store operations across all three tiers agree with a plain
dict-of-tensors model, and no tier ever holds more than its budget."""
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zero_offload.store import BudgetError, ChunkStore, PayloadSpec, Residency, StoreConfig, Tier

NUMEL = 2048  # fp32: 8 KiB per payload, bf16: 4 KiB
PAYLOADS = {
    "params": PayloadSpec(NUMEL, torch.bfloat16, Tier.CPU),
    "master": PayloadSpec(NUMEL, torch.float32, Tier.NVME),
    "grads": PayloadSpec(NUMEL, torch.float32, Tier.GPU),
}
N_CHUNKS = 3
PAYLOAD_BYTES = 8192
BUDGETS = {"gpu": 4 * PAYLOAD_BYTES + 3 * PAYLOAD_BYTES,  # the 3 home grads + room for 4 more
           "cpu": 3 * 4096 + 3 * PAYLOAD_BYTES,            # the 3 home params + room for 3
           "nvme": 1 << 20}

names = st.sampled_from(sorted(PAYLOADS))
cids = st.integers(0, N_CHUNKS - 1)
mem_tiers = st.sampled_from([Tier.GPU, Tier.CPU])
all_tiers = st.sampled_from(list(Tier))
ops = st.one_of(
    st.tuples(st.just("write"), cids, names, mem_tiers, st.integers(1, 1000)),
    st.tuples(st.just("read"), cids, names, mem_tiers),
    st.tuples(st.just("fetch"), cids, names, mem_tiers),
    st.tuples(st.just("flush"), cids, names, all_tiers),
    st.tuples(st.just("evict"), cids, names, all_tiers),
)


def pattern(value: int, dtype) -> torch.Tensor:
    # distinct per element and per value, exact in bf16 (small integers)
    return (torch.arange(NUMEL) % 64 + value * 64).to(dtype)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=40))
def test_random_ops_match_dict_model(seq):
    run_sequence(seq, device="cpu")


def run_sequence(seq, *, device):
    """Apply ``seq`` to a fresh store on ``device`` and to the dict model; assert they agree.
    (tests/test_store_cuda.py runs the same with CUDA streams.)"""
    with tempfile.TemporaryDirectory() as d:
        store = ChunkStore(StoreConfig(device=device, budgets=BUDGETS, nvme_dir=d))
        try:
            for _ in range(N_CHUNKS):
                store.add_chunk(PAYLOADS)
            model = {(c, n): torch.zeros(NUMEL, dtype=s.dtype) for c in range(N_CHUNKS) for n, s in PAYLOADS.items()}
            for op in seq:
                kind, cid, name = op[:3]
                tier = op[3]
                home = PAYLOADS[name].home
                if kind == "write":
                    value = op[4]
                    buf = store.allocate(cid, name, tier)
                    buf.copy_(pattern(value, buf.dtype).to(buf.device))
                    store.mark_dirty(cid, name, tier)
                    model[cid, name] = pattern(value, buf.dtype)
                elif kind in ("read", "fetch"):
                    store.fetch(cid, name, tier)
                    if kind == "read":
                        torch.testing.assert_close(store.get(cid, name, tier).cpu(), model[cid, name], rtol=0, atol=0)
                elif kind == "flush":
                    store.flush(cid, name, tier)
                elif kind == "evict":
                    if tier is home:
                        with pytest.raises(Exception, match="home copy"):
                            store.evict(cid, name, tier)
                    else:
                        store.evict(cid, name, tier)
                for t in Tier:
                    assert store.bytes(t) <= store.budgets[t]
                    assert store.peak_bytes(t) <= store.budgets[t]
            store.synchronize()
            # Every resident, valid copy holds the model's bytes; the home copy is never absent.
            for c in range(N_CHUNKS):
                for n, spec in PAYLOADS.items():
                    assert store.state(c, n, spec.home) is not Residency.ABSENT
                    for t in (Tier.GPU, Tier.CPU):
                        if store.state(c, n, t) is Residency.VALID:
                            torch.testing.assert_close(store.get(c, n, t).cpu(), model[c, n], rtol=0, atol=0)
                    store.fetch(c, n, Tier.CPU)
                    torch.testing.assert_close(store.get(c, n, Tier.CPU), model[c, n], rtol=0, atol=0)
                    store.evict(c, n, Tier.CPU) if spec.home is not Tier.CPU else None
            # Bytes per tier are exactly the sizes of the copies that hold memory.
            for t in Tier:
                held = sum(4096 if PAYLOADS[n].dtype == torch.bfloat16 else PAYLOAD_BYTES
                           for c in range(N_CHUNKS) for n in PAYLOADS
                           if store.state(c, n, t) is not Residency.ABSENT)
                assert store.bytes(t) == held
        finally:
            store.close()
