"""Shared by the tests/test_offload_optim_*.py files: a small GPT, data, a training loop, and
the comparison against plain torch."""
import torch

from zero_offload.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16, bias=False)
"""No biases: the attention key bias has a mathematically zero grad (softmax is shift-invariant),
so its grads are rounding noise that Adam normalises to full-size steps; any two Adam
implementations (torch foreach vs fused too) then differ there by ~1e-4 after a few steps."""


def make_model(device="cpu", dtype=None, seed=0):
    torch.manual_seed(seed)
    return GPT(CFG, device=device, dtype=dtype)


def batches(n, *, device="cpu", seed=1, batch=4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len), generator=g)
        y = torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len), generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def train(model, opt, data, *, sched=None, accum=1):
    """The usual loop: (accum x backward), step, scheduler, zero_grad. Returns the losses."""
    losses = []
    for i in range(0, len(data), accum):
        for x, y in data[i:i + accum]:
            loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
    return losses


def max_rel_diff(model_a, model_b):
    """Largest |a - b| / max|b| over the params (fp32)."""
    worst = 0.0
    for (name, a), (_, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        a, b = a.detach().float().cpu(), b.detach().float().cpu()
        worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item())
    return worst


def assert_moved(model, start):
    """Training must have changed the params (so a parity test cannot pass by doing nothing)."""
    assert max_rel_diff(model, start) > 1e-3
