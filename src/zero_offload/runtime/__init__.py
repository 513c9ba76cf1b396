"""The mechanism under both front ends: tiered chunk store, pinned pool, NVMe swap I/O, prefetch,
the CPU-Adam step pipeline, placement, partitioning, checkpoints and the trace.

Nothing here knows a module, a hook or a torch optimizer, and nothing here imports the front ends
(``engine``, ``offload_optim``), ``config`` or ``cli`` (tests/test_layering.py checks it)."""
