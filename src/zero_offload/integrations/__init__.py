"""Front ends for other training libraries, built on the public engine API (``initialize``,
``Engine``). Each submodule imports its library on first use; ``import zero_offload`` never does.

- ``zero_offload.integrations.hf``: ``ZeroOffloadTrainer``, a Hugging Face ``transformers.Trainer``
  that trains with the engine (params and optimizer state offloaded).
"""
