"""A KernelTicket dropped before wait() keeps its buffers until its kernel ran: the native
kernel thread never writes memory Python has freed (see [Note: native threads at exit] in
csrc/kernel_queue.h)."""
import gc

import torch

from zero_offload import cpu_adam

KW = dict(step=1, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True, threads=1)


def test_dropped_ticket_waits_for_its_kernel():
    n = 1 << 21
    slow = [torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n)]
    ahead = [cpu_adam.adam_step_async(*slow, **KW) for _ in range(8)]  # keeps the queue busy
    p = torch.zeros(64)
    ticket = cpu_adam.adam_step_async(p, torch.ones(64), torch.zeros(64), torch.zeros(64), **KW)
    assert not ticket.ready()
    del ticket
    gc.collect()
    # The drop waited: the update is in p now (Adam's first step moves every element by ~lr).
    torch.testing.assert_close(p, torch.full((64,), -1e-2))
    for t in ahead:
        t.wait()
