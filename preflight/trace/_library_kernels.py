"""Other libraries' operators whose kernels allocate more than their fake implementations return.

A library that defines its own operators with ``torch.library`` (bitsandbytes' ``bitsandbytes::*``) registers a
fake implementation for each, and the fake mode uses it: it returns the output and nothing else. Where the kernel
the device runs is itself a Python composite of other operators, the memory it holds while it runs is those
operators' (bitsandbytes' ``gemm_4bit`` dequantizes the whole 4-bit weight into a temporary of the compute dtype,
then calls ``linear``), and the fake implementation hides it.

`composite_kernel` finds, per operator, what the target runs, from the library's own registrations:

- **CPU target.** An operator outside torch's own namespaces with no kernel for the CPU key and a
  ``CompositeExplicitAutograd`` kernel (``torch.library.register_kernel(op, "default")``) runs that kernel on the
  CPU: the trace runs it too, and sees each operator inside it. A kernel the CPU key has (a C extension called
  through ctypes) allocates what its fake implementation returns and is left to it, except where the library's
  CPU kernel is itself written in torch operators and is found by name in the library's module
  (`_CPU_KERNELS`): bitsandbytes' optimizer updates (``backends/cpu/ops.py``: the 8-bit update dequantizes both
  states into fp32 tensors of the parameter's size, computes in fp32 and quantizes back; the 32-bit update
  holds the gradient and the update in fp32), run as they are, their own (de)quantize operators left to their
  fake implementations. A default composite that reads a value the trace does not have is run as written but for
  that read (`_DEFAULT_MODELS`: ``int8_vectorwise_quant``'s outlier test, what an 8-bit layer in eval mode runs).
- **CUDA target** (traced on CPU fake tensors). The CUDA kernels call C functions that cannot run on fake
  tensors; each modelled operator follows its CUDA kernel's source. bitsandbytes' ``gemm_4bit``
  (``backends/cuda/ops.py``): for ``M = A.numel() // K`` rows at most 4 (``_GEMM_4BIT_CUSTOM_FLOOR_M``) the fused
  ``cgemm_4bit`` kernel allocates the output only; above 1536 rows, or when ``K`` is not a multiple of the
  blocksize, ``_dequant_linear_fallback`` dequantizes the absmax (nested quantization) and the weight into
  temporaries before ``linear``, as the default composite does. Between 5 and 1536 rows the choice is a
  per-architecture heuristic (``_gemm_4bit_use_custom_cuda``) read from the device's properties: the trace assumes
  the fallback, the larger of the two by the dequantized weight, and says so.

bitsandbytes also chooses in Python by the tensors' device: its 8-bit ``matmul`` trains through ``MatMul8bitFp``
(dequantize the int8 weight, then ``linear``) on CPU and through ``MatMul8bitLt`` on CUDA. A CUDA target is traced
on CPU tensors, so `cuda_training_paths` makes ``bitsandbytes.matmul`` take the CUDA branch while the tracker runs
(only on the tracing thread; everywhere else it is bitsandbytes' own function), and ``MatMul8bitLt``'s Python runs
as it does on a GPU: the input cast to fp16, quantized row-wise to int8 (``int8_vectorwise_quant``), the int8
product and its dequantization, the input (and any outlier columns) kept for the backward, which dequantizes the
weight as on CPU. Its CUDA operators follow ``backends/cuda/ops.py`` (bitsandbytes 0.45 to 0.50):

- ``int8_vectorwise_quant``: the int8 copy and fp32 row scales; with a threshold, ``A.abs() >= threshold`` (an
  fp16 temporary, then a bool mask held to the end) and ``outliers.any()``, whose value is the activations': the
  trace takes no outlier column and says so (`_bnb_outlier_note`: what each column would add).
- ``int8_double_quant`` (the backward of a trained 8-bit weight): the row quantization above, then torch code
  (column absmax, masked fill, the column-quantized copy), run as written.
- ``int8_linear_matmul``: the int32 output (cuBLASLt's ``cigemmlt_32`` takes no workspace from the allocator); an
  inner size not a multiple of 4 falls back to an fp32 ``matmul`` of both operands.
- ``int8_mm_dequant``: an fp16 output, the bias added in place when it is not fp16, cast to the compute dtype.
- ``int8_scaled_mm`` and ``int8_mixed_scaled_mm`` have no CUDA kernel: their default composites run.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["PAGED_MIN_NUMEL", "composite_kernel", "cuda_training_paths", "layer_notes", "run_composite"]

_TORCH_NAMESPACES = frozenset({"aten", "prims", "prim", "_c10d_functional", "c10d", "c10d_functional",
                               "_dtensor", "higher_order", "profiler", "inductor", "quantized", "_quantized"})

# bitsandbytes' paged optimizers page state1 and state2 of a parameter of at least this many elements
# (``Optimizer8bit.get_state_buffer``, ``AdEMAMix._get_state_double_buffer``); the rest is ordinary device memory.
PAGED_MIN_NUMEL = 100_000

# bitsandbytes' backends/cuda/ops.py: the fused kernel below this many rows, dequantize + linear above the other.
_BNB_CUSTOM_FLOOR_M = 4
_BNB_CUSTOM_MAX_M = 1536


def composite_kernel(func: Any, cuda: bool) -> tuple[Callable[..., Any], Callable[..., str | None]] | None:
    """What to run for ``func`` in place of its fake implementation, and a function of its arguments that returns
    a note when the choice is an assumption; None to leave ``func`` to the fake mode."""
    namespace = getattr(func, "namespace", None)
    if namespace is None or namespace in _TORCH_NAMESPACES or not isinstance(func, torch._ops.OpOverload):
        return None
    name = func.name()
    if cuda:
        if name in _CUDA_COMPOSITES:  # no CUDA kernel: the default composite runs on the device too
            return run_composite(func), _no_note
        return _CUDA_MODELS.get(name)
    cpu_kernel = _cpu_kernel(name)
    if cpu_kernel is not None:
        return cpu_kernel, _no_note
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    if has(name, "CPU") or not has(name, "CompositeExplicitAutograd"):
        return None
    return _DEFAULT_MODELS.get(name) or (run_composite(func), _no_note)


def run_composite(func: Any) -> Callable[..., Any]:
    """``func``'s own ``CompositeExplicitAutograd`` kernel, whose operators the tracker then sees one by one."""
    def run(*args: Any, **kwargs: Any) -> Any:
        return func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs)

    return run


def _no_note(*args: Any, **kwargs: Any) -> None:
    return None


# operator -> (module, function) of a library's CPU kernel written in torch operators (read in its source)
_CPU_KERNELS = {
    "bitsandbytes::optimizer_update_8bit_blockwise": ("bitsandbytes.backends.cpu.ops",
                                                      "_optimizer_update_8bit_blockwise_cpu"),
    "bitsandbytes::optimizer_update_32bit": ("bitsandbytes.backends.cpu.ops", "_optimizer_update_32bit_cpu"),
}


def _cpu_kernel(name: str) -> Callable[..., Any] | None:
    """The library's own CPU kernel for ``name`` where it is torch code, if the library (already imported) has it."""
    where = _CPU_KERNELS.get(name)
    module = None if where is None else sys.modules.get(where[0])
    return None if module is None else getattr(module, where[1], None)


def _bnb_gemm_4bit_cuda(A: torch.Tensor, B: torch.Tensor, shapeB: Any, absmax: torch.Tensor, blocksize: int,
                        quant_type: str, bias: torch.Tensor | None = None,
                        absmax_8bit: torch.Tensor | None = None, absmax_code: torch.Tensor | None = None,
                        absmax_offset: torch.Tensor | None = None) -> torch.Tensor:
    rows = A.numel() // A.shape[-1]
    if rows <= _BNB_CUSTOM_FLOOR_M and A.shape[-1] % blocksize == 0:
        # cgemm_4bit: A made contiguous, the output allocated, nothing else.
        A = A.contiguous()
        out = torch.empty((*A.shape[:-1], shapeB[0]), dtype=A.dtype, device=A.device)
        return out
    # _dequant_linear_fallback: the nested absmax dequantized and the offset added (both held, as its locals are,
    # until it returns), the weight dequantized, then linear.
    held = []
    if absmax_8bit is not None:
        held.append(torch.empty_like(absmax_8bit, dtype=torch.float32))
        held.append(held[0] + absmax_offset)
    held.append(torch.empty(tuple(shapeB), dtype=A.dtype, device=A.device))
    return torch.nn.functional.linear(A, held[-1], bias)


def _bnb_gemm_4bit_cuda_note(A: torch.Tensor, B: torch.Tensor, shapeB: Any, absmax: torch.Tensor, blocksize: int,
                             *args: Any, **kwargs: Any) -> str | None:
    rows = A.numel() // A.shape[-1]
    if _BNB_CUSTOM_FLOOR_M < rows <= _BNB_CUSTOM_MAX_M and A.shape[-1] % blocksize == 0:
        return (f"bitsandbytes' 4-bit matmul with {rows} rows: on CUDA its fused kernel or dequantize + linear is "
                "chosen per GPU architecture (_gemm_4bit_use_custom_cuda); assumed dequantize + linear, which holds "
                "the dequantized weight for the matmul (an upper bound for that moment)")
    return None


# bitsandbytes' operators that backends/cuda/ops.py gives no CUDA kernel: their default composite runs on CUDA.
_CUDA_COMPOSITES = frozenset({"bitsandbytes::int8_scaled_mm", "bitsandbytes::int8_mixed_scaled_mm"})


def _no_outliers(A: torch.Tensor, threshold: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The outlier test both int8 quantization kernels run first (``outliers = A.abs() >= threshold``, then
    ``outliers.any()``), with no column taken to hold an outlier (the note says so): the mask, which the caller keeps
    to its return as the kernel does, and the empty outlier index; (None, None) without a threshold."""
    if threshold <= 0.0:
        return None, None
    outliers = A.abs() >= threshold
    outliers.any()  # read by the kernel; its value is the activations'
    return outliers, torch.empty(0, device=A.device, dtype=torch.int64)


def _zero_outlier_columns(out_row: torch.Tensor, outlier_cols: torch.Tensor | None) -> None:
    if out_row.numel() // out_row.shape[-1] > 1 and outlier_cols is not None:
        out_row[:, outlier_cols] = 0


def _bnb_int8_vectorwise_quant_cuda(A: torch.Tensor, threshold: float = 0.0) -> tuple[torch.Tensor, ...]:
    row_stats = torch.empty(A.numel() // A.shape[-1], device=A.device, dtype=torch.float32)
    out_row = torch.empty(A.shape, device=A.device, dtype=torch.int8)
    outliers, outlier_cols = _no_outliers(A, threshold)
    # cint8_vector_quant fills out_row and row_stats; then the outlier columns are zeroed across the rows.
    _zero_outlier_columns(out_row, outlier_cols)
    return out_row, row_stats, outlier_cols


def _bnb_outlier_note(A: torch.Tensor, threshold: float = 0.0) -> str | None:
    if threshold <= 0.0:
        return None
    rows = A.numel() // A.shape[-1]
    return (f"assumption: bitsandbytes' LLM.int8 quantization (threshold {threshold:g}) found no outlier column: "
            "which input columns hold |x| >= threshold depends on the activations, which a trace does not have; "
            f"each such column would keep its {rows} input values for the backward and dequantize one weight "
            "column for the product")


def _bnb_int8_double_quant_cuda(A: torch.Tensor, threshold: float = 0.0) -> tuple[torch.Tensor, ...]:
    quant_row, row_stats, outlier_cols = torch.ops.bitsandbytes.int8_vectorwise_quant.default(A, threshold=threshold)
    absA = A.abs().view(-1, A.shape[-1])  # _get_col_absmax
    outlier_mask = None
    if threshold > 0.0:
        outlier_mask = absA >= threshold
        absA.masked_fill_(outlier_mask, 0.0)
    col_stats = absA.amax(dim=0, keepdim=False).float()
    del absA
    if outlier_mask is not None:
        A = A.masked_fill(outlier_mask, 0.0)
    quant_col = torch.round(A.mul(127.0) / col_stats.unsqueeze(0)).to(torch.int8)
    return quant_row, quant_col, row_stats, col_stats.flatten().float(), outlier_cols


def _bnb_int8_linear_matmul_cuda(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    out = torch.empty((*A.shape[:-1], B.shape[0]), device=A.device, dtype=torch.int32)
    if A.shape[-1] % 4 != 0:  # cuBLASLt's int8 product needs an inner size divisible by 4
        out.copy_(torch.matmul(A.float(), B.float().t()).to(torch.int32))
    return out


def _bnb_int8_mm_dequant_cuda(A: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor,
                              dtype: torch.dtype | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(A, dtype=torch.float16)  # cdequant_mm_int32_fp16 writes fp16 (a fp16 bias fused)
    if bias is not None and bias.dtype != torch.float16:
        out.add_(bias)
    return out.to(dtype or torch.float16)


def _bnb_int8_vectorwise_quant_default(A: torch.Tensor, threshold: float = 0.0) -> tuple[torch.Tensor, ...]:
    """backends/default/ops.py, what the CPU runs: as written, but for the outlier read (assumed none)."""
    outliers, outlier_cols = _no_outliers(A, threshold)
    row_stats = torch.max(A.abs(), dim=1).values.float()
    out_row = torch.round(A * (127.0 / row_stats.unsqueeze(-1))).to(torch.int8)
    _zero_outlier_columns(out_row, outlier_cols)
    return out_row, row_stats, outlier_cols


# Library operators whose default (CPU) composite reads a value a trace does not have: run as written but for it.
_DEFAULT_MODELS: dict[str, tuple[Callable[..., Any], Callable[..., str | None]]] = {
    "bitsandbytes::int8_vectorwise_quant": (_bnb_int8_vectorwise_quant_default, _bnb_outlier_note),
}

_CUDA_MODELS: dict[str, tuple[Callable[..., Any], Callable[..., str | None]]] = {
    "bitsandbytes::gemm_4bit": (_bnb_gemm_4bit_cuda, _bnb_gemm_4bit_cuda_note),
    "bitsandbytes::int8_vectorwise_quant": (_bnb_int8_vectorwise_quant_cuda, _bnb_outlier_note),
    "bitsandbytes::int8_double_quant": (_bnb_int8_double_quant_cuda, _no_note),
    "bitsandbytes::int8_linear_matmul": (_bnb_int8_linear_matmul_cuda, _no_note),
    "bitsandbytes::int8_mm_dequant": (_bnb_int8_mm_dequant_cuda, _no_note),
}

# MatMul8bitLt logs this for every product whose input is not fp16; in a CPU-host trace it is preflight's doing.
_CAST_WARNING = "MatMul8bitLt: inputs will be cast from %s to float16 during quantization"
_switched = threading.local()  # ``on``: this thread runs MatMul8bitLt for a trace


class _TraceCastWarnings(logging.Filter):
    """Drop the cast warning of products the switch made on this thread; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (getattr(_switched, "on", False) and record.msg == _CAST_WARNING)


_CAST_FILTER = _TraceCastWarnings()
_paths_lock = threading.Lock()
_active_trackers: list[Any] = []  # trackers of CUDA targets tracing now (on any thread)
_real_matmul: list[Callable[..., Any]] = []  # bitsandbytes' own matmul, kept once seen


@contextlib.contextmanager
def cuda_training_paths(tracker: Any, cuda: bool) -> Iterator[None]:
    """While ``tracker`` traces a CUDA target on the host, bitsandbytes' 8-bit ``matmul`` takes its CUDA training
    path (``MatMul8bitLt``) on the tracing thread, as a GPU runs it; its cast warning, which a plain run on this
    host would not log, is held back. Nothing changes without a CUDA target or when bitsandbytes is not imported.
    The switch is installed once for traces running at the same time (the ranks of a fake world) and removed with
    the last; every other caller gets bitsandbytes' own function."""
    functions = sys.modules.get("bitsandbytes.autograd._functions")
    package = sys.modules.get("bitsandbytes")
    if not cuda or functions is None or package is None or not hasattr(functions, "MatMul8bitLt"):
        yield
        return
    with _paths_lock:
        if not _active_trackers:
            if functions.matmul is not _cuda_matmul:
                _real_matmul[:] = [functions.matmul]
            for module in (functions, package):
                if getattr(module, "matmul", None) is _real_matmul[0]:
                    module.matmul = _cuda_matmul
            logging.getLogger(functions.__name__).addFilter(_CAST_FILTER)
        _active_trackers.append(tracker)
    try:
        yield
    finally:
        with _paths_lock:
            _active_trackers.remove(tracker)
            if not _active_trackers:
                for module in (functions, package):
                    if getattr(module, "matmul", None) is _cuda_matmul:
                        module.matmul = _real_matmul[0]
                logging.getLogger(functions.__name__).removeFilter(_CAST_FILTER)


def _cuda_matmul(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None, state: Any = None,
                 threshold: float = 0.0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """bitsandbytes' ``matmul`` with the branch a CUDA device takes, for a trace of a CUDA target on this thread."""
    functions = sys.modules["bitsandbytes.autograd._functions"]
    real = _real_matmul[0]
    stack = _get_current_dispatch_mode_stack()
    if A.device.type != "cpu" or not any(t in stack for t in list(_active_trackers)):
        return real(A, B, out, state, threshold, bias)
    state = state or functions.MatmulLtState()
    if threshold > 0.0:
        state.threshold = threshold
    before = getattr(_switched, "on", False)
    _switched.on = True
    try:
        return functions.MatMul8bitLt.apply(A, B, out, bias, state)
    finally:
        _switched.on = before


def layer_notes(model: torch.nn.Module, cuda: bool) -> list[str]:
    """Notes on layers whose library picks its training path by the tensors' device, for a CUDA target."""
    if not cuda or not any(type(m).__name__ == "Linear8bitLt" and type(m).__module__.startswith("bitsandbytes")
                           for m in model.modules()):
        return []
    return ["bitsandbytes' 8-bit layers (LLM.int8) traced through bitsandbytes' CUDA training path (MatMul8bitLt: "
            "the input quantized to int8, an int32 product dequantized to fp16, then cast to the compute dtype), "
            "its CUDA operators modelled from bitsandbytes' backends/cuda/ops.py"]
