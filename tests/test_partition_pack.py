"""The one packer (runtime/partition.py ``pack``): items in order, by key, into chunks of about
``chunk_numel`` elements; the engine's partition packs by trainable (aligned), OffloadAdam by
dtype (unaligned). Checked on plain items, and through OffloadAdamW on a param group whose
dtypes alternate (each chunk one dtype; the updates equal torch.optim.AdamW's)."""
import pytest
import torch

from zero_offload.runtime.partition import ALIGN_ELEMS, pack, partition_parameters


def _pack(sizes, keys=None, **kw):
    items = list(range(len(sizes)))
    keys = keys or [None] * len(sizes)
    out = pack(items, size=lambda i: sizes[i], key=lambda i: keys[i], **kw)
    return [(c.key, [(i, o) for i, o in c.members], c.numel) for c in out]


def test_items_of_one_key_fill_chunks_in_order_without_splitting():
    # aligned to 64: 10 -> 64, 100 -> 128; a chunk closes once full or before an item that overflows it
    assert _pack([10, 100, 50, 300, 10], chunk_numel=256) == [
        (None, [(0, 0), (1, 64), (2, 192)], 256),  # full: closed
        (None, [(3, 0)], 320),                      # larger than a chunk: a chunk of its own
        (None, [(4, 0)], 64)]
    assert _pack([10, 100, 50], chunk_numel=200, align=1) == [(None, [(0, 0), (1, 10), (2, 110)], 160)]
    assert _pack([100, 100, 1], chunk_numel=200, align=1) == [(None, [(0, 0), (1, 100)], 200),
                                                              (None, [(2, 0)], 1)]


def test_keys_never_share_a_chunk_and_another_key_in_between_does_not_close_one():
    got = _pack([10, 20, 30, 40, 50], keys=["a", "b", "a", "b", "a"], chunk_numel=100, align=1)
    assert got == [("a", [(0, 0), (2, 10), (4, 40)], 90), ("b", [(1, 0), (3, 20)], 60)]
    # chunks come in the order of their first item, however they close
    got = _pack([90, 5, 20], keys=["a", "b", "a"], chunk_numel=100, align=1)
    assert [(k, [i for i, _ in m]) for k, m, _ in got] == [("a", [0]), ("b", [1]), ("a", [2])]


def test_offsets_are_aligned_and_bad_arguments_raise():
    got = pack(range(5), size=lambda i: 1 + 37 * i, chunk_numel=1 << 20)
    assert all(o % ALIGN_ELEMS == 0 for _, o in got[0].members) and got[0].numel % ALIGN_ELEMS == 0
    with pytest.raises(ValueError, match="chunk_numel must be a positive int"):
        pack([1], size=lambda i: 1, chunk_numel=0)
    with pytest.raises(ValueError, match="align must be a positive int"):
        pack([1], size=lambda i: 1, chunk_numel=8, align=0)
    with pytest.raises(ValueError, match="an item's size must be a positive int"):
        pack([1], size=lambda i: 0, chunk_numel=8)
    assert pack([], size=len, chunk_numel=8) == []


def test_the_engines_partition_is_the_packer_by_trainable():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model[1].requires_grad_(False)
    part = partition_parameters(model, chunk_numel=128)
    params = [(n, p) for n, p in model.named_parameters()]
    want = pack(params, size=lambda np_: np_[1].numel(), key=lambda np_: np_[1].requires_grad, chunk_numel=128)
    assert [(c.trainable, [(s.name, s.offset) for s in c.slots], c.numel) for c in part.chunks] == \
        [(c.key, [(n, o) for (n, _), o in c.members], c.numel) for c in want]
    assert [c.trainable for c in part.chunks] == [True, False, True]


def test_offload_adam_packs_each_dtype_apart_and_trains_like_torch():
    from zero_offload import OffloadAdamW

    torch.manual_seed(0)
    shapes = [(32, 16), (16,), (32, 32), (32,), (16, 32)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]
    start = [torch.randn(s) for s in shapes]
    ours = [torch.nn.Parameter(t.to(d)) for t, d in zip(start, dtypes)]
    masters = [torch.nn.Parameter(t.to(d).float()) for t, d in zip(start, dtypes)]
    opt = OffloadAdamW(ours, lr=1e-2, chunk_mb=1.0, threads=1, overlap=False)
    ref = torch.optim.AdamW(masters, lr=1e-2)
    chunks = opt._chunks
    assert len(chunks) == 2  # one per dtype: the bf16 params between fp32 ones do not close a chunk
    for c in chunks:
        kinds = {s.param.dtype for s in c.slots}
        assert len(kinds) == 1 and opt._store.payload_spec(c.cid, "grads").dtype in kinds
    for _ in range(3):
        grads = [torch.randn(s) for s in shapes]
        for p, m, g in zip(ours, masters, grads):
            p.grad = g.to(p.dtype)
            m.grad = p.grad.float()  # the same (rounded) grads, to the fp32 reference
        opt.step()
        ref.step()
    master = opt.state_dict()["state"]
    for i, (p, m) in enumerate(zip(ours, masters)):
        if p.dtype is torch.float32:
            torch.testing.assert_close(p.detach(), m.detach(), rtol=1e-5, atol=1e-6)
        else:  # the params are the rounding of an fp32 master updated as torch updates fp32
            torch.testing.assert_close(master[i]["master"], m.detach(), rtol=1e-5, atol=1e-6)
            assert torch.equal(p.detach(), master[i]["master"].bfloat16())
    opt.close()
