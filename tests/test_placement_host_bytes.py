"""Host bytes per param of the plan ([Note: host bytes] in runtime/placement.py): with the
optimizer state on the host, exact fp32 state is 12 bytes per param (master and two moments);
the grads window ([Note: grads window]) adds a fixed window, not bytes per param, so the plan's
slope is 12 B/param and the whole stays <= 12.5 B/param from 1.3B params on. The persistent
layout keeps 2 more (bf16 grads per param); params on the host 2 more again. Checked at two model
sizes (pure plans: nothing is allocated), one rank and four."""
import dataclasses

import pytest
import torch

from zero_offload.runtime.placement import (Budgets, ChunkNeed, PlacementRequest, host_window,
                                            plan_placement)
from zero_offload.runtime.store import Tier
from zero_offload.runtime.update_rule import AdamRule
from zero_offload.runtime.vocab import Placement

CHUNK = 32 << 20
"""Elements per chunk: 64 MiB of bf16 (the engine's default chunk_mb)."""
BIG = 1 << 50
SIZES = (1_313_722_368, 6_582_000_000)
"""The fair harness's 1.31B model and the "7b" preset (6.58B)."""


def _request(params: int, *, ranks=1, params_home=Placement.GPU, host_grads="window", **kw):
    shard = CHUNK // ranks
    n = -(-params // CHUNK)
    last = params - (n - 1) * CHUNK
    chunks = [ChunkNeed(numel=shard, dtype=torch.bfloat16) for _ in range(n - 1)]
    chunks.append(ChunkNeed(numel=-(-last // ranks), dtype=torch.bfloat16))
    return PlacementRequest(chunks=tuple(chunks), budgets=Budgets(gpu=BIG, cpu=BIG), params=params_home,
                            optimizer=Placement.CPU, rule=AdamRule(), ranks=ranks, host_grads=host_grads,
                            **kw)


def _per_param(params: int, **kw) -> tuple:
    """(host bytes of the node per param, the window's bytes on the node)."""
    ranks = kw.get("ranks", 1)
    request = _request(params, **kw)
    plan = plan_placement(request)
    return ranks * plan.need[Tier.CPU] / params, ranks * host_window(plan.request)[1]


@pytest.mark.parametrize("ranks", [1, 4])
def test_exact_state_at_12_bytes_per_param_plus_a_fixed_window(ranks):
    (small, window), (large, window_large) = (_per_param(n, ranks=ranks) for n in SIZES)
    assert window == window_large == 4 * CHUNK * 2  # 4 slots of a chunk's bf16 grads (shards: per rank)
    # The slope: what each further param costs. 12 B of fp32 state, plus at most the 4 KiB
    # rounding of three payloads per chunk (3 * 4096 B per 32M params: 0.0004 B/param).
    slope = (large * SIZES[1] - small * SIZES[0]) / (SIZES[1] - SIZES[0])
    assert 12.0 <= slope <= 12.0 + 3 * 4096 * ranks / CHUNK + 1e-9
    # The whole: 12 B/param and the window (256 MiB: 0.2 B/param at 1.31B), nothing else.
    for n, per in zip(SIZES, (small, large)):
        assert per * n <= 12 * n + window + 3 * 4096 * ranks * (-(-n // CHUNK) + 1)
    assert small <= 12.5 and large <= 12.5


def test_the_persistent_layout_keeps_two_bytes_more():
    for n in SIZES:
        window, _ = _per_param(n)
        persistent, none = _per_param(n, host_grads="persistent")
        assert none == 0
        assert 14.0 <= persistent <= 14.001
        assert persistent - window >= 1.75


def test_params_on_the_host_keep_their_bf16_copy():
    """params="cpu": the bf16 working copy is homed in host memory (2 B/param beside the 12 of the
    state): 14 B/param and the window."""
    for n in SIZES:
        per, window = _per_param(n, params_home=Placement.CPU)
        assert 14.0 <= per <= 14.0 + window / n + 0.001


def test_the_window_holds_every_chunk_when_the_updates_wait_for_the_decision():
    """Clipping or fp16 with no accumulation buffer: every chunk's grads wait for the window's
    decision, so the window holds them all: the persistent layout's bytes (no saving)."""
    n = SIZES[0]
    held, window = _per_param(n, grads_wait=True)
    persistent, _ = _per_param(n, host_grads="persistent")
    assert window == len(_request(n).chunks) * CHUNK * 2
    # (each slot is as large as the largest chunk's grads: the smaller last chunk's slot is not)
    assert persistent <= held <= persistent + 2 * CHUNK / n
    auto = plan_placement(dataclasses.replace(_request(n), host_grads="auto", grads_wait=True))
    assert auto.request.host_grads == "persistent"
