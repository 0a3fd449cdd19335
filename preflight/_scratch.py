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

Two more families on a CPU target, found by comparing the profiler's allocations in real runs with the trace's:

- CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) allocates per-thread
  buffers for its query and key blocks and fp32 accumulators (``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``):
  their size follows the thread count and the block sizes, not only the outputs (AST: 8,556 bytes at the peak,
  -0.68%).
- CPU kernels with temporaries of their own (`CPU_TEMPORARY_OPS`): batch norm's backward in training holds a
  temporary of its input's size (a Conv2d + BatchNorm2d block whose peak is there: -24% before it was calibrated),
  group norm's backward two per (sample, channel) sums; ``kthvalue`` selects on a contiguous copy of its input with
  an int64 index tensor of the input's size beside it (``kthvalue_out_impl_cpu``; an (8, 64, 4096) fp32 input: -69%
  before); ``masked_select``, unless its input is small or the CPU runs one thread, writes the mask and its prefix
  sum as int64 tensors of the broadcast shape (``masked_select_out_impl_cpu``).
- Reductions of bf16 or fp16 inputs (operators tagged ``reduction``): the CPU accumulates them in fp32, and ``mean``
  first casts its whole input to fp32 (``mean_out`` in ``aten/src/ATen/native/ReduceOps.cpp``: "cast_fp32 -> sum ->
  div -> cast_bf16_or_fp16"), a transient twice the input's size (a pooled head under bf16-mixed: -17%).
- The matrix exponential (``linalg_matrix_exp``, `KERNEL_OPS`) keeps powers of its matrix in buffers of its own, on
  every device: a 256 x 256 orthogonal parametrization was predicted 75% low before it was calibrated.
- A kernel given inputs of different dtypes copies each one whose dtype is not the common dtype to a temporary of
  the common dtype first, on the CPU (``TensorIteratorBase::compute_types`` promotes inputs with ``.to()`` there; CUDA
  kernels cast as they load): the backward of a quantization-aware fake-quantizer multiplies the gradient by a bool
  mask the weight's size and holds a float copy of it (QAT: -4% before). Every operator that computes a new tensor
  from inputs of several dtypes (0-dim ones aside) is run once per configuration.
- A kernel given a non-contiguous input often copies it to a contiguous one first (``input.contiguous()`` inside
  the kernel: ``_log_softmax`` on the channels-last logits of a segmentation head copied its whole input,
  SegFormer: -0.78%; a matrix product copies an operand that is neither row- nor column-major). Which kernels do
  is not declared anywhere, so every operator that computes a new tensor from a non-contiguous input is run once
  per configuration; most measure zero and insert nothing.

For each distinct configuration in the trace, the real operator is run once on the target device (at the
traced size when that is small; a convolution larger than that at batch 1 and 2, extrapolated linearly; any other
operator larger than that is listed as not calibrated), and the bytes it held beyond its outputs are inserted
into the event list as a transient allocation at that operator. On the CPU all configurations run in one profiler
session, each in a `torch.profiler.record_function` window of its own.

On a CUDA target, what reductions (``sum``, ``mean``: a staging buffer and its semaphores) and softmax's backward
(a product of its inputs) allocate inside the kernel is not measured but modelled from ATen's source for the target
GPU (`preflight.cuda.kernel_temporaries`), on a CPU host and on a GPU alike: inserted after the operator's outputs
and freed in the reverse order.

Known limitations: random operators (dropout's mask) are never run here (running them would draw from the
user's generator); in-place operators and views are not run (their outputs are not fresh allocations); on a
CUDA target only convolutions are calibrated.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from preflight._device import cuda_peaks, cuda_reset_peaks
from preflight._result import Category, Event
from preflight.trace._layouts import empty_kernel_state
from preflight.trace._sparse import CONSTRUCT as SPARSE_CONSTRUCT
from preflight.cuda import MODELLED_OPS, ReduceDevice, kernel_temporaries, reduce_device

__all__ = ["SCRATCH_OPS", "MATMUL_OPS", "ATTENTION_OPS", "KERNEL_OPS", "scratch_ops", "calibrate", "Calibrator",
           "ScratchResult"]

_aten = torch.ops.aten
# Operator -> positions of its arguments that carry the batch dimension (the rest are weights and options).
SCRATCH_OPS = {_aten.convolution.default: (0,), _aten.convolution_backward.default: (0, 1)}
# Matrix products, calibrated only in a low-precision dtype (or with an operand BLAS cannot take as it is) on a
# CPU target, only at their traced size: which operand carries the batch differs between the forward and the
# backward products.
MATMUL_OPS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})
# CPU flash attention: per-thread block buffers, on a CPU target, at the traced size.
ATTENTION_OPS = frozenset({_aten._scaled_dot_product_flash_attention_for_cpu.default,
                           _aten._scaled_dot_product_flash_attention_for_cpu_backward.default})
# Kernels that allocate their own temporaries on every device, calibrated at their traced size: the matrix
# exponential (scaling and squaring with a Pade approximant, which keeps several powers of the matrix alive;
# torch.nn.utils.parametrizations.orthogonal's default map, whose backward takes the exponential of a matrix
# twice the size). Uncalibrated (a GPU target without a GPU), a peak that includes one is a lower bound.
KERNEL_OPS = frozenset({_aten.linalg_matrix_exp.default})
# CPU kernels that hold temporaries while they run, calibrated on a CPU target: batch norm's backward in training one
# of its input's size (measured: 524,288 bytes beside a 524,288-byte grad_input for an 8 x 16 x 32 x 32 fp32 input),
# group norm's backward two per (sample, channel) sums (1,024 bytes for 8 x 16 channels), kthvalue a copy of its
# input and an int64 index of its size, masked_select two int64 tensors of the broadcast shape.
CPU_TEMPORARY_OPS = frozenset({_aten.native_batch_norm_backward.default,
                               _aten.native_group_norm_backward.default, _aten.kthvalue.default,
                               _aten.masked_select.default})
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Calibrate at the traced size when the operator's tensors take at most this much real memory.
_EXACT_LIMIT = 256 * 2**20
_MARK = "preflight-scratch-"  # the profiler window of one configuration


def scratch_ops(device: torch.device) -> Callable[[Any, Any], bool]:
    """``record_op(func, args)`` for a trace: whether an operator call needs its scratch calibrated on ``device``."""
    def record_op(func: Any, args: Any) -> bool:
        return _needs_calibration(func, args, device)

    return record_op


def _needs_calibration(func: Any, args: Any, device: torch.device) -> bool:
    """True for the operator calls whose kernels may hold memory beyond their outputs (see the module docstring).
    ``args`` holds tensors (during the trace) or `TensorSpec`s (when calibrating)."""
    if func in SCRATCH_OPS or func in KERNEL_OPS:
        return True
    # Sparse tensors' operators are sized by `preflight.trace._sparse`, not run here (a sparse tensor is positional
    # in every operator that takes one, as the tracker reads them).
    if func is SPARSE_CONSTRUCT or any(getattr(a, "layout", None) == torch.sparse_coo for a in args):
        return False
    if device.type != "cpu":
        return device.type == "cuda" and func in MODELLED_OPS
    if func in ATTENTION_OPS or func in CPU_TEMPORARY_OPS:
        return True
    tensors = [a for a in tree_flatten(args)[0] if hasattr(a, "shape") and hasattr(a, "dtype")]
    if torch.Tag.reduction in getattr(func, "tags", ()) and any(t.dtype in _LOW_PRECISION for t in tensors):
        return True  # a bf16/fp16 reduction accumulates in fp32 (``mean`` casts its whole input to fp32 first)
    if func in MATMUL_OPS:
        return any(t.dtype in _LOW_PRECISION or not _blas_layout(t) for t in tensors)
    return _computes_new_tensor(func) and (any(not _is_contiguous(t) for t in tensors) or _mixed_dtypes(tensors))


def _mixed_dtypes(tensors: list[Any]) -> bool:
    """Inputs of more than one dtype, 0-dim ones aside: a CPU TensorIterator kernel first copies each input whose
    dtype is not the common one to a temporary of that dtype (``TensorIteratorBase::compute_types``, CPU only,
    CPU scalars exempt): a float gradient times a bool mask holds a float copy of the mask."""
    return len({t.dtype for t in tensors if len(t.shape) > 0}) > 1


def _computes_new_tensor(func: Any) -> bool:
    """A deterministic operator that returns freshly allocated tensors: not a view, not in-place, not random."""
    schema = getattr(func, "_schema", None)
    if schema is None or schema.is_mutable or not schema.returns:
        return False
    if any(r.alias_info is not None for r in schema.returns):
        return False
    if torch.Tag.nondeterministic_seeded in func.tags:  # would draw from the user's generator
        return False
    return any("Tensor" in str(r.type) for r in schema.returns)


def _shape_stride(t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    stride = t.stride() if callable(t.stride) else t.stride
    return tuple(t.shape), tuple(stride)


def _is_contiguous(t: Any) -> bool:
    """Row-major contiguity from shape and strides (dimensions of size 1 have any stride)."""
    shape, stride = _shape_stride(t)
    if len(shape) < 2 or 0 in shape:
        return True
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _blas_layout(t: Any) -> bool:
    """Whether a matrix operand is row- or column-major in its last two dimensions (BLAS takes it as it is)."""
    shape, stride = _shape_stride(t)
    if len(shape) < 2:
        return True
    rows, cols = shape[-2:]
    row_step, col_step = stride[-2:]
    return (col_step == 1 or cols == 1) and row_step >= max(1, cols) or \
        (row_step == 1 or rows == 1) and col_step >= max(1, rows)


@dataclasses.dataclass
class ScratchResult:
    events: list[Event]
    calibrated: list[str]
    skipped: list[str]
    categories: dict[int, Category] = dataclasses.field(default_factory=dict)  # of the inserted uids


def calibrate(events: list[Event], op_log: list[tuple[int, int, Any, Any, Any]], device: torch.device,
              can_run: bool, gpu: Any = None) -> ScratchResult:
    """Insert each logged operator's measured (or, for CUDA reductions, modelled) scratch into ``events``.

    Args:
        op_log: ``(op_index, event_index, func, args, kwargs)`` with tensors as `TensorSpec`.
        device: the target device.
        can_run: whether real kernels can run on ``device`` here (False: planning for CUDA without a GPU).
        gpu: the target's catalog `preflight._gpus.GPU` (None: unnamed), whose multiprocessors size reductions.
    """
    return Calibrator(device, can_run, gpu)(events, op_log)


class Calibrator:
    """`calibrate` with one measurement per configuration across calls: the shallow traces that
    `preflight.trace.trace_composed` composes get the same bytes for the same kernel, as one full trace would.

    Attributes:
        calibrated, skipped: labels of the configurations measured and not measurable here, over all calls.
    """

    def __init__(self, device: torch.device, can_run: bool, gpu: Any = None) -> None:
        self.device = device
        self.can_run = can_run
        self.reduce: ReduceDevice | None = reduce_device(gpu, device) if device.type == "cuda" else None
        self._measured: dict[Any, int | tuple[int, ...] | None] = {}
        self._labels: dict[str, bool] = {}  # label -> calibrated (True) or skipped (False), in first-seen order
        self._reductions: dict[str, tuple[int, ...]] = {}  # label -> modelled blocks, where there are any

    def reduction_note(self) -> str | None:
        """What the modelled kernel temporaries added, for the coverage notes (None: none held any)."""
        if not self._reductions or self.reduce is None:
            return None
        largest = max(sum(blocks) for blocks in self._reductions.values())
        return (f"temporaries of {len(self._reductions)} CUDA kernel configuration(s) counted as transient "
                f"allocations (reductions' staging buffers, softmax's backward product; largest {largest:,} B), "
                f"modelled from ATen's source for {self.reduce.source}")

    @property
    def calibrated(self) -> list[str]:
        return [label for label, ok in self._labels.items() if ok]

    @property
    def skipped(self) -> list[str]:
        return [label for label, ok in self._labels.items() if not ok]

    def __call__(self, events: list[Event], op_log: list[tuple[int, int, Any, Any, Any]]) -> ScratchResult:
        configs: dict[Any, tuple[Any, Any, Any]] = {}
        for _, _, func, args, kwargs in op_log:
            if _needs_calibration(func, args, self.device):
                configs.setdefault((func, _freeze(args), _freeze(kwargs)), (func, args, kwargs))
        new = [key for key in configs if key not in self._measured]
        for key in [k for k in new if k[0] in MODELLED_OPS and self.reduce is not None]:
            func, args, kwargs = configs[key]
            blocks = kernel_temporaries(func, args, kwargs, self.reduce)
            self._measured[key] = blocks or None
            if blocks:
                self._reductions[self._label_of(configs[key])] = blocks
        new = [key for key in new if key not in self._measured]
        measured = (_measure_all([configs[key] for key in new], self.device) if self.can_run
                    else [None] * len(new))
        for key, extra in zip(new, measured):
            self._measured[key] = extra
            func, label = configs[key][0], self._label_of(configs[key])
            if extra is None:
                self._labels.setdefault(label, False)
            elif extra or func in SCRATCH_OPS or func in MATMUL_OPS or func in ATTENTION_OPS or func in KERNEL_OPS:
                self._labels[label] = True  # the non-contiguous-input family is listed only where it held something
        inserts: list[tuple[int, int, tuple[int, ...]]] = []  # (event_index, op_index, blocks)
        for op_index, event_index, func, args, kwargs in op_log:
            extra = self._measured.get((func, _freeze(args), _freeze(kwargs)))
            if extra:
                inserts.append((event_index, op_index, extra if isinstance(extra, tuple) else (extra,)))
        labels = dict.fromkeys(self._label_of(config) for config in configs.values())
        calibrated = [label for label in labels if self._labels.get(label) is True]
        skipped = [label for label in labels if self._labels.get(label) is False]
        out: list[Event] = []
        uids: list[int] = []
        position = 0
        for event_index, op_index, blocks in inserts:
            out.extend(events[position:event_index])
            position = event_index
            phase = events[event_index - 1].phase if event_index else "setup"
            mine = [-1 - len(uids) - i for i in range(len(blocks))]  # negative uids: never collide with storages
            uids.extend(mine)
            out.extend(Event(uid, nbytes, op_index, phase) for uid, nbytes in zip(mine, blocks))
            out.extend(Event(uid, -nbytes, op_index, phase) for uid, nbytes in reversed(list(zip(mine, blocks))))
        out.extend(events[position:])
        return ScratchResult(out, calibrated, skipped, dict.fromkeys(uids, Category.TEMPORARIES))

    def apply(self, result: Any) -> Any:
        """A `preflight.trace.TraceResult` with its logged operators' scratch inserted (and its log emptied)."""
        if not result.op_log:
            return result
        done = self(result.events, result.op_log)
        return dataclasses.replace(result, events=done.events, categories={**result.categories, **done.categories},
                                   op_log=[])

    @staticmethod
    def _label_of(config: tuple[Any, Any, Any]) -> str:
        func, args, _ = config
        return f"{func.overloadpacket.__name__}{_shape_label(args)}"


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


def _measure_all(configs: list[tuple[Any, Any, Any]], device: torch.device) -> list[int | None]:
    """The scratch bytes of each ``(func, args, kwargs)`` configuration on ``device`` (None: not run)."""
    plans: list[list[tuple[Any, list, Any]] | None] = []  # the real calls each configuration needs
    for func, args, kwargs in configs:
        if empty_kernel_state(func, args, kwargs):
            plans.append(None)  # zeros cannot stand in for a kernel's own state
        elif _spec_bytes(args) * 3 <= _EXACT_LIMIT:
            plans.append([(func, list(args), kwargs)])
        elif func in SCRATCH_OPS and args[SCRATCH_OPS[func][0]].shape[0] > 2:
            plans.append([(func, _with_batch(func, args, b), kwargs) for b in (1, 2)])
        elif func in SCRATCH_OPS:
            plans.append([(func, list(args), kwargs)])
        else:
            plans.append(None)  # too large to run here
    calls = [call for plan in plans if plan is not None for call in plan]
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        results = [_cuda_scratch(func, args, kwargs, device) for func, args, kwargs in calls]
    else:
        results = _cpu_scratch(calls, device)
    out: list[int | None] = []
    position = 0
    for (func, args, _), plan in zip(configs, plans):
        if plan is None:
            out.append(None)
            continue
        measured = results[position:position + len(plan)]
        position += len(plan)
        if any(m is None for m in measured):
            out.append(None)
        elif len(measured) == 1:
            out.append(measured[0])
        else:  # batch 1 and 2, extrapolated to the traced batch
            one, two = measured
            full = args[SCRATCH_OPS[func][0]].shape[0]
            out.append(max(0, two + (two - one) * (full - 2)))
    return out


def _cpu_scratch(calls: list[tuple[Any, list, Any]], device: torch.device) -> list[int | None]:
    """Run each call once in one CPU profiler session; per call, the peak of its allocations beyond its outputs.

    One session for all: starting the profiler costs tens of milliseconds, more than most of these kernels.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    from preflight._quiet import StderrFilter

    if not calls:
        return []
    out_bytes: list[int | None] = [None] * len(calls)
    with StderrFilter(), torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, (func, args, kwargs) in enumerate(calls):
            try:
                real_args = tree_map(lambda x: _materialise(x, device, func), args)
                real_kwargs = tree_map(lambda x: _materialise(x, device), kwargs)
                with record_function(f"{_MARK}{i}"):
                    result = func(*real_args, **real_kwargs)
                out_bytes[i] = sum(t.untyped_storage().nbytes() for t in tree_flatten(result)[0]
                                   if isinstance(t, torch.Tensor))
            except Exception:  # noqa: BLE001 - a configuration that cannot run here is reported as not calibrated
                continue
            finally:
                result = real_args = real_kwargs = None  # freed outside the window
    events = prof.profiler.kineto_results.events()
    windows = {}
    for e in events:
        if e.name().startswith(_MARK):
            windows[int(e.name()[len(_MARK):])] = (e.start_ns(), e.end_ns())
    memory = sorted((e.start_ns(), e.nbytes()) for e in events
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    times = [t for t, _ in memory]
    results: list[int | None] = []
    for i, held in enumerate(out_bytes):
        if held is None or i not in windows:
            results.append(None)
            continue
        start, end = windows[i]
        live = peak = 0
        for _, nbytes in memory[bisect.bisect_left(times, start):bisect.bisect_right(times, end)]:
            live += nbytes
            peak = max(peak, live)
        results.append(max(0, peak - held))
    return results


def _cuda_scratch(func: Any, args: Any, kwargs: Any, device: torch.device) -> int | None:  # pragma: no cover
    try:
        real_args = tree_map(lambda x: _materialise(x, device, func), args)
        real_kwargs = tree_map(lambda x: _materialise(x, device), kwargs)
        with torch.no_grad():
            base = torch.cuda.memory_allocated(device)
            cuda_reset_peaks(device)
            out = func(*real_args, **real_kwargs)
            peak = cuda_peaks(device)[0] - base
    except Exception:  # noqa: BLE001 - a configuration that cannot run here is reported as not calibrated
        return None
    out_bytes = sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
    return max(0, peak - out_bytes)


def _materialise(x: Any, device: torch.device, func: Any = None) -> Any:
    """A zero tensor of the spec's shape, strides and dtype: laid out in memory as the traced one was. For a
    `KERNEL_OPS` operator, a matrix whose 1-norm is 10: the matrix exponential picks its Pade degree from the norm,
    and zeros would take the cheapest path; above every degree's threshold it takes degree 18 with squaring, the
    path that holds the most (ATen's ``mexp_impl``), whatever the run's values. ``masked_select``'s mask is all True:
    with none selected the kernel returns before it makes its temporaries, whose size does not depend on the count.

    The layout matters: oneDNN picks another algorithm, with other scratch, for a channels-last or permuted
    gradient than for a contiguous one (measured: 19 MB against almost none for one depthwise backward), and a
    kernel copies an input it cannot read as it is laid out.
    """
    from preflight.trace import TensorSpec

    if not isinstance(x, TensorSpec):
        return x
    if len(x.stride) != len(x.shape):
        return torch.zeros(x.shape, dtype=x.dtype, device=device)
    real = torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device=device)
    if func in KERNEL_OPS and real.numel() and real.is_floating_point():
        return real.fill_(10.0 / x.shape[-1])
    if func is _aten.masked_select.default and real.dtype is torch.bool:
        return real.fill_(True)  # an all-False mask returns before the kernel's temporaries are made
    return real.zero_() if real.numel() else real
