"""Make libraries take their real-run code paths under fake tensors.

Some libraries change behaviour when they see a `FakeTensor` because they assume it means graph capture.
transformers' ``is_tracing(tensor)`` is true for fake tensors, and then ``masking_utils`` always builds an
explicit 4-D attention mask that the real run skips (measured: +0.04% to +3.1% of the peak). Inside the trace
the value shadows of `preflight.trace._tracker` can answer the real run's value checks, so these functions are told
the truth: a fake tensor alone is not graph capture. Only modules the user already imported are patched, and
only for the duration of the trace.

A module that casts itself inside forward (Switch Transformers' router: ``self.classifier =
self.classifier.to(self.dtype)``) runs ``Module._apply``, which always swaps fake parameters with
``torch.utils.swap_tensors``; that refuses tensors with weak references, and fake tensors always have some. In
the real run the parameter keeps its identity and takes the converted data (``param.data = ...``); the trace
does the same to the fake twin, which is what the optimizer and autograd hold (`_fake_swap_tensors`).

A fake tensor handed to NumPy (``np.asarray(t)``, ``t.numpy()``) gives its shadow's values when they are known,
else zeros of its shape, and the line is named in coverage (`StorageTracker.host_array`).

A 0-dim tensor in an f-string formats as its value in the real run (``f"expert_{idx}"``) but as
``FakeTensor(...)`` in the trace; during the trace it formats as its value (`_format_like_a_tensor`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["real_run_paths"]


@contextlib.contextmanager
def real_run_paths(notes: list[str], host_array: Callable[[torch.Tensor], Any] | None = None) -> Iterator[None]:
    """Patch known tracing checks for the duration of a fake trace; appends what it patched to ``notes``.

    ``host_array(fake)``: the NumPy array a fake tensor converts to (``np.asarray(t)``, ``t.numpy()``), from its
    value shadow or a stated placeholder (`preflight.trace._tracker.StorageTracker.host_array`).
    """
    patches: list[tuple[Any, str, Any]] = []
    if host_array is not None:
        for name in ("__array__", "numpy"):
            patches.append((FakeTensor, name, FakeTensor.__dict__.get(name, _MISSING)))
        FakeTensor.__array__ = _to_numpy(host_array, dtype_arg=True)
        FakeTensor.numpy = _to_numpy(host_array, dtype_arg=False)
    masking = sys.modules.get("transformers.masking_utils")
    if masking is not None and hasattr(masking, "is_tracing"):
        original = masking.is_tracing

        def is_tracing(tensor: Any = None, _original: Any = original) -> bool:
            from torch._subclasses.fake_tensor import FakeTensor

            return _original(None if isinstance(tensor, FakeTensor) else tensor)

        patches.append((masking, "is_tracing", original))
        masking.is_tracing = is_tracing
    patches.append((torch.utils, "swap_tensors", torch.utils.swap_tensors))
    torch.utils.swap_tensors = _fake_swap_tensors(torch.utils.swap_tensors)
    patches.append((FakeTensor, "__format__", FakeTensor.__dict__.get("__format__", _MISSING)))
    FakeTensor.__format__ = _format_like_a_tensor
    if "bitsandbytes" in sys.modules and hasattr(torch.ops, "bitsandbytes"):
        namespace = torch.ops.bitsandbytes
        for name in ("optimizer_update_32bit", "optimizer_update_8bit_blockwise"):
            # The packet torch caches on first use is put back as it is: kernels registered for its overloads are
            # keyed by those objects, which a new packet would not have.
            packet = getattr(namespace, name, None)
            if packet is not None and not hasattr(packet, "_preflight_packet"):  # not already in an outer trace
                patches.append((namespace, name, packet))
                setattr(namespace, name, _norm_as_float(packet, notes))
    try:
        yield
    finally:
        for owner, name, original in patches:
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


_MISSING = object()
_NORM_NOTE = ("bitsandbytes' update-norm clipping (max_unorm: LAMB, LARS) hands its kernel the parameter's norm as a "
              "Python float, a value computed from parameters: 1.0 was used (it scales the update, not which "
              "tensors exist)")


def _norm_as_float(packet: Any, notes: list[str]) -> Any:
    """bitsandbytes' optimizer operator with its ``param_norm`` argument (a float in its schema, which a real 0-dim
    tensor converts to and a fake one cannot) given as a placeholder when it is a fake tensor."""
    return _NormAsFloat(packet, notes)


class _NormAsFloat:
    """`_norm_as_float`'s operator: called, the placeholder; otherwise the packet itself (``.default``, schema)."""

    def __init__(self, packet: Any, notes: list[str]) -> None:
        self._preflight_packet, self._notes = packet, notes
        names = [a.name for a in packet.default._schema.arguments]
        self._at = names.index("param_norm") if "param_norm" in names else -1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        at = self._at
        if 0 <= at < len(args) and isinstance(args[at], FakeTensor):
            args = (*args[:at], 1.0, *args[at + 1:])
            if _NORM_NOTE not in self._notes:
                self._notes.append(_NORM_NOTE)
        return self._preflight_packet(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._preflight_packet, name)


def _to_numpy(host_array: Callable[[torch.Tensor], Any], *, dtype_arg: bool) -> Callable[..., Any]:
    # A fake tensor refuses `.numpy()` ("not supported for tensor subclasses"); the real run hands the values to
    # NumPy (scipy's linear_sum_assignment in DETR's Hungarian matcher).
    if dtype_arg:
        def __array__(self: torch.Tensor, dtype: Any = None, copy: Any = None) -> Any:
            array = host_array(self)
            return array if dtype is None else array.astype(dtype, copy=False)

        return __array__

    def numpy(self: torch.Tensor, *, force: bool = False) -> Any:
        return host_array(self)

    return numpy


def _format_like_a_tensor(self: torch.Tensor, format_spec: str) -> str:
    # `Tensor.__format__` formats a 0-dim plain tensor as its value (f"expert_{idx}" in Switch Transformers'
    # expert loop) and anything else, subclasses included, as the object: a fake scalar would format as
    # "FakeTensor(...)". Format it as the real run does; its value comes from its shadow, or stops the trace.
    if self.dim() == 0:
        return self.detach().item().__format__(format_spec)
    return object.__format__(self, format_spec)


def _fake_swap_tensors(original: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[..., None]:
    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if not (isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)):
            return original(t1, t2)
        # Exchange the data, not the Python objects: each keeps its identity, requires_grad and attributes
        # (`Module._apply` discards t2 right after; t1 is the parameter the optimizer and autograd know).
        with torch.no_grad():
            data1, data2 = t1.detach(), t2.detach()
            t1.data, t2.data = data2, data1
        return None

    return swap_tensors
