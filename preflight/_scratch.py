"""Calibrate memory that kernels allocate internally, where no dispatch mode can see it.

oneDNN convolutions on CPU and cuDNN convolutions on CUDA allocate workspace inside the kernel. It is counted
by the allocator (so by the measured peak) but is not an operator output. Measured here on CPU: a 7x7
depthwise convolution's forward and backward allocated about twice its input in scratch; on a small ConvNeXt
it was 26% of the training peak.

Low-precision (bf16, fp16) matrix products on CPU do the same: oneDNN reorders the operands and accumulates in
fp32 in buffers of its own. Measured here: a bf16 ``mm`` of 128x64 by 64x96 held 108,160 bytes at its peak
against a 24,576-byte output; fp32 products hold nothing beyond their output. So ``mm``, ``addmm``, ``bmm`` and
``baddbmm`` in bf16 or fp16 on a CPU target are calibrated like convolutions. (cuBLAS's workspace on CUDA is a
per-device term of its own, see `preflight._gpus`.)

For each distinct configuration in the trace, the real operator is run once on the target device (at the
traced size when that is small; a convolution larger than that at batch 1 and 2, extrapolated linearly; a
matrix product larger than that is listed as not calibrated), and the bytes it held beyond its outputs are
inserted into the event list as a transient allocation at that operator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from preflight._device import cuda_peaks, cuda_reset_peaks
from preflight._result import Event

__all__ = ["SCRATCH_OPS", "scratch_ops", "calibrate", "ScratchResult"]

# Operator -> positions of its arguments that carry the batch dimension (the rest are weights and options).
SCRATCH_OPS = {torch.ops.aten.convolution.default: (0,), torch.ops.aten.convolution_backward.default: (0, 1)}
# Matrix products, calibrated only in a low-precision dtype on a CPU target, only at their traced size: which
# operand carries the batch differs between the forward and the backward products.
MATMUL_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                        torch.ops.aten.baddbmm.default})
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Calibrate at the traced size when the operator's tensors take at most this much real memory.
_EXACT_LIMIT = 256 * 2**20


def scratch_ops(device: torch.device) -> Callable[[Any, Any], bool]:
    """``record_op(func, args)`` for a trace: whether an operator call needs its scratch calibrated on ``device``."""
    def record_op(func: Any, args: Any) -> bool:
        return (func in SCRATCH_OPS or func in MATMUL_OPS) and _needs_calibration(func, args, device)

    return record_op


def _needs_calibration(func: Any, args: Any, device: torch.device) -> bool:
    if func in SCRATCH_OPS:
        return True
    return device.type == "cpu" and any(getattr(a, "dtype", None) in _LOW_PRECISION for a in tree_flatten(args)[0])


@dataclasses.dataclass
class ScratchResult:
    events: list[Event]
    calibrated: list[str]
    skipped: list[str]


def calibrate(events: list[Event], op_log: list[tuple[int, int, Any, Any, Any]], device: torch.device,
              can_run: bool, configs: dict[Any, int | None] | None = None) -> ScratchResult:
    """Insert each logged operator's measured scratch into ``events``.

    Args:
        op_log: ``(op_index, event_index, func, args, kwargs)`` with tensors as `TensorSpec`.
        device: the target device.
        can_run: whether real kernels can run on ``device`` here (False: planning for CUDA without a GPU).
        configs: measurements by operator configuration, shared between calls for traces of one model (the
            shallow traces of a composed one); filled in.
    """
    if not op_log:
        return ScratchResult(events, [], [])
    configs = {} if configs is None else configs
    seen: set[Any] = set()
    calibrated: list[str] = []
    skipped: list[str] = []
    inserts: list[tuple[int, int, int]] = []  # (event_index, op_index, bytes)
    for op_index, event_index, func, args, kwargs in op_log:
        key = (func, _freeze(args), _freeze(kwargs))
        if key not in configs:
            configs[key] = _measure_scratch(func, args, kwargs, device) if can_run else None
        if key not in seen:
            seen.add(key)
            label = f"{func.overloadpacket.__name__}{_shape_label(args)}"
            (calibrated if configs[key] is not None else skipped).append(label)
        extra = configs[key]
        if extra:
            inserts.append((event_index, op_index, extra))
    if not inserts:
        return ScratchResult(events, calibrated, skipped)
    out: list[Event] = []
    position = 0
    for n, (event_index, op_index, extra) in enumerate(inserts):
        out.extend(events[position:event_index])
        position = event_index
        phase = events[event_index - 1].phase if event_index else "setup"
        uid = -1 - n  # negative uids: never collide with storages
        out.append(Event(uid, extra, op_index, phase))
        out.append(Event(uid, -extra, op_index, phase))
    out.extend(events[position:])
    return ScratchResult(out, calibrated, skipped)


def _freeze(x: Any) -> Any:
    leaves, spec = tree_flatten(x)
    return (tuple(leaves), str(spec))


def _shape_label(args: Any) -> str:
    shapes = [tuple(a.shape) for a in tree_flatten(args)[0] if hasattr(a, "shape")]
    return str(shapes[:2])


def _with_batch(func: Any, args: tuple, batch: int | None) -> list:
    """``args`` with the batch dimension of the batch-carrying tensors set to ``batch`` (None: unchanged)."""
    out = list(args)
    for i in SCRATCH_OPS.get(func, ()):
        if batch is not None and hasattr(out[i], "shape"):
            out[i] = dataclasses.replace(out[i], shape=(batch, *out[i].shape[1:]))
    return out


def _spec_bytes(args: Any) -> int:
    total = 0
    for a in tree_flatten(args)[0]:
        if hasattr(a, "shape"):
            n = 1
            for d in a.shape:
                n *= d
            total += n * a.dtype.itemsize
    return total


def _measure_scratch(func: Any, args: Any, kwargs: Any, device: torch.device) -> int | None:
    try:
        if _spec_bytes(args) * 3 <= _EXACT_LIMIT:
            return _scratch_at(func, args, kwargs, device, None)
        if func not in SCRATCH_OPS:
            return None  # a matrix product too large to run here
        full = args[SCRATCH_OPS[func][0]].shape[0]
        if full <= 2:
            return _scratch_at(func, args, kwargs, device, None)
        one, two = _scratch_at(func, args, kwargs, device, 1), _scratch_at(func, args, kwargs, device, 2)
        return max(0, two + (two - one) * (full - 2))
    except Exception:  # noqa: BLE001 - a configuration that cannot run here is reported as not calibrated
        return None


def _materialise(x: Any, device: torch.device) -> Any:
    """A zero tensor of the spec's shape and dtype, laid out in memory as the traced one was.

    The layout matters: oneDNN picks another algorithm, with other scratch, for a channels-last or permuted
    gradient than for a contiguous one (measured: 19 MB against almost none for one depthwise backward).
    """
    from preflight.trace import TensorSpec

    if not isinstance(x, TensorSpec):
        return x
    dims = len(x.shape)
    # Physical order: dimensions by decreasing stride (ties keep their logical order).
    order = sorted(range(dims), key=lambda d: (-x.stride[d], d)) if len(x.stride) == dims else list(range(dims))
    physical = torch.zeros([x.shape[d] for d in order], dtype=x.dtype, device=device)
    inverse = [order.index(d) for d in range(dims)]
    return physical.permute(inverse)


def _scratch_at(func: Any, args: Any, kwargs: Any, device: torch.device, batch: int | None) -> int:
    real_args = tree_map(lambda x: _materialise(x, device), _with_batch(func, args, batch))
    real_kwargs = tree_map(lambda x: _materialise(x, device), kwargs)
    with torch.no_grad():
        if device.type == "cuda":  # pragma: no cover - needs a GPU
            base = torch.cuda.memory_allocated(device)
            cuda_reset_peaks(device)
            out = func(*real_args, **real_kwargs)
            peak = cuda_peaks(device)[0] - base
        else:
            from preflight._measure import cpu_profiled_peak

            holder: list[Any] = []
            peak, _ = cpu_profiled_peak(lambda: holder.append(func(*real_args, **real_kwargs)))
            out = holder[0]
    out_bytes = sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
    return max(0, peak - out_bytes)
