"""OffloadConfig.io_queue_depth (and DeepSpeed's aio.queue_depth) reaches the NVMe tier's I/O
engine: the depth the store's AioEngine runs with is the configured one, not the default 16."""
import torch

import zero_offload as zo
from _engine_util import DEVICE, config, mlp, mlp_batches, mlp_loss, train_engine
from zero_offload.store import ChunkStore, PayloadSpec, StoreConfig, Tier


def test_store_builds_its_io_engine_with_the_configured_depth(tmp_path):
    store = ChunkStore(StoreConfig(device="cpu", budgets={"cpu": 1 << 20, "nvme": 1 << 20},
                                   nvme_dir=tmp_path, io_queue_depth=3))
    cid = store.add_chunk({"state": PayloadSpec(1024, torch.float32, Tier.NVME)})
    store.fetch(cid, "state", Tier.CPU)
    store.get(cid, "state", Tier.CPU)  # through the I/O engine
    assert store._swap.engine.queue_depth == 3
    store.close()


def test_engine_passes_io_queue_depth_to_the_store(tmp_path):
    cfg = config(optimizer="nvme", nvme_dir=str(tmp_path), io_queue_depth=5)
    engine = zo.initialize(mlp(), optimizer=zo.AdamW(lr=1e-2), config=cfg, device=DEVICE)
    try:
        train_engine(engine, mlp_batches(2), mlp_loss)
        assert engine.store.config.io_queue_depth == 5
        assert engine.store._swap.engine.queue_depth == 5
    finally:
        engine.close()
