"""Checks the real kernels make and fake kernels do not: a step that would fail at step one is an error, not a peak.

Fake (meta) kernels compute output shapes and dtypes only. They accept a float64 batch into a float32 ``Linear``,
token ids beyond the embedding table and sequences longer than the position table, all of which make the real
step raise at its first operator. `StorageTracker` runs these checks before each operator they name, on what the
kernel actually receives (after autocast's casts and the autograd decompositions), and raises
`preflight.StepWouldFailError` with the real kernel's message, the operator, the user's line and the tensors
involved.

- Dtype agreement (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``addbmm``, ``mv``, ``addmv``, ``dot``,
  ``convolution``, ``native_layer_norm``, ``index_add``): when the floating operands' dtypes differ, the real CPU kernel is run on tiny stand-ins
  (every dimension 1, the same dtypes); its error, if it raises one, is the step's. The rules are the CPU
  kernels' (a CUDA kernel accepting a combination the CPU one rejects would be reported wrongly; none is known
  for these operators).
- Fill values that do not fit the filled tensor's dtype (``masked_fill``, ``fill``): ``finfo(float32).min``
  into a bf16 tensor under autocast raises "value cannot be converted to type c10::BFloat16 without overflow",
  whatever the mask holds. The value is a Python number, known in the trace; the real kernel is run on
  stand-ins to confirm.
- Index ranges, on the value shadows of the indices (token ids from the batch, positions made with ``arange``):
  ``embedding`` and ``index_select`` (``IndexError: index out of range in self``), ``gather`` and ``index`` (``index
  i is out of bounds for dimension d with size n``), ``nll_loss`` (``Target t is out of bounds.``, ignoring
  ``ignore_index``). Indices without a shadow (computed from parameters) are not checked.
- Packed sequences' lengths (``_pack_padded_sequence``, on their shadow): the real kernel is run on a stand-in of
  the input's first two sizes (`preflight.trace._packed.packed_sizes`); unsorted lengths with ``enforce_sorted``,
  a zero length or a length beyond the padded one raise its error.
- Dtype checks torch makes itself before dispatch (``conv2d``'s "Input type (double) and bias type (float) should
  be the same") raise under fake tensors as in the real run; `kernel_dtype_error` recognises them.

Device agreement is left to the fake mode, which checks it (`device_mismatch`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

from preflight.trace._packed import PACK, packed_sizes

__all__ = ["STEP_CHECKS", "StepContext", "device_mismatch", "kernel_dtype_error", "mixed_dtensor_failure"]

_aten = torch.ops.aten


class StepContext(Protocol):
    """What a check needs from the tracker."""

    def shadow_of(self, t: torch.Tensor) -> torch.Tensor | None: ...

    def fail(self, func: Any, real: BaseException, operands: dict[str, torch.Tensor], fix: str) -> None: ...

    def from_batch(self, t: torch.Tensor) -> bool: ...


def _dtype_check(positions: tuple[int, ...], names: tuple[str, ...]) -> Callable[..., None]:
    def check(ctx: StepContext, func: Any, args: tuple, kwargs: dict) -> None:
        operands = {n: args[i] for n, i in zip(names, positions)
                    if i < len(args) and isinstance(args[i], torch.Tensor)}
        dtypes = {t.dtype for t in operands.values() if t.is_floating_point() or t.is_complex()}
        if len(dtypes) < 2:
            return
        error = _probe(func, args, kwargs)
        if error is not None:
            ctx.fail(func, error, operands, "cast one to the other's dtype (e.g. the batch with "
                     "`.to(model.dtype)`), or run under autocast (precision='bf16-mixed'), which casts both")

    return check


def _probe(func: Any, args: tuple, kwargs: dict) -> BaseException | None:
    """The error the real CPU kernel raises for these dtypes, on stand-ins of size 1 in every dimension."""
    def tiny(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.ones([1] * x.dim(), dtype=x.dtype)
        return x

    with _disable_current_modes():  # real tensors, made and run outside the trace's modes
        real_args = [tiny(a) for a in args]
        if func is _aten.native_layer_norm.default:
            real_args[1] = [1] * len(args[1])
        if func is _aten.convolution.default:
            # Unit stride, no padding, one group: on 1-sized stand-ins only the dtypes can fail.
            n = len(args[3])
            real_args[3:9] = [[1] * n, [0] * n, [1] * n, args[6], [0] * n, 1]
        try:
            func(*real_args, **{k: tiny(v) for k, v in kwargs.items()})
        except (RuntimeError, TypeError) as err:
            return err
    return None


def _fill_value(value_position: int) -> Callable[..., None]:
    def check(ctx: StepContext, func: Any, args: tuple, kwargs: dict) -> None:
        self_ = args[0]
        value = args[value_position] if value_position < len(args) else kwargs.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not self_.is_floating_point():
            return
        if not math.isfinite(value) or abs(value) <= torch.finfo(self_.dtype).max:
            return
        error = _probe(func, args, kwargs)
        if error is not None:
            ctx.fail(func, error, {"self": self_}, f"the value {value:g} is beyond the range of {self_.dtype}: fill "
                     f"with torch.finfo(x.dtype).min / .max of the tensor being filled (here "
                     f"{torch.finfo(self_.dtype).min:g} / {torch.finfo(self_.dtype).max:g}), not of another dtype")

    return check


def _values(ctx: StepContext, index: Any) -> torch.Tensor | None:
    if not isinstance(index, torch.Tensor) or index.dtype in (torch.bool, torch.uint8):
        return None
    real = ctx.shadow_of(index)
    return None if real is None or real.numel() == 0 else real


def _embedding(ctx: StepContext, func: Any, args: tuple, kwargs: dict) -> None:
    weight, indices = args[0], args[1]
    real = _values(ctx, indices)
    if real is None:
        return
    rows = weight.size(0)
    lo, hi = int(real.min()), int(real.max())
    if lo < 0 or hi >= rows:
        bad = hi if hi >= rows else lo
        if ctx.from_batch(indices):  # token ids
            fix = (f"the batch holds id {bad}, and the table has {rows} rows (ids 0 to {rows - 1}): make the "
                   "tokenizer and the model's vocab_size agree (model.resize_token_embeddings(len(tokenizer)))")
        else:  # computed from the batch's shape: positions
            fix = (f"the step computed index {bad}, and the table has {rows} rows: if these are positions, the "
                   f"sequence is longer than the model's position table; truncate sequences to {rows} tokens")
        ctx.fail(func, IndexError("index out of range in self"), {"weight": weight, "indices": indices}, fix)


def _index_select(ctx: StepContext, func: Any, args: tuple, kwargs: dict) -> None:
    self_, dim, index = args[0], args[1], args[2]
    real = _values(ctx, index)
    if real is None:
        return
    size = self_.size(dim) if self_.dim() else 1
    lo, hi = int(real.min()), int(real.max())
    if lo < 0 or hi >= size:
        ctx.fail(func, IndexError("index out of range in self"), {"self": self_, "index": index},
                 f"the indices reach {hi if hi >= size else lo}, and dimension {dim} has size {size}")


def _gather(ctx: StepContext, func: Any, args: tuple, kwargs: dict) -> None:
    self_, dim, index = args[0], args[1], args[2]
    real = _values(ctx, index)
    if real is None:
        return
    dim = dim % max(self_.dim(), 1)
    size = self_.size(dim) if self_.dim() else 1
    lo, hi = int(real.min()), int(real.max())
    if lo < 0 or hi >= size:
        bad = hi if hi >= size else lo
        ctx.fail(func, RuntimeError(f"index {bad} is out of bounds for dimension {dim} with size {size}"),
                 {"self": self_, "index": index}, f"indices along dimension {dim} must be in 0..{size - 1}")


def _index(ctx: StepContext, func: Any, args: tuple, kwargs: dict) -> None:
    self_, indices = args[0], args[1]
    for dim, index in enumerate(indices):
        real = _values(ctx, index)
        if real is None or dim >= self_.dim():
            continue
        size = self_.size(dim)
        lo, hi = int(real.min()), int(real.max())
        if lo < -size or hi >= size:  # negative indices count from the end
            bad = hi if hi >= size else lo
            ctx.fail(func, IndexError(f"index {bad} is out of bounds for dimension {dim} with size {size}"),
                     {"self": self_, "index": index}, f"indices along dimension {dim} must be in -{size}..{size - 1}")


def _nll_loss(ctx: StepContext, func: Any, args: tuple, kwargs: dict) -> None:
    self_, target = args[0], args[1]
    ignore_index = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    real = _values(ctx, target)
    if real is None:
        return
    classes = self_.size(1) if self_.dim() >= 2 else self_.size(0)
    with _disable_current_modes():
        bad = real[(real != ignore_index) & ((real < 0) | (real >= classes))]
        first = int(bad.flatten()[0]) if bad.numel() else None
    if first is not None:
        ctx.fail(func, IndexError(f"Target {first} is out of bounds."), {"input": self_, "target": target},
                 f"targets must be class indices in 0..{classes - 1} or ignore_index ({ignore_index}): labels "
                 "beyond the model's classes or vocabulary")


def _pack_padded_sequence(ctx: StepContext, func: Any, args: tuple, kwargs: dict) -> None:
    input, lengths = args[0], args[1]
    batch_first = args[2] if len(args) > 2 else kwargs["batch_first"]
    real = ctx.shadow_of(lengths) if isinstance(lengths, torch.Tensor) else None
    if real is None:
        return
    try:
        packed_sizes(input, real, batch_first)
    except RuntimeError as err:
        steps = input.size(1 if batch_first else 0)
        ctx.fail(func, err, {"input": input, "lengths": lengths},
                 f"give one length per sequence, each in 1..{steps} (the padded length), in decreasing order, or "
                 "pass enforce_sorted=False to pack_padded_sequence")


STEP_CHECKS: dict[Any, Callable[..., None]] = {
    _aten.mm.default: _dtype_check((0, 1), ("mat1", "mat2")),
    _aten.addmm.default: _dtype_check((0, 1, 2), ("bias", "mat1", "mat2")),
    _aten.bmm.default: _dtype_check((0, 1), ("batch1", "batch2")),
    _aten.baddbmm.default: _dtype_check((0, 1, 2), ("input", "batch1", "batch2")),
    _aten.addbmm.default: _dtype_check((0, 1, 2), ("input", "batch1", "batch2")),
    _aten.mv.default: _dtype_check((0, 1), ("mat", "vec")),
    _aten.addmv.default: _dtype_check((0, 1, 2), ("input", "mat", "vec")),
    _aten.dot.default: _dtype_check((0, 1), ("input", "other")),
    _aten.convolution.default: _dtype_check((0, 1, 2), ("input", "weight", "bias")),
    _aten.native_layer_norm.default: _dtype_check((0, 2, 3), ("input", "weight", "bias")),
    _aten.index_add.default: _dtype_check((0, 3), ("self", "source")),
    _aten.index_add_.default: _dtype_check((0, 3), ("self", "source")),
    _aten.masked_fill.Scalar: _fill_value(2),
    _aten.masked_fill_.Scalar: _fill_value(2),
    _aten.fill.Scalar: _fill_value(1),
    _aten.fill_.Scalar: _fill_value(1),
    _aten.embedding.default: _embedding,
    _aten.index_select.default: _index_select,
    _aten.gather.default: _gather,
    _aten.index.Tensor: _index,
    _aten.nll_loss_forward.default: _nll_loss,
    _aten.nll_loss2d_forward.default: _nll_loss,
    PACK: _pack_padded_sequence,
}


# Dtype checks torch makes before dispatch (in composite operators such as ``conv2d``): under fake tensors they raise
# exactly as in the real run, since the twins have the real dtypes.
_KERNEL_DTYPE_ERRORS = re.compile(r"Input type \(.+\) and (weight|bias) type \(.+\) should be the same"
                                  r"|must have the same dtype|expected scalar type \w+ but found \w+")


def kernel_dtype_error(err: BaseException) -> bool:
    """Whether ``err``, raised while tracing, is torch's own dtype check, which the real step raises too."""
    return type(err) is RuntimeError and _KERNEL_DTYPE_ERRORS.search(str(err)) is not None


def device_mismatch(err: BaseException) -> bool:
    """Whether ``err`` is the fake mode's report of operands on different devices (what the real kernel raises as
    "Expected all tensors to be on the same device")."""
    text = str(err)
    return isinstance(err, RuntimeError) and ("FakeTensor Device Propagation" in text
                                              or "Expected all tensors to be on the same device" in text)


# What a step whose optimizer's own kernels refuse DTensor parameters should do instead (bitsandbytes').
_LIBRARY_OPTIMIZER_FIX = ("Fix: use a torch optimizer (torch.optim.AdamW) for DTensor parameters (FSDP2, tensor or "
                          "expert parallelism), or FSDP1, whose flat parameters are plain tensors. No memory was "
                          "predicted: a step that fails has no peak.")


def _version(package: str) -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001 - only for a message
        return "(version unknown)"


def library_optimizer_over_dtensors(optimizer: Any, engine: str) -> str | None:
    """The message of `preflight.StepWouldFailError` for a bitsandbytes optimizer over the DTensor parameters
    ``engine`` makes (``fully_shard``), where the plan is not traced (paged state, offloading) and the trace would not
    reach the step that fails; else None. Measured on a one-rank gloo mesh: AdamW8bit and PagedAdamW8bit raise
    DTensor's refusal at their first step under ``fully_shard`` and under tensor parallelism."""
    if not type(optimizer).__module__.startswith("bitsandbytes."):
        return None
    return (f"The training step would fail at its first step: {type(optimizer).__name__} under {engine} steps DTensor "
            "parameters with state it keeps as plain tensors, and bitsandbytes' operators have no DTensor rule "
            "(\"got mixed torch.Tensor and DTensor\" in the real job, measured on a CPU gloo mesh with bitsandbytes "
            f"{_version('bitsandbytes')}). {_LIBRARY_OPTIMIZER_FIX}")


def mixed_dtensor_failure(err: BaseException, where: str) -> str | None:
    """The message of `preflight.StepWouldFailError` when ``err`` is DTensor's refusal of an operator whose tensor
    operands mix DTensors and plain tensors of more than one element, else None. DTensor's dispatcher decides it from
    the operands' types and sizes alone (``OpDispatcher._try_replicate_spec_for_scalar_tensor`` in
    ``torch/distributed/tensor/_dispatch.py``), which fake tensors keep: the real step raises it too. It happens
    where a foreach or fused step (an optimizer's, or ``clip_grad_norm_``'s) takes one list holding the parameters
    tensor parallelism laid out and those it left alone (norms); torch picks foreach by default on CUDA. ``where``:
    the operator and line the trace stopped at."""
    text = str(err)
    if not isinstance(err, RuntimeError) or "got mixed torch.Tensor and DTensor" not in text:
        return None
    if "/optimizer)" not in where:  # in the forward or backward: an operand the layout left a plain tensor
        return (f"The training step would fail at its first step: {text.splitlines()[0]} ({where}). DTensor refuses "
                "an operator whose operands mix DTensors and plain tensors of more than one element, in the job as "
                "in the trace: a tensor the parallel layout does not distribute meets one it does. Fix: make that "
                "operand a DTensor (distribute it, or lay out the module that makes it), or keep it out of the laid-"
                "out modules. No memory was predicted: a step that fails has no peak.")
    operator = text.split(" got mixed", 1)[0].strip()
    if operator.split(".", 1)[0] not in ("aten", "prims", "_c10d_functional"):  # a library's own kernel
        return (f"The training step would fail at its first step: {text.splitlines()[0]} ({where}). The "
                f"optimizer's own operator ({operator}) receives the DTensor parameters and gradients with state it "
                "keeps as plain tensors, and has no DTensor rule: the real job fails the same way (bitsandbytes' "
                "8-bit and paged optimizers on a CPU gloo mesh raise it at their first step, under fully_shard as "
                f"under tensor parallelism). {_LIBRARY_OPTIMIZER_FIX}")
    return (f"The training step would fail at its first step: {text.splitlines()[0]} ({where}). A "
            "foreach or fused step takes the parameters of a group in one call, and here some are DTensors (laid out "
            "by tensor parallelism) and some plain tensors (modules the plan leaves alone, such as norms); torch "
            "picks foreach by default on CUDA. Fix: make every parameter a DTensor (lay out the norms with "
            "SequenceParallel, or wrap the model with fully_shard as torchtitan does), or step them one at a time: "
            "foreach=False on the optimizer (`Loop(optimizer_impl=\"for-loop\")`, `--optimizer-impl for-loop`) and "
            "on clip_grad_norm_. No memory was predicted: a step that fails has no peak.")
