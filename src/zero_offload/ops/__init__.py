"""Native compute: the vectorised CPU-Adam kernel (``cpu_adam``) over the extension (``_native``).

Imports nothing else of zero_offload (tests/test_layering.py checks it)."""
