"""Activations a saved-tensor hook moves to the host, on a CUDA target traced on CPU tensors.

On a GPU, ``torch.autograd.graph.save_on_cpu`` (and hooks written like it, such as torchtune's activation offloading)
copy each tensor autograd saves to host memory in the pack hook, so that the device copy is freed as soon as the
forward drops it, and copy it back in the unpack hook when the backward needs it. A trace for a CUDA target runs on
CPU tensors, where "to the CPU" moves nothing: the hook would keep the device tensor alive, as if nothing were
offloaded. `host_offloading` runs every saved-tensor hook pushed while it is active under a torch-function mode that
gives the moves their GPU meaning:

- in a pack hook, ``Tensor.cpu()``, ``Tensor.to(<a CPU device>)`` and ``Tensor.pin_memory()`` of a device tensor make
  a copy, and a factory call whose tensor lands on the host (an explicit CPU device, ``pin_memory=True``, or no device
  where torch's default device is the CPU, as ``save_on_cpu(pin_memory=True)`` allocates) makes a host tensor; each
  such tensor leaves the device at once (`StorageTracker.to_host`);
- in an unpack hook, moving a host tensor to any device (``.to(device)``, ``.cuda()``) makes a device copy, which
  autograd holds while the backward uses it; a host tensor the hook returns as is gets one too.

Hooks that do not move tensors (torch's checkpointing, compression on the device) are unaffected. Read from torch's
``save_on_cpu`` (torch/autograd/graph.py); not measured on a GPU here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostTracker", "Offloaded", "host_offloading"]

_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.empty_strided, torch.tensor}
_LIKE = {torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like}


class HostTracker(Protocol):
    """What `host_offloading` needs of the trace's storage tracker (`preflight.trace._tracker.StorageTracker`)."""

    def to_host(self, tensor: torch.Tensor) -> int: ...

    def on_host(self, tensor: torch.Tensor) -> bool: ...


@dataclasses.dataclass
class Offloaded:
    """What the saved-tensor hooks of one trace moved: tensors and bytes sent to the host, copies brought back."""

    tensors: int = 0
    bytes: int = 0
    restored: int = 0

    def note(self) -> str:
        return (f"saved-tensor hooks moved {self.tensors} saved tensor(s) of the traced steps ({self.bytes:,} B in "
                "all) to host memory, off the CUDA device; each comes back as a device copy while the backward uses it "
                f"({self.restored} copies): the hooks' host copies read as on a GPU (from torch's save_on_cpu), not "
                "measured on a GPU")


def _names_device(arg: Any) -> bool:
    """Whether a positional argument of ``Tensor.to`` is a device (a string, a device, a CUDA index)."""
    return isinstance(arg, (str, torch.device)) or type(arg) is int


def _device_of(args: tuple, kwargs: dict) -> Any:
    """The device a ``Tensor.to`` call names, or None (a dtype or another tensor only)."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    return next((a for a in args[1:] if _names_device(a)), None)


def _is_cpu(device: Any) -> bool:
    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        return False


def _host_factory(func: Any, kwargs: dict) -> bool:
    if kwargs.get("pin_memory"):
        return True
    if kwargs.get("device") is not None:
        return _is_cpu(kwargs["device"])
    # no device: a _like factory follows its input; the others take torch's default device
    return func in _FACTORIES and torch.get_default_device().type == "cpu"


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or a.untyped_storage() is b.untyped_storage()


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone(memory_format=torch.preserve_format)


class _Moves(TorchFunctionMode):
    def __init__(self, tracker: HostTracker, record: Offloaded, unpacking: bool) -> None:
        super().__init__()
        self.tracker, self.record, self.unpacking = tracker, record, unpacking

    def device_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        self.record.restored += 1
        return _copy(tensor)

    def _off(self, tensor: torch.Tensor) -> torch.Tensor:
        self.record.tensors += 1
        self.record.bytes += self.tracker.to_host(tensor)
        return tensor

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _FACTORIES or func in _LIKE:
            if self.unpacking or not _host_factory(func, kwargs):
                return func(*args, **kwargs)
            kwargs.pop("pin_memory", None)  # no pinned memory on a CPU host; its bytes are off the device anyway
            if func in _LIKE:
                kwargs.pop("device", None)
            return self._off(func(*args, **kwargs))
        device = _device_of(args, kwargs) if func is torch.Tensor.to else None
        if func not in (torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.pin_memory) and device is None:
            return func(*args, **kwargs)
        source = args[0]
        if self.unpacking:
            if self.tracker.on_host(source):  # back to the device: a device copy (a dtype asked for is kept)
                kwargs.pop("device", None)
                rest = [a for a in args[1:] if not _names_device(a)]
                out = source.to(*rest, **kwargs) if func is torch.Tensor.to else source
                return self.device_copy(out) if _same_storage(out, source) else out
            if func is torch.Tensor.cuda or (func is torch.Tensor.to and not _is_cpu(device)):
                return source  # a device tensor "to the GPU": the trace's device stands for it
            return func(*args, **kwargs)
        to_host = func in (torch.Tensor.cpu, torch.Tensor.pin_memory) or (func is torch.Tensor.to and _is_cpu(device))
        if not to_host or self.tracker.on_host(source):
            return source if func is torch.Tensor.pin_memory else func(*args, **kwargs)
        out = source if func is torch.Tensor.pin_memory else func(*args, **kwargs)
        return self._off(_copy(out) if _same_storage(out, source) else out)


def _wrapped(hook: Callable[[Any], Any], tracker: HostTracker, record: Offloaded,
             unpacking: bool) -> Callable[[Any], Any]:
    def run(value: Any) -> Any:
        mode = _Moves(tracker, record, unpacking)
        with mode:
            out = hook(value)
            if unpacking and isinstance(out, torch.Tensor) and tracker.on_host(out):
                out = mode.device_copy(out)
        return out
    return run


@contextlib.contextmanager
def host_offloading(tracker: HostTracker) -> Iterator[Offloaded]:
    """While active, every ``torch.autograd.graph.saved_tensors_hooks`` entered (``save_on_cpu`` and other
    subclasses) pushes its hooks wrapped as the module docstring says; yields what they moved."""
    record = Offloaded()
    hooks = torch.autograd.graph.saved_tensors_hooks
    original = hooks.__enter__

    def enter(self: Any) -> None:
        torch._C._autograd._push_saved_tensors_default_hooks(
            _wrapped(self.pack_hook, tracker, record, False), _wrapped(self.unpack_hook, tracker, record, True))

    hooks.__enter__ = enter  # type: ignore[method-assign]
    try:
        yield record
    finally:
        hooks.__enter__ = original  # type: ignore[method-assign]
