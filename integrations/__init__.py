"""The trainer adapters, shipped as ``preflight.integrations``: one module per framework, each imported on its own
so that only that framework is needed. `lightning` (a ``PreflightCallback`` for ``lightning.pytorch`` and
``pytorch_lightning`` Trainers), `hf` (a ``PreflightCallback`` for the Hugging Face ``Trainer``, with ``attach`` and
``autotune``) and `accelerate` (``preflight_check`` and ``StepVerifier`` for accelerate and hand-written loops) read
the trainer's precision, loop and strategy into a `preflight.Run`, lay the user's `Run` over it, and hand it to
`preflight.verdict`. Framework glue only: every decision lives in the core.
"""
