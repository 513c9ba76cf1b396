"""torch.compile through the engine ([Note: compiled regions] in zero_offload/compiled.py).

Blocks compiled one by one (``block.compile()``, or ``torch.compile(block, fullgraph=True)``
registered in the parent as torchtitan does) train through the engine as the same compiled model
trains with plain torch AdamW, and as the engine trains them eagerly; what cannot work is refused
before anything changes. The CPU runs use backend="aot_eager" (dynamo + AOTAutograd: where hooks
and parameters that change storage show up) and one small inductor run; every run checks that
graphs were compiled and nothing broke them, so a silent fallback to eager cannot pass."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch._dynamo
from torch._dynamo.utils import counters

import zero_offload as zo
from _dist_util import run_ranks, values
from _engine_util import (DEVICE, Reference, assert_losses_close, assert_params_close, config,
                          gpt_batches, gpt_loss, micro_gpt, train_engine)
from zero_offload.param_guard import CompiledReadError
from zero_offload.runtime.placement import FitError

SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no graph cached by another test (a cache hit, or the
    recompile limit falling back to eager, would hide what this test is about)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def compile_blocks(model: nn.Module, how: str, **kw) -> None:
    """Compile each of ``model.blocks``: ``block.compile()`` ("method", names unchanged), or
    ``torch.compile(block)`` put in its place ("wrapper": names gain ``._orig_mod``)."""
    kw.setdefault("backend", "aot_eager")
    for i, block in enumerate(model.blocks):
        if how == "method":
            block.compile(**kw)
        else:
            model.blocks.register_module(str(i), torch.compile(block, **kw))


def assert_compiled(graphs: "int | None" = None) -> None:
    """Graphs were compiled and run (``graphs`` of them, when given), and nothing broke them
    (the engine's hooks stay outside)."""
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    if graphs is not None:
        assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("how, params, accum, checkpointing", [
    ("method", "cpu", 1, False),
    ("wrapper", "cpu", 2, True),
    ("method", "auto", 2, True),
], ids=["method-cpu", "wrapper-cpu-accum-ckpt", "method-auto-accum-ckpt"])
def test_compiled_blocks_train_like_the_compiled_model_with_torch(how, params, accum, checkpointing):
    model = micro_gpt()
    model.set_activation_checkpointing(checkpointing)
    ref = Reference(model, SPEC, accum=accum)
    eager = copy.deepcopy(model)
    compile_blocks(model, how, fullgraph=how == "wrapper")
    compile_blocks(ref.work, how, fullgraph=how == "wrapper")
    budget = 64 << 10  # a few chunks: the blocks' params are paged in and out around each call
    batches = gpt_batches(4 * accum)
    engine = zo.initialize(model, optimizer=SPEC, device=DEVICE,
                           config=config(params=params, grad_accum=accum, gpu_budget=budget))
    try:
        assert [r.name for r in engine.regions] == ["blocks.0", "blocks.1"]
        assert len(engine.partition.chunks) > 4
        losses = train_engine(engine, batches, gpt_loss, accum=accum)
        # One graph, for both blocks and every step: the params' storage changing (each chunk
        # comes back in a new buffer) recompiles nothing.
        assert_compiled(graphs=1)
        ref_losses = [ref.step(b, gpt_loss) for b in batches]
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
        assert engine.store.peak_bytes(zo.Tier.GPU) <= budget
    finally:
        engine.close()
    with zo.initialize(eager, optimizer=SPEC, device=DEVICE,
                       config=config(params=params, grad_accum=accum, gpu_budget=budget)) as engine:
        assert engine.regions == ()
        assert_losses_close(losses, train_engine(engine, batches, gpt_loss, accum=accum), rtol=1e-6)


def test_the_whole_model_compiled_trains_when_it_fits_and_is_refused_when_it_does_not():
    model = micro_gpt()
    ref = Reference(model, SPEC)
    model.compile(backend="aot_eager", fullgraph=True)
    ref.work.compile(backend="aot_eager", fullgraph=True)
    with pytest.raises(FitError, match="compiled region 'the model'.*block.compile"):
        zo.initialize(model, optimizer=SPEC, device=DEVICE, config=config(gpu_budget=48 << 10))
    assert type(model.wte.weight) is nn.Parameter and model.wte.weight.untyped_storage().nbytes() > 0
    batches = gpt_batches(3)
    with zo.initialize(model, optimizer=SPEC, device=DEVICE, config=config()) as engine:
        assert [r.name for r in engine.regions] == [""]
        losses = train_engine(engine, batches, gpt_loss)
        assert_compiled()
        assert_losses_close(losses, [ref.step(b, gpt_loss) for b in batches], rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)


@pytest.mark.parametrize("how, kw", [
    ("method", dict(mode="reduce-overhead")), ("wrapper", dict(mode="reduce-overhead")),
    ("method", dict(mode="max-autotune")), ("method", dict(options={"triton.cudagraphs": True})),
    ("method", dict(backend="cudagraphs"))],
    ids=["reduce-overhead", "wrapper-reduce-overhead", "max-autotune", "triton.cudagraphs", "cudagraphs-backend"])
def test_cuda_graph_modes_are_refused_before_anything_changes(how, kw):
    model = micro_gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if how == "method":
        model.blocks[1].compile(**kw)
    else:
        model.blocks.register_module("1", torch.compile(model.blocks[1], **kw))
    with pytest.raises(ValueError, match="'blocks.1' is compiled with CUDA graphs.*mode='default'"):
        zo.initialize(model, optimizer=SPEC, device=DEVICE, config=config())
    for (n, p), old in zip(model.named_parameters(), before.values()):
        assert type(p) is nn.Parameter and torch.equal(p, old), n
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("how", ["method", "wrapper"])
def test_compiling_after_initialize_is_refused_at_the_next_forward(how):
    model = micro_gpt()
    with zo.initialize(model, optimizer=SPEC, device=DEVICE, config=config()) as engine:
        x, y = gpt_batches(1)[0]
        engine.backward(engine(x, y))
        engine.step()
        before = engine.state_dict()
        compile_blocks(model, how)
        with pytest.raises(RuntimeError, match="'blocks.0.*was compiled.*after zo.initialize.*compile first"):
            engine(x, y)
        assert engine.global_step == 1
        after = engine.state_dict()  # (names gain "._orig_mod" with the wrapper)
        assert len(after) == len(before)
        for (name, value), old in zip(after.items(), before.values()):
            assert torch.equal(value, old), name


def test_compiled_autograd_is_refused():
    from torch._dynamo import compiled_autograd
    model = micro_gpt()
    compile_blocks(model, "method")
    with zo.initialize(model, optimizer=SPEC, device=DEVICE, config=config()) as engine:
        x, y = gpt_batches(1)[0]
        loss = engine(x, y)
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            with pytest.raises(RuntimeError, match="compiled autograd.*turn it off"):
                engine.backward(loss)
        engine.backward(loss)  # nothing changed: the same backward runs without it
        assert engine.step()


class _Block(nn.Module):
    """Reads the parent's ``scale`` (not one of its modules) when ``reads_scale`` is set."""

    def __init__(self, d: int, scale: nn.Module):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.__dict__["scale"] = scale  # a plain attribute: the parameter stays the parent's

    def forward(self, x, reads_scale: bool):
        y = F.gelu(self.fc(x))
        return x + (y * self.scale.weight if reads_scale else y)


class _Head(nn.Module):
    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


class _Net(nn.Module):
    """A tied head inside a compiled region and its embedding outside; a parent reading a
    parameter of a compiled block functionally; blocks reading a parameter of the parent."""

    def __init__(self, vocab: int = 32, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.scale = nn.LayerNorm(d)  # its weight: read by the blocks
        self.blocks = nn.ModuleList(_Block(d, self.scale) for _ in range(2))
        self.head = _Head(d, vocab)
        self.head.out.weight = self.emb.weight
        self.reads_scale = True

    def forward(self, idx, targets):
        x = self.emb(idx)
        x = x + 0.1 * F.linear(x, self.blocks[0].fc.weight)  # the parent reads a block's weight
        for b in self.blocks:
            x = b(x, self.reads_scale)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _net_pair():
    """The model and its reference copy, each with its blocks and head compiled."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    for b in ref.blocks:
        b.__dict__["scale"] = ref.scale
    for m in (model, ref):
        compile_blocks(m, "method")
        m.head.compile(backend="aot_eager")
    return model, ref.to(DEVICE)


def _net_batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g))
            for _ in range(n)]


def _torch_step(model, opt, batch) -> float:
    loss = gpt_loss(model, (batch[0].to(DEVICE), batch[1]))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _assert_params_equal_torch(engine, ref_model):
    sd = engine.state_dict()
    assert_params_close(sd, {n: p.detach().cpu() for n, p in ref_model.named_parameters()}, rtol=1e-5)
    return sd


def test_tied_head_in_a_region_and_parameters_read_across_regions_train_like_torch():
    model, ref = _net_pair()
    opt = torch.optim.AdamW(ref.parameters(), lr=SPEC.lr, weight_decay=SPEC.weight_decay, foreach=False)
    batches = _net_batches(4)
    with zo.initialize(model, optimizer=SPEC, device=DEVICE, config=config()) as engine:
        assert [r.name for r in engine.regions] == ["blocks.0", "blocks.1", "head"]
        assert engine.partition.names["head.out.weight"] is engine.partition.names["emb.weight"]
        losses = train_engine(engine, batches, gpt_loss)
        assert_compiled()
        assert_losses_close(losses, [_torch_step(ref, opt, b) for b in batches], rtol=1e-5)
        sd = _assert_params_equal_torch(engine, ref)
        assert torch.equal(sd["emb.weight"], sd["head.out.weight"])


def test_a_read_inside_a_region_first_taken_later_raises_and_record_reads_fixes_it():
    model, ref = _net_pair()
    opt = torch.optim.AdamW(ref.parameters(), lr=SPEC.lr, weight_decay=SPEC.weight_decay, foreach=False)
    with zo.initialize(model, optimizer=SPEC, device=DEVICE, config=config()) as engine:
        losses, ref_losses = [], []
        for i, (x, y) in enumerate(_net_batches(4)):
            model.reads_scale = ref.reads_scale = i >= 2
            if i == 2:  # the blocks read scale.weight for the first time, inside their graphs
                with pytest.raises(CompiledReadError,
                                   match="'scale.weight' is read inside the compiled region 'blocks.0'"
                                         ".*engine.record_reads"):
                    engine(x, y)
                engine.record_reads()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            ref_losses.append(_torch_step(ref, opt, (x, y)))
        assert_compiled()
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        _assert_params_equal_torch(engine, ref)


def _rank_trains_compiled(rank, world, accum):
    torch._dynamo.reset()
    model = micro_gpt()
    compile_blocks(model, "method")
    engine = zo.initialize(model, optimizer=SPEC, device="cpu",
                           config=config(grad_accum=accum, prefetch_depth=1))
    for x, y in gpt_batches(3 * accum, batch=2 * world):
        sl = slice(2 * rank, 2 * rank + 2)  # this rank's half of the global batch
        engine.backward(engine(x[sl], y[sl]) / accum)
        engine.step()
    graphs = counters["stats"]["unique_graphs"]
    sd = engine.state_dict()
    engine.close()
    return sd, graphs


def test_two_ranks_with_compiled_blocks_train_like_one_torch_process(tmp_path, monkeypatch):
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cpu")  # the ranks compute on the CPU (gloo)
    out = values(run_ranks(_rank_trains_compiled, 2, tmp_path, 2, timeout_s=240))
    ref = Reference(micro_gpt(), SPEC, accum=2)
    compile_blocks(ref.work, "method")
    for b in gpt_batches(6, batch=4):
        ref.step(b, gpt_loss)
    for sd, graphs in out:
        assert graphs >= 1
        assert_params_close(sd, ref.master_state(), rtol=1e-5)


def test_hugging_face_llama_layers_compiled_train_like_torch():
    transformers = pytest.importorskip("transformers")
    from _engine_util import HF_TINY_CONFIGS, rel_err, torch_optimizer
    kwargs = dict(HF_TINY_CONFIGS["llama"])
    cfg = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    ref = copy.deepcopy(model).to(DEVICE)
    for m in (model, ref):
        for layer in m.model.layers:
            layer.compile(backend="aot_eager")
    opt = torch_optimizer(SPEC, ref.parameters())
    g = torch.Generator().manual_seed(1)
    with zo.initialize(model, optimizer=SPEC, device=DEVICE, config=config()) as engine:
        assert len(engine.regions) == 2
        for _ in range(3):
            ids = torch.randint(0, 64, (2, 16), generator=g)
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
            ref_out = ref(input_ids=ids.to(DEVICE), labels=ids.to(DEVICE))
            ref_out.loss.backward()
            opt.step()
            opt.zero_grad()
            assert out.loss.item() == pytest.approx(ref_out.loss.item(), rel=1e-5)
        assert_compiled()
        sd = engine.state_dict()
        for n, p in ref.named_parameters():
            assert rel_err(sd[n], p.detach().cpu()) < 1e-5, n


class _MLPBlocks(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d, None) for _ in range(2))
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x, False)
        return self.out(x)


@pytest.mark.slow
def test_inductor_compiled_blocks_train_like_eager_torch():
    """The real compiler (C++ kernels on the CPU, ~10-30 s on 2 cores): a small model, compared
    with eager torch."""
    torch.manual_seed(0)
    model = _MLPBlocks()
    ref = Reference(model, SPEC)
    compile_blocks(model, "method", backend="inductor")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]

    def loss_fn(m, b):
        return F.mse_loss(m(b[0]), b[1].to(DEVICE))
    with zo.initialize(model, optimizer=SPEC, device=DEVICE, config=config()) as engine:
        assert [r.name for r in engine.regions] == ["blocks.0", "blocks.1"]
        losses = train_engine(engine, batches, loss_fn)
        assert_compiled()
        assert_losses_close(losses, [ref.step(b, loss_fn) for b in batches], rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)


# ---- on the GPU (inductor: Triton kernels) ------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _torch_losses(model, batches, *, lr=SPEC.lr, wd=SPEC.weight_decay):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, foreach=False)
    out = []
    for x, y in batches:
        loss = model(x.cuda(), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("how", ["method", "wrapper"])
def test_inductor_blocks_on_cuda_train_like_the_compiled_model_with_torch(how):
    """fp32, params paged from the host, the GPT's blocks compiled by inductor: equal to the same
    compiled model trained by torch AdamW on the GPU."""
    model = micro_gpt()
    model.set_activation_checkpointing(True)
    ref = copy.deepcopy(model).cuda()
    for m in (model, ref):
        compile_blocks(m, how, backend="inductor", fullgraph=how == "wrapper")
    batches = gpt_batches(5)
    with zo.initialize(model, optimizer=SPEC, device="cuda", config=config(gpu_budget=64 << 10)) as engine:
        losses = train_engine(engine, batches, lambda e, b: e(b[0], b[1].cuda()))
        assert_compiled()
        assert_losses_close(losses, _torch_losses(ref, batches), rtol=1e-4)
        sd = engine.state_dict()
        assert_params_close(sd, {n: p.detach().cpu() for n, p in ref.named_parameters()}, rtol=1e-4)


@pytest.mark.gpu
@cuda
def test_inductor_blocks_on_cuda_bf16_follow_the_eager_engine():
    """bf16 working params: the compiled run's losses follow the eager engine's within bf16
    rounding (inductor fuses, so the two round at different places)."""
    model = micro_gpt(d_model=64, n_layer=4)
    eager = copy.deepcopy(model)
    compile_blocks(model, "method", backend="inductor")
    batches = gpt_batches(6, cfg=model.config)
    out = []
    for m in (model, eager):
        with zo.initialize(m, optimizer=SPEC, device="cuda", config=config(dtype="bf16")) as engine:
            out.append(train_engine(engine, batches, lambda e, b: e(b[0], b[1].cuda())))
    assert_compiled()
    assert_losses_close(out[0], out[1], rtol=2e-2)
