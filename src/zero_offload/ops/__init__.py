"""Native compute over the extension (``_native``): the vectorised CPU-Adam kernel (``cpu_adam``)
and the elementwise rules SGD and Lion (``cpu_rules``).

Imports nothing else of zero_offload (tests/test_layering.py checks it)."""
