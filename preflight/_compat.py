"""Make libraries take their real-run code paths under fake tensors.

Some libraries change behaviour when they see a `FakeTensor` because they assume it means graph capture.
transformers' ``is_tracing(tensor)`` is true for fake tensors, and then ``masking_utils`` always builds an
explicit 4-D attention mask that the real run skips (measured: +0.04% to +3.1% of the peak). Inside the trace
the value shadows of `preflight._tracker` can answer the real run's value checks, so these functions are told
the truth: a fake tensor alone is not graph capture. Only modules the user already imported are patched, and
only for the duration of the trace.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["real_run_paths"]


@contextlib.contextmanager
def real_run_paths(notes: list[str]) -> Iterator[None]:
    """Patch known tracing checks for the duration of a fake trace; appends what it patched to ``notes``."""
    patches: list[tuple[Any, str, Any]] = []
    masking = sys.modules.get("transformers.masking_utils")
    if masking is not None and hasattr(masking, "is_tracing"):
        original = masking.is_tracing

        def is_tracing(tensor: Any = None, _original: Any = original) -> bool:
            from torch._subclasses.fake_tensor import FakeTensor

            return _original(None if isinstance(tensor, FakeTensor) else tensor)

        patches.append((masking, "is_tracing", original))
        masking.is_tracing = is_tracing
    try:
        yield
    finally:
        for module, name, original in patches:
            setattr(module, name, original)
