"""Shared pieces of the engine tests (tests/test_engine_*.py): tiny models, seeded data, the
engine's training loop and the plain-torch references it must equal.

References (see zero_offload/mixed_precision.py for the recipe):
- fp32: the same model trained with torch.optim.Adam / AdamW;
- bf16 / fp16: a low-precision copy of the model runs forward/backward, its grads are copied
  into fp32 master params (summed in fp32 over micro-batches), torch.optim updates the masters,
  which are copied back (rounded) into the low-precision copy; fp16 adds torch.amp.GradScaler.
"""
from __future__ import annotations

import copy
import math
import os

import torch
from torch import nn
import torch.nn.functional as F

import zero_offload as zo
from zero_offload.models import GPT, GPTConfig

DEVICE = os.environ.get("ZO_TEST_DEVICE", "cpu")
"""Compute device of the engine and the reference: the CPU in CI; ZO_TEST_DEVICE=cuda runs the
same parity tests on the GPU machine."""

MICRO_GPT = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, seq_len=16, bias=False)
"""About 7k params; with chunk_mb=SMALL_CHUNK_MB it spans several chunks. No biases: the key
part of a qkv bias has a zero gradient up to rounding noise, which Adam turns into full-size
steps of random sign, so it cannot be compared between two correct implementations."""

SMALL_CHUNK_MB = 4096 / 2**20
"""One 4 KiB chunk target (1024 fp32 / 2048 bf16 elements)."""


class MLP(nn.Module):
    """Three linears (about 1.7k params): three chunks at SMALL_CHUNK_MB in fp32."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def mlp(seed: int = 0, **kw) -> MLP:
    torch.manual_seed(seed)
    return MLP(**kw)


def micro_gpt(seed: int = 0, **overrides) -> GPT:
    import dataclasses
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(MICRO_GPT, **overrides))


def init_weights_reference(cfg: GPTConfig, seed: int) -> GPT:
    """What ``GPT.init_weights`` gives on the CPU after ``to_empty``, from ``seed``: the values a
    model built on the meta device must get."""
    m = GPT(cfg, device="meta")
    m.to_empty(device="cpu")
    torch.manual_seed(seed)
    m.init_weights()
    return m


def mlp_batches(n: int, *, seed: int = 1, batch: int = 8, d_in: int = 16, d_out: int = 4) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g))
            for _ in range(n)]


def gpt_batches(n: int, *, seed: int = 1, batch: int = 4, cfg: GPTConfig = MICRO_GPT) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def mlp_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y.to(device=DEVICE, dtype=torch.float32))


def gpt_loss(model, batch):
    idx, targets = batch
    return model(idx, targets.to(DEVICE))


def config(**kw) -> zo.OffloadConfig:
    """A test config: CPU placements, fp32, tiny chunks, explicit budgets (no 'auto' probing)."""
    base = dict(params="cpu", optimizer="cpu", dtype="fp32", chunk_mb=SMALL_CHUNK_MB,
                gpu_budget=1 << 22, cpu_budget=1 << 26, threads=1)
    base.update(kw)
    return zo.OffloadConfig(**base)


def auto_config(**kw) -> zo.OffloadConfig:
    """A test config of automatic placement: params and optimizer 'auto', fp32, tiny chunks, an
    explicit host budget, one chunk of prefetch; ``kw`` sets the device tier (gpu_budget, ...)."""
    base = dict(params="auto", optimizer="auto", dtype="fp32", chunk_mb=SMALL_CHUNK_MB,
                cpu_budget=1 << 26, threads=1, prefetch_depth=1)
    return zo.OffloadConfig(**{**base, **kw})


def build_layout(kw: dict, tmp_path, *, spec, model=None, **layout):
    """An engine of config ``kw`` with the layout options ``layout`` (e.g. host_grads="window")
    on ``model`` (default: micro_gpt()); with an "nvme" tier its swap files go in a directory of
    their own per layout under ``tmp_path``."""
    kw = dict(kw)
    if "nvme" in kw.values():
        kw["nvme_dir"] = str(tmp_path / ("swap-" + "-".join(str(v) for v in layout.values())))
    return zo.initialize(model if model is not None else micro_gpt(), optimizer=spec,
                         config=config(**layout, **kw), device=DEVICE)


def train_engine(engine, batches, loss_fn, *, accum: int = 1) -> list:
    """Losses (floats) of each micro-batch, stepping the engine after each."""
    losses = []
    for b in batches:
        loss = loss_fn(engine, b)
        engine.backward(loss if accum == 1 else loss / accum)
        engine.step()
        losses.append(loss.item())
    return losses


def rank_engine(spec, rank: int, world: int, *, steps: int, accum: int, **kw):
    """A micro-GPT engine on the CPU (params and optimizer "cpu", fp32, small chunks and budgets: the
    gloo two-rank tests' layout; ``kw`` adds or overrides config fields) trained ``steps`` steps
    of ``accum`` micro-batches on this rank's slice of each batch (2 sequences a rank).
    Returns (engine, losses), the engine synchronized and open."""
    cfg = zo.OffloadConfig(**{**dict(params="cpu", optimizer="cpu", dtype="fp32", chunk_mb=SMALL_CHUNK_MB,
                                     gpu_budget=1 << 22, cpu_budget=1 << 26, threads=1, prefetch_depth=1,
                                     grad_accum=accum), **kw})
    engine = zo.initialize(micro_gpt(), optimizer=spec, config=cfg, device="cpu")
    losses = []
    for x, y in gpt_batches(steps * accum, batch=2 * world):
        sl = slice(2 * rank, 2 * rank + 2)
        loss = engine(x[sl], y[sl])
        engine.backward(loss / accum)
        engine.step()
        losses.append(loss.item())
    engine.synchronize()
    return engine, losses


def check_resume_across_layouts(build, reference: str, saver: str, ckpt, *, also=None) -> None:
    """A checkpoint saved half-way (4 of 8 micro-batches, accumulation 2) by the ``saver`` layout
    loads into either layout, and training on equals the ``reference`` layout's engine that never
    stopped (losses equal, state equal, then ``also(resumed, reference_engine)``). ``build(layout,
    model=None)`` makes an engine."""
    batches = gpt_batches(8)
    plain, first = build(reference), build(saver)
    try:
        want = train_engine(plain, batches, gpt_loss, accum=2)
        got = train_engine(first, batches[:4], gpt_loss, accum=2)
        first.save_checkpoint(ckpt)
    finally:
        first.close()
    try:
        for layout in (saver, reference):
            again = build(layout, model=micro_gpt(seed=7))
            try:
                again.load_checkpoint(ckpt)
                assert got + train_engine(again, batches[4:], gpt_loss, accum=2) == want
                assert_same_state(engine_state(again), engine_state(plain))
                if also is not None:
                    also(again, plain)
            finally:
                again.close()
    finally:
        plain.close()


def assert_trains_alike(engine, other, batches, loss_fn=None) -> None:
    """Both engines train on ``batches`` to the same losses and end with the same state."""
    loss_fn = gpt_loss if loss_fn is None else loss_fn
    assert train_engine(engine, batches, loss_fn) == train_engine(other, batches, loss_fn)
    assert_same_state(engine_state(engine), engine_state(other))


def assert_host_homes_match_the_plan(engine) -> None:
    """Between steps the store holds exactly the plan's host homes: ``need`` less the working
    bytes (staging, the grads window: all free now)."""
    from zero_offload.runtime.store import Tier
    engine.synchronize()
    plan = engine.plan
    assert engine.store.bytes(Tier.CPU) == plan.need[Tier.CPU] - plan.working[Tier.CPU]


def assert_spills_or_fails(request, **layout) -> None:
    """``request`` with the layout options ``layout`` plans state onto NVMe, or does not fit at
    all (what "auto" took another layout to avoid)."""
    import dataclasses
    from zero_offload.runtime.placement import FitError, plan_placement
    from zero_offload.runtime.store import Tier
    try:
        spill = plan_placement(dataclasses.replace(request, **layout))
    except FitError:
        return
    assert spill.need[Tier.NVME] > 0


def least_host_budget(request) -> int:
    """The smallest cpu_budget (in 4 KiB steps) at which ``request``'s plan keeps every chunk's
    state in host memory."""
    import dataclasses
    from zero_offload.runtime import placement
    lo, hi = 0, request.budgets.cpu // 4096
    while lo < hi:  # the plan spills less as the budget grows
        mid = (lo + hi) // 2
        try:
            budgets = dataclasses.replace(request.budgets, cpu=mid * 4096)
            plan = placement.plan_placement(dataclasses.replace(request, budgets=budgets))
            spills = plan.need[placement.Tier.NVME] > 0
        except placement.FitError:
            spills = True
        lo, hi = (lo, mid) if not spills else (mid + 1, hi)
    return lo * 4096


def torch_optimizer(spec, params):
    cls = torch.optim.AdamW if spec.adamw else torch.optim.Adam
    return cls(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
               foreach=False)


class Reference:
    """Plain-torch training of a copy of ``model`` with the engine's recipe for ``dtype``."""

    def __init__(self, model: nn.Module, spec, *, dtype: torch.dtype = torch.float32,
                 grad_clip=None, accum: int = 1, scheduler=None, scaler: dict | None = None):
        self.work = copy.deepcopy(model).to(device=DEVICE, dtype=dtype)
        self.dtype = dtype
        self.lowp = dtype is not torch.float32
        if self.lowp:
            self.masters = [p.detach().float().clone().requires_grad_(p.requires_grad)
                            for p in self.work.parameters()]
        else:
            self.masters = list(self.work.parameters())
        trainable = [m for m in self.masters if m.requires_grad]
        self.opt = torch_optimizer(spec, trainable)
        self.sched = scheduler(self.opt) if scheduler is not None else None
        self.grad_clip = grad_clip
        self.accum = accum
        self.micro = 0
        self.scaler = (torch.amp.GradScaler(torch.device(DEVICE).type, **scaler)
                       if scaler is not None else None)
        self.norms: list = []
        self.skipped = 0

    def cast(self, batch):
        def cast(t):
            if not isinstance(t, torch.Tensor):
                return t
            return t.to(device=DEVICE, dtype=self.dtype) if t.is_floating_point() else t.to(DEVICE)
        return tuple(cast(t) for t in batch)

    def step(self, batch, loss_fn) -> float:
        loss = loss_fn(self.work, self.cast(batch))
        scaled = loss / self.accum
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        if self.lowp:
            for p, m in zip(self.work.parameters(), self.masters):
                if p.grad is not None:
                    g = p.grad.float()
                    m.grad = g if m.grad is None else m.grad + g
                    p.grad = None
        self.micro += 1
        if self.micro == self.accum:
            self.micro = 0
            self._update()
        return loss.item()

    def _update(self):
        params = [m for m in self.masters if m.requires_grad]
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        if self.grad_clip is not None:
            self.norms.append(torch.nn.utils.clip_grad_norm_(params, self.grad_clip).item())
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.opt)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale_before
            self.skipped += skipped
        else:
            skipped = False
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.sched is not None and not skipped:
            self.sched.step()
        if self.lowp:
            with torch.no_grad():
                for p, m in zip(self.work.parameters(), self.masters):
                    p.copy_(m)

    def master_state(self) -> dict:
        """name -> fp32 values (the masters), keyed like model.state_dict() params."""
        names = [n for n, _ in self.work.named_parameters()]
        return {n: m.detach().float().cpu() for n, m in zip(names, self.masters)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def assert_params_close(engine_sd: dict, ref_sd: dict, *, rtol: float) -> None:
    for name, ref in ref_sd.items():
        got = engine_sd[name]
        err = rel_err(got, ref)
        assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol:g}"


def engine_state(engine) -> dict:
    """Everything a step depends on: the params, every chunk's optimizer state and step counts,
    the counters, the loss scale."""
    from zero_offload.runtime.checkpoint import chunk_state
    out = {f"param {k}": v for k, v in engine.state_dict().items()}
    for layout in engine.partition.chunks:
        for k, v in chunk_state(engine.group, layout).items():
            out[f"chunk {layout.index} {k}"] = v
    out["progress"] = (engine.global_step, engine.skipped_steps, engine.stats().loss_scale)
    return out


def assert_same_state(a: dict, b: dict) -> None:
    """Two ``engine_state`` results are equal to the bit."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{k} differs"
        else:
            assert a[k] == b[k], f"{k}: {a[k]} != {b[k]}"


def assert_losses_close(got: list, ref: list, *, rtol: float) -> None:
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert math.isfinite(a), f"step {i}: engine loss {a}"
        assert abs(a - b) <= rtol * max(abs(b), 1e-3), f"step {i}: engine loss {a} vs reference {b}"


def reference_bf16(model, spec, batches, *, device: str = "cuda"):
    """The engine's bf16 recipe in plain torch: a bf16 copy on ``device`` runs forward/backward,
    fp32 masters are updated by torch's Adam/AdamW and copied back. Returns (losses, {name: fp32
    master on the CPU}). A param no read reached in a step has no grad: torch skips it, as the
    engine does."""
    work = copy.deepcopy(model).to(device=device, dtype=torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in work.parameters()]
    opt = torch_optimizer(spec, masters)
    losses = []
    for idx, tgt in batches:
        loss = work(idx.to(device), tgt.to(device))
        loss.backward()
        for p, m in zip(work.parameters(), masters):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(work.parameters(), masters):
                p.copy_(m)
        losses.append(loss.item())
    names = [n for n, _ in work.named_parameters()]
    return losses, {n: m.detach().cpu() for n, m in zip(names, masters)}


# Tiny Hugging Face configs (built locally, no downloads) for the engine and Trainer tests.
HF_TINY_CONFIGS = {
    "gpt2": dict(model_type="gpt2", vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=16, tie_word_embeddings=True),
}
