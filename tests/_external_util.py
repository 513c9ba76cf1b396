"""Models that read parameters outside the module holding them (tests/test_engine_external_*.py):
a tied LM head in the parent's forward, a parameter handed to a custom autograd.Function, one
weight used by two sibling modules, a parent reading a child's bias. Sized so that with
SMALL_CHUNK_MB they span many chunks and the read chunk has been released (not merely parked)
when the outside read happens."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, WIDTH, LAYERS = 64, 32, 4


class LinearFn(torch.autograd.Function):
    """x @ w.T with its own backward, which reads the saved ``w``."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, (g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


class CtxLinearFn(torch.autograd.Function):
    """x @ w.T whose backward reads ``w`` from a ctx attribute (not save_for_backward), so no
    saved-tensor hook sees it."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        ctx.w = w
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        w = ctx.w
        return g @ w, (g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


class Borrower(nn.Module):
    """Holds no parameter: its forward uses another module's weight (not registered here)."""

    def __init__(self, owner: nn.Module):
        super().__init__()
        self._owner = [owner]  # a list, so the owner is not registered as a child

    def forward(self, x):
        return F.linear(x, self._owner[0].weight)


class CtxBorrower(Borrower):
    """A Borrower going through CtxLinearFn: its backward reads the owner's weight from ctx."""

    def forward(self, x):
        return CtxLinearFn.apply(x, self._owner[0].weight)


class ExternalReads(nn.Module):
    """A tiny LM whose parameters are read outside their modules in the ways ``reads`` names:
    "tied" (head = F.linear(x, self.tok.weight) in this forward), "function" (a block's weight
    through LinearFn in this forward), "shared" (a Borrower sibling uses blocks[1]'s weight),
    "bias" (this forward adds blocks[-1].bias), "ctx" (a CtxBorrower after blocks[0] uses the
    weight of ``side``, a linear never called, through CtxLinearFn, whose backward reads it from
    ctx: nothing else fetches that chunk in backward). ``checkpoint_head`` recomputes the tied head in backward; ``late``
    (set from outside) adds a read of blocks[0].weight in this forward, ``late_scale`` an
    element-wise read of blocks[0].bias (``x * (1 + 0.5 * bias)``)."""

    def __init__(self, reads=("tied",), *, checkpoint_head: bool = False):
        super().__init__()
        self.reads = tuple(reads)
        self.checkpoint_head = checkpoint_head
        self.late = False
        self.late_scale = False
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.borrower = Borrower(self.blocks[1])
        if "ctx" in self.reads:
            self.side = nn.Linear(WIDTH, WIDTH, bias=False)
            self.ctx_borrower = CtxBorrower(self.side)
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)

    def _head(self, x):
        return F.linear(x, self.tok.weight)

    def forward(self, idx, targets):
        x = self.tok(idx)
        for i, block in enumerate(self.blocks):
            x = x + torch.tanh(block(x))
            if i == 0 and "ctx" in self.reads:
                x = x + 0.5 * torch.tanh(self.ctx_borrower(x))
            if i == 1 and "shared" in self.reads:
                x = x + 0.5 * torch.tanh(self.borrower(x))
        if "function" in self.reads:
            x = x + 0.5 * torch.tanh(LinearFn.apply(x, self.blocks[2].weight))
        if "bias" in self.reads:
            x = x * torch.sigmoid(self.blocks[-1].bias)
        if self.late:
            x = x + 0.25 * F.linear(x, self.blocks[0].weight)
        if self.late_scale:
            x = x * (1 + 0.5 * self.blocks[0].bias)
        x = self.norm(x)
        if "tied" in self.reads:
            logits = (checkpoint(self._head, x, use_reentrant=False) if self.checkpoint_head
                      else self._head(x))
        else:
            logits = self.out(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def model(reads=("tied",), seed: int = 0, **kw) -> ExternalReads:
    torch.manual_seed(seed)
    return ExternalReads(reads, **kw)


def batches(n: int, *, seed: int = 1, batch: int = 4, seq: int = 8) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def loss_fn(m, batch):
    return m(*batch)
