"""The seam between preflight and CUDA: everything that needs a real GPU goes through here.

On a machine without CUDA these functions say so (``None`` / False) instead of failing, so the logic around
them runs and is tested on CPU; tests of the CUDA paths carry the ``requires_cuda`` marker.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "planned",
    "planned_fill",
    "cuda_available", "cuda_recurrent_note", "cuda_peaks", "cuda_reset_peaks", "device_capacity", "held_tensors",
    "is_plain_object",
    "iter_tensors", "live_storage_bytes", "live_storages", "map_held_tensors", "map_tensors", "model_device",
    "named_tensors", "resolve_device", "trace_device_for",
]


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_reset_peaks(device: torch.device) -> None:  # pragma: no cover - needs a GPU
    """Start a measurement window: synchronise and reset the caching allocator's peak statistics."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)


def cuda_peaks(device: torch.device) -> tuple[int, int]:  # pragma: no cover - needs a GPU
    """End a measurement window: ``(max_memory_allocated, max_memory_reserved)`` since `cuda_reset_peaks`."""
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.max_memory_reserved(device))


def device_capacity(device: torch.device) -> int | None:
    """Total bytes of a CUDA device (``torch.cuda.mem_get_info``), or None when it cannot be read (CPU, no GPU)."""
    if device.type != "cuda" or not cuda_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(total)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a model with neither)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def resolve_device(device: Any, model: nn.Module) -> torch.device:
    """The device planned for: ``device`` if given, else the model's; a meta model plans for CPU."""
    if device is None:
        device = model_device(model)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"`device` should be a torch device such as 'cuda' or 'cpu', got {device!r}.") from err
    if device.type == "meta":
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None and cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def unmodelled_device_note(target: torch.device) -> list[str]:
    """A note for a target whose kernels and allocator preflight does not model (MPS, XPU, ...): only CPU and CUDA
    are; other devices are planned with the CPU kernels' outputs, which says nothing of their own allocator."""
    if target.type in ("cpu", "cuda", "meta"):
        return []
    return [f"{target.type} is not modelled (only CPU and CUDA are): planned with the CPU kernels' tensor bytes, "
            f"without {target.type}'s own allocator, workspaces or runtime; treat the figure as a lower bound there"]


def cuda_recurrent_note(model: torch.nn.Module, target: torch.device) -> list[str]:
    """A note for a CUDA target whose model has recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): the trace
    runs the CPU's recurrent kernels (oneDNN's LSTM layer and its workspace, ATen's GRU and RNN cells), while a GPU
    runs cuDNN's, whose reserve space and workspace cuDNN sizes at run time (``cudnnGetRNNTempSpaceSizes``); their
    meta functions return empty ones. Not modelled: said, not guessed."""
    if target.type != "cuda" or not isinstance(model, torch.nn.Module):  # a pipeline schedule: its stages' own
        return []
    layers = [type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.RNNBase)]
    if not layers:
        return []
    kinds = ", ".join(f"{n} x{layers.count(n)}" for n in sorted(set(layers)))
    return [f"recurrent layers ({kinds}) on a CUDA target are traced with the CPU's kernels: cuDNN's reserve space "
            "and workspace for them (sized by cuDNN at run time) are not modelled, so their part of the figure is "
            "approximate"]


def trace_device_for(target: torch.device) -> torch.device:
    """Where to run the fake trace: the target when it is here, else CPU (autograd on fake CUDA tensors needs a GPU)."""
    if target.type == "cuda" and cuda_available():
        return target
    return torch.device("cpu")


def live_storage_bytes(tensors: Any, device: torch.device) -> int:
    """Bytes of the distinct storages behind ``tensors`` (any nested structure) that live on ``device``."""
    return sum(live_storages(tensors, device).values())


def live_storages(tensors: Any, device: torch.device) -> dict[int, int]:
    """The distinct storages behind ``tensors`` (any nested structure) that live on ``device``: their data
    address (the allocator's block) -> bytes. Storages without data (address 0) are keyed by the C++ storage's
    address (``_cdata``: every view of one storage shares it); a wrapper subclass (DTensor) counts the tensors it
    wraps; a fake tensor counts nothing, nor does a sparse or mkldnn tensor (no storage to read)."""
    from torch.nn.parameter import is_lazy
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    storages: dict[int, int] = {}
    for t in iter_tensors(tensors):
        if t.device.type != device.type or is_lazy(t):  # a lazy module's parameter holds nothing before its forward
            continue
        if is_traceable_wrapper_subclass(t):  # a DTensor's memory is its local tensor's (a wrapper has no storage)
            names, _ = t.__tensor_flatten__()
            storages.update(live_storages([getattr(t, name) for name in names], device))
            continue
        try:
            storage = t.untyped_storage()
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # a fake or functional tensor holds no memory; sparse and mkldnn
            continue                                 # tensors have no storage to read (their bytes are not counted)
        storages[address or storage._cdata] = storage.nbytes()
    return storages


def planned(shape: tuple[int, ...], dtype: torch.dtype, fill: float | int) -> torch.Tensor:
    """A batch tensor for planning: on the meta device (no host memory, whatever its size), filled with ``fill``
    as far as a trace is concerned (its twin's value shadow, `preflight.trace._run.shadow_value`)."""
    t = torch.empty(shape, dtype=dtype, device="meta")
    t._preflight_fill = fill
    return t


def planned_fill(t: Any) -> float | int | None:
    """The constant a `planned` tensor stands for, or None."""
    return getattr(t, "_preflight_fill", None) if isinstance(t, torch.Tensor) else None


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested batch: mappings of any type (transformers' ``BatchEncoding`` is a ``UserDict``,
    which torch's pytree treats as one leaf), lists, tuples and named tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value)


def named_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_tensors` with each tensor's path in ``obj`` (``"['input_ids']"``, ``"[0]"``; ``""`` for ``obj``)."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from named_tensors(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from named_tensors(value, f"{path}[{i}]")


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``, keeping the containers' types where they allow it.

    Tensors are visited in the order `iter_tensors` yields them.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        mapped = {k: map_tensors(fn, v) for k, v in obj.items()}
        if type(obj) is dict:
            return mapped
        try:  # keep the user's mapping type (e.g. BatchEncoding): models may rely on it
            return type(obj)(mapped)
        except TypeError:
            return mapped
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def map_held_tensors(t: torch.Tensor, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """The public attributes of a parameter subclass, with each tensor ``x`` held in them replaced by
    ``fn(path, x)``: bitsandbytes' ``Params4bit.quant_state`` (``absmax``, ``code``, the nested ``state2``) and
    ``Int8Params.CB`` / ``SCB`` are memory the weight holds on the device beside its own storage. Plain objects
    that hold tensors (``QuantState``) are copied with theirs replaced; anything else (``blocksize``, the
    ``module`` a weight names) is returned as it is. Empty for a plain tensor or parameter."""
    if type(t) in (torch.Tensor, nn.Parameter) or type(t).__name__ == "FakeTensor":
        return {}
    attributes: dict[str, Any] = {}
    for name, value in _public_attributes(t):
        mapped = _map_held(value, f".{name}", fn, {}, 0)
        attributes[name] = value if mapped is _NOTHING else mapped
    return attributes


def held_tensors(t: torch.Tensor, *, any_type: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The tensors `map_held_tensors` finds on ``t``, with their attribute paths (``.quant_state.absmax``).
    ``any_type``: look in ``t``'s public attributes whatever its type (a plain fake parameter that carries what the
    original's subclass held)."""
    found: list[tuple[str, torch.Tensor]] = []

    def keep(path: str, x: torch.Tensor) -> torch.Tensor:
        found.append((path, x))
        return x

    if any_type:
        for name, value in _public_attributes(t):
            _map_held(value, f".{name}", keep, {}, 0)
    else:
        map_held_tensors(t, keep)
    return found


_NOTHING = object()


def _map_held(value: Any, path: str, fn: Callable[[str, torch.Tensor], torch.Tensor], seen: dict[int, Any],
              depth: int) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(path, value)
    if depth >= 4 or not is_plain_object(value):
        return _NOTHING
    if id(value) in seen:
        return seen[id(value)]
    seen[id(value)] = value
    changes = {}
    found = False
    for name, item in _public_attributes(value):
        mapped = _map_held(item, f"{path}.{name}", fn, seen, depth + 1)
        if mapped is not _NOTHING:
            found = True
            if mapped is not item:
                changes[name] = mapped
    if not found:
        return _NOTHING
    if changes:
        clone = copy.copy(value)
        vars(clone).update(changes)
        seen[id(value)] = clone
        return clone
    return value


def _public_attributes(obj: Any) -> list[tuple[str, Any]]:
    try:
        return [(k, v) for k, v in vars(obj).items() if not k.startswith("_")]
    except TypeError:  # no __dict__
        return []


def is_plain_object(value: Any) -> bool:
    """An instance of a Python class with its own ``__dict__`` (a ``QuantState``, a model's config, a helper that
    caches on itself): not a module, tensor, class, function or module object."""
    if isinstance(value, (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType)):
        return False
    try:
        return type(vars(value)) is dict
    except TypeError:
        return False


class OutsideModules:
    """Counts the parameters and buffers of the modules a step calls that are not part of ``model`` (a distillation
    teacher, a reference model, a loss module with class weights): allocated on the device before the step and alive
    for the whole run, they are in a GPU's ``torch.cuda.max_memory_allocated``, though neither the model nor the
    step's own allocations. Used as a context manager around the step (a global forward pre-hook, which reads and
    allocates nothing); each newly seen storage on ``device`` that is not ``model``'s nor among ``known``
    (`live_storages` keys) is added to ``counted`` and reported to ``on_new(nbytes, module)``; ``first`` is the
    first such module called (the teacher itself, before its layers) and ``where()`` at that call. Fake tensors
    count nothing (`live_storages`): a trace's copies of the model are never outside it. Nothing is counted for a
    compiled model (``torch.compile(module)``, ``module.compile()``)."""

    def __init__(self, model: nn.Module, device: torch.device, known: Iterator[int] | Mapping[int, int] = (),
                 on_new: Callable[[int, nn.Module], None] | None = None,
                 where: Callable[[], str | None] | None = None) -> None:
        self.device = device
        self.first: tuple[str, str | None] | None = None  # (class name, where()) of the first outside module called
        self._where = where
        self._own = {id(m) for m in model.modules()}
        self._known = set(known) | set(live_storages([list(model.parameters()), list(model.buffers())], device))
        self.counted: dict[int, int] = {}
        self.on_new = on_new
        self._handle: Any = None
        self._compiled = any(type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
                             for m in model.modules())

    def __enter__(self) -> OutsideModules:
        # Not for a compiled model: a global module hook changes what dynamo compiles (and so what it allocates), and
        # torch warns about it at every call.
        if not self._compiled:
            self._handle = nn.modules.module.register_module_forward_pre_hook(self._called)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def nbytes(self) -> int:
        return sum(self.counted.values())

    def _called(self, module: nn.Module, args: Any) -> None:
        if id(module) in self._own:
            return
        if self.first is None:
            self.first = (type(module).__name__, self._where() if self._where is not None else None)
        tensors = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
        new = 0
        for key, nbytes in live_storages(tensors, self.device).items():
            if key not in self._known and key not in self.counted:
                self.counted[key] = nbytes
                new += nbytes
        if new and self.on_new is not None:
            self.on_new(new, module)
