"""Where no global quantity is needed (no clipping, no fp16 overflow check), each chunk is
updated on the CPU as soon as its grads land, while backward goes on; with clipping the updates
wait for step(). Both orders give bit-identical results."""
import torch

import zero_offload as zo
from _engine_util import DEVICE, config, gpt_batches, gpt_loss, micro_gpt, train_engine


def _run(**kw):
    engine = zo.initialize(micro_gpt(), optimizer=zo.AdamW(lr=3e-3), config=config(**kw), device=DEVICE)
    trainable = sum(c.layout.trainable for c in engine.group.chunks)
    batches = gpt_batches(3)
    updates_before_step = []
    for b in batches:
        loss = gpt_loss(engine, b)
        engine.backward(loss)
        engine.pipeline.drain()
        updates_before_step.append(engine.pipeline.stats.updates)
        engine.step()
    sd = engine.state_dict()
    engine.close()
    return trainable, updates_before_step, sd


def test_updates_overlap_backward_and_match_the_exact_order():
    n, overlapped, sd_overlap = _run(overlap=True)
    assert overlapped == [n, 2 * n, 3 * n]  # every chunk updated during backward, before step()
    _, deferred, sd_exact = _run(overlap=False)
    assert deferred == [0, n, 2 * n]  # updates queued by step(), run during the next forward
    for k in sd_exact:
        assert torch.equal(sd_overlap[k], sd_exact[k]), k
