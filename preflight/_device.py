"""The seam between preflight and CUDA: everything that needs a real GPU goes through here.

On a machine without CUDA these functions say so (``None`` / False) instead of failing, so the logic around
them runs and is tested on CPU; tests of the CUDA paths carry the ``requires_cuda`` marker.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = [
    "cuda_available", "cuda_peaks", "cuda_reset_peaks", "device_capacity", "model_device", "resolve_device", "trace_device_for", "live_storage_bytes",
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


def trace_device_for(target: torch.device) -> torch.device:
    """Where to run the fake trace: the target when it is here, else CPU (autograd on fake CUDA tensors needs a GPU)."""
    if target.type == "cuda" and cuda_available():
        return target
    return torch.device("cpu")


def live_storage_bytes(tensors: Any, device: torch.device) -> int:
    """Bytes of the distinct storages behind ``tensors`` (any nested structure) that live on ``device``."""
    seen: set[int] = set()
    total = 0
    for t in tree_flatten(tensors)[0]:
        if not isinstance(t, torch.Tensor) or t.device.type != device.type:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen and storage.data_ptr() != 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
