"""An accumulation window left part-way, one process: by ``load_checkpoint`` (the grads of the
micro-batches done so far are dropped with the window) and by an error in backward (the engine
recovers: its clean-up drops the grads staged so far and never raises over the error). Training
on from the checkpoint then gives exactly the losses and values of an uninterrupted run, with the
window's grads summed on the host (grad_sync="every") or on the device (grad_sync="final"), and
with each chunk's grads in a host buffer of its own or passing through the grads window
(host_grads="window": the dropped grads give their slots back)."""
import pytest
import torch

import zero_offload as zo
from _engine_util import DEVICE, config, gpt_batches, gpt_loss, micro_gpt, train_engine

ACCUM = 2


def _engine(sync, host_grads="persistent"):
    return zo.initialize(micro_gpt(0), optimizer=zo.AdamW(lr=3e-3, weight_decay=0.1),
                         config=config(grad_accum=ACCUM, grad_sync=sync, host_grads=host_grads,
                                       grads_window=1), device=DEVICE)


def _uninterrupted(batches, tmp_path, sync):
    """Losses and values of training on from the checkpoint at a window boundary."""
    engine = _engine(sync)
    try:
        train_engine(engine, batches[:ACCUM], gpt_loss, accum=ACCUM)
        engine.save_checkpoint(tmp_path / "ckpt")
        losses = train_engine(engine, batches[ACCUM:], gpt_loss, accum=ACCUM)
        return losses, engine.state_dict()
    finally:
        engine.close()


def _check_resumed(engine, batches, tmp_path, expected):
    engine.load_checkpoint(tmp_path / "ckpt")
    assert engine.micro_step == 0
    losses = train_engine(engine, batches[ACCUM:], gpt_loss, accum=ACCUM)
    want_losses, want_sd = expected
    assert losses == want_losses
    sd = engine.state_dict()
    for k, v in want_sd.items():
        assert torch.equal(sd[k], v), k
    engine.synchronize()
    assert engine.store.window.taken == 0  # every slot back


HOST_GRADS = pytest.mark.parametrize("host_grads", ["persistent", "window"])


@HOST_GRADS
@pytest.mark.parametrize("sync", ["every", "final"])
def test_loading_a_checkpoint_mid_window_drops_the_window_grads(sync, host_grads, tmp_path):
    """grad_sync="final" kept the device sum of the dropped micro-batch and added the next
    window's grads to it."""
    batches = gpt_batches(3 * ACCUM)
    expected = _uninterrupted(batches, tmp_path, sync)
    engine = _engine(sync, host_grads)
    try:
        train_engine(engine, batches[:ACCUM], gpt_loss, accum=ACCUM)
        train_engine(engine, batches[-1:], gpt_loss, accum=ACCUM)  # a window left part-way
        assert engine.micro_step == 1
        _check_resumed(engine, batches, tmp_path, expected)
    finally:
        engine.close()


@HOST_GRADS
@pytest.mark.parametrize("sync", ["every", "final"])
def test_an_error_in_backward_leaves_one_process_able_to_go_on(sync, host_grads, tmp_path):
    """The error is raised when some chunks' grads have landed and others are incomplete. The
    clean-up released a device grads buffer it had not pinned with grad_sync="final"
    (StoreError), which failed the engine for good."""
    batches = gpt_batches(3 * ACCUM)
    expected = _uninterrupted(batches, tmp_path, sync)
    engine = _engine(sync, host_grads)
    model = engine.module
    try:
        train_engine(engine, batches[:ACCUM], gpt_loss, accum=ACCUM)
        armed = {"on": True}

        def boom(grad):
            if armed["on"]:
                raise ValueError("the user's backward hook failed")
            return grad

        def hook(module, args, out):
            out.register_hook(boom)

        handle = model.wpe.register_forward_hook(hook)  # its chunk: wpe (awaited), blocks.0.ln1 (landed)
        loss = gpt_loss(engine, batches[-1])
        with pytest.raises(ValueError, match="the user's backward hook failed") as raised:
            engine.backward(loss / ACCUM)
        assert not getattr(raised.value, "__notes__", None), raised.value.__notes__
        handle.remove()
        armed["on"] = False
        _check_resumed(engine, batches, tmp_path, expected)
    finally:
        engine.close()
