"""Fake implementations of kernels whose registered meta functions disagree with the real CPU and CUDA kernels.

`StorageTracker` calls these instead of the fake mode's implementation, for the trace only: torch's own
registrations are left as they are for the user's process.

``aten._grouped_mm`` (``torch.nn.functional.grouped_mm``, the mixture-of-experts kernel transformers 5 uses):
torch's meta function (``torch/_meta_registrations.py``, ``_meta_grouped_mm_common``) accepts bf16 only and, on a
build without CUDA, returns a contiguous output. The real kernels (``_grouped_mm_cpu`` and ``_grouped_mm_cuda``,
both validating with ``_grouped_mm_validate_inputs`` and allocating with ``create_grouped_gemm_output_tensor`` in
``aten/src/ATen/native/GroupedMMUtils.h``) accept fp32, bf16 and fp16, require ``out_dtype`` to be ``mat_a``'s
dtype, and pad the output's last dimension to 16 bytes (except on ROCm). The backward (``_grouped_mm`` again,
with transposed operands) goes through the same function.

``aten.mkldnn_rnn_layer`` (an LSTM layer on CPU, ``aten/src/ATen/native/mkldnn/RNN.cpp``): in training it
returns oneDNN's workspace (the gates and states its backward reads, saved for it), sized by oneDNN's primitive
descriptor (``workspace_desc().get_size()``): each part rounded up to a 4,096-byte page, its rows padded. The meta
function returns an empty workspace, so an LSTM's saved workspace (1,011,712 bytes for one layer of 128 units over
32 steps of 4) was missing from the trace, and calibrating the backward on an empty one crashed the process. Its
size is read from the real kernel (`rnn_workspace_bytes`), run once per configuration on zeros outside every mode.

``_c10d_functional.wait_tensor`` returns its input, where its meta function allocates a copy (`wait_tensor`).

`COMPOSITES` are torch kernels that allocate temporaries inside, which their fake implementations (the output
only) hide; the tracker runs them as the operators the kernel calls, each traced.
``aten.binary_cross_entropy_with_logits`` (``BCEWithLogitsLoss``) has no device kernel: its
``CompositeExplicitAutograd`` kernel (``aten/src/ATen/native/Loss.cpp``) runs on every device, and it is run as it
is. It holds ``log_sigmoid(input)`` (on CPU ``log_sigmoid_forward``'s buffer beside it until the call returns; on
CUDA the buffer is empty, which a CUDA target traced on the CPU host cannot tell: the buffer is freed before the
next allocation, so the peak inside the call is the same) and ``1 - target`` at once: an input-sized loss under
bf16-mixed or fp32 was predicted 24% low when only its output was counted. ``aten.multinomial`` (sampling
in generation): ``multinomial_out`` in ``aten/src/ATen/native/Distributions.cpp``, one function for CPU and
CUDA, takes a fast path without replacement or for one sample: the sanity checks' small tensors (``aminmax``,
the validity and zero-sum flags, alive to the end of the block), then ``q = empty_like(self).exponential_(1)``, a
tensor of the probabilities' size, divided into in place, and ``argmax`` (one sample) or ``topk`` into the output
(with a values tensor beside it). Checked against the profiler's allocator events for torch 2.13 on CPU. With
replacement and several samples it calls a device kernel and is left to the fake implementation.
``aten._embedding_bag_backward`` with ``sparse=True`` builds its sparse gradient inside: it is run as its kernel's
operators (`preflight.trace._sparse.embedding_bag_backward`), so that the gradient's ids are known.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._python_dispatch

from preflight.trace._library_kernels import run_composite
from preflight.trace._sparse import embedding_bag_backward

__all__ = ["COMPOSITES", "FAKE_KERNELS", "FakeKernelsMode"]

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_grouped_mm_strides(name: str, mat: torch.Tensor) -> None:
    # check_valid_strides_and_return_transposed: row- or column-major in the last two dims, 16-byte aligned.
    sizes, strides = mat.shape, mat.stride()
    alignment = 16 // mat.element_size()
    if strides[-2] == 1 and strides[-1] >= max(1, sizes[-2]):
        aligned = strides[-1] % alignment == 0
    elif strides[-1] == 1 and strides[-2] >= max(1, sizes[-1]):
        aligned = strides[-2] % alignment == 0
    else:
        raise RuntimeError(f"Invalid strides/sizes, got {list(strides)} for strides and {list(sizes)} for sizes "
                           f"({name})")
    if not aligned:
        raise RuntimeError(f"strides should be multiple of 16 bytes ({name})")


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The output of ``aten._grouped_mm`` as the CPU and CUDA kernels allocate it (shape, dtype, strides), after
    their input checks; called under the fake mode, so it allocates nothing real."""
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if mat.dtype not in _GROUPED_MM_DTYPES:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {mat.dtype}")
        if mat.dim() not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if (not a_2d or not b_2d) and mat_a.size(-1) != mat_b.size(-2):
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    _check_grouped_mm_strides("mat_a", mat_a)
    _check_grouped_mm_strides("mat_b", mat_b)
    if (offs is not None) != (a_2d or b_2d):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None and (offs.dim() != 1 or offs.dtype != torch.int32):
        raise RuntimeError("offs has to be 1D and int32")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    dtype = out_dtype or mat_a.dtype
    if dtype != mat_a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")

    if a_2d and b_2d:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a_2d:
        if offs.size(0) != mat_b.size(0):
            raise RuntimeError("matrix batch sizes have to match")
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:
        if offs.size(0) != mat_a.size(0):
            raise RuntimeError("matrix batch sizes have to match")
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        if mat_a.size(0) != mat_b.size(0):
            raise RuntimeError("batched dimension has to match")
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    if torch.version.hip:
        return torch.empty(size, dtype=dtype, device=mat_a.device)
    # For TMA transfers the output's strides are 1 or multiples of 16 bytes: the last dimension is padded.
    alignment = 16 // dtype.itemsize
    padded = -(-size[-1] // alignment) * alignment
    stride = [padded, 1] if len(size) == 2 else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


# Run oneDNN's RNN layer at the traced length when its tensors take at most this much real memory.
_RNN_EXACT_LIMIT = 256 * 2**20
_RNN_WORKSPACE: dict[tuple, int] = {}  # configuration -> workspace bytes, read from the real kernel


def _real_rnn_workspace(args: tuple, length: int | None = None) -> int:
    """The workspace bytes oneDNN allocates for ``mkldnn_rnn_layer(*args)``, with the input cut to ``length``
    steps (the whole input when None): the real kernel run on zeros of the same shapes, outside every mode."""
    from torch.utils._python_dispatch import _disable_current_modes

    def real(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return torch.zeros(tuple(x.shape), dtype=x.dtype)

    with _disable_current_modes(), torch.enable_grad():  # the kernel allocates a workspace only under grad mode
        real_args = [real(a) for a in args]
        if length is not None:
            real_args[0] = real_args[0][:length].contiguous()
        return torch.ops.aten.mkldnn_rnn_layer.default(*real_args)[3].nbytes


def rnn_workspace_bytes(args: tuple) -> int:
    """oneDNN's workspace for one ``mkldnn_rnn_layer`` call in training, in bytes, read from the real kernel once per
    configuration. The input is time-major (``[steps, batch, features]``; ATen transposes a batch-first input before
    the call). At most `_RNN_EXACT_LIMIT` of real tensors, or at most 128 steps, it runs at the traced length and is
    exact; above both it runs at 64 and 128 steps (shorter lengths extrapolate badly: oneDNN pads and page-rounds
    each part) and extrapolates linearly in the length (measured: within 1% of the real kernel's at 513 to 999 steps
    of odd sizes). So one real layer of at most 128 steps, or of at most that much memory, runs per configuration."""
    key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else
                (tuple(a) if isinstance(a, list) else a) for a in args)
    if key in _RNN_WORKSPACE:
        return _RNN_WORKSPACE[key]
    steps = args[0].shape[0]
    fixed = sum(a.numel() * a.element_size() for a in args[1:] if isinstance(a, torch.Tensor))
    per_step = args[0].numel() // max(steps, 1) * args[0].element_size()
    # The output and the workspace grow with the steps too: bound them by 12 hidden states per step (4 gates, the
    # cell and hidden states, their copies).
    hidden = args[5].numel() * args[5].element_size()

    def real_bytes(length: int) -> int:
        return fixed + length * (per_step + 12 * hidden)

    if real_bytes(steps) <= _RNN_EXACT_LIMIT or steps <= 128:
        size = _real_rnn_workspace(args)
    else:
        at_64, at_128 = _real_rnn_workspace(args, 64), _real_rnn_workspace(args, 128)
        size = at_128 + (at_128 - at_64) * (steps - 128) // 64
    _RNN_WORKSPACE[key] = size
    return size


def mkldnn_rnn_layer(*args: Any) -> Any:
    """``aten.mkldnn_rnn_layer`` with the workspace its real kernel allocates in training (the meta function's
    is empty): the fake implementation's outputs, its workspace replaced by one of `rnn_workspace_bytes`."""
    op = torch.ops.aten.mkldnn_rnn_layer.default
    output, hy, cy, workspace = op(*args)
    train = args[15] if len(args) > 15 else False
    if train and workspace.numel() == 0:
        workspace = torch.empty(rnn_workspace_bytes(args), dtype=torch.uint8, device=workspace.device)
    return output, hy, cy, workspace


FAKE_KERNELS: dict[Any, Callable[..., Any]] = {torch.ops.aten._grouped_mm.default: grouped_mm}
if hasattr(torch.ops.aten, "mkldnn_rnn_layer") and torch.backends.mkldnn.is_available():
    FAKE_KERNELS[torch.ops.aten.mkldnn_rnn_layer.default] = mkldnn_rnn_layer


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``_c10d_functional.wait_tensor`` as its kernel runs it: it waits for the collective that writes ``tensor``
    and returns ``tensor`` itself (``wait_tensor`` in ``torch/csrc/distributed/c10d/Functional.cpp``). Its meta
    function returns ``empty_like(tensor)``, a second block the size of every all-gather's and all-reduce's output
    that the real run never allocates (DTensor's redistributions and FSDP's collectives call it)."""
    return tensor


def _functional_collectives() -> None:
    """Add `wait_tensor` where torch has functional collectives (a build with distributed support, once they are
    loaded: ``torch.distributed`` registers them on import)."""
    try:
        import torch.distributed._functional_collectives  # noqa: F401 - registers the ops
        op = torch.ops._c10d_functional.wait_tensor.default
    except (ImportError, AttributeError, RuntimeError):
        return
    FAKE_KERNELS[op] = wait_tensor


_functional_collectives()


def multinomial(probs: torch.Tensor, num_samples: int, replacement: bool = False, *,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """``aten.multinomial`` as ``multinomial_out`` allocates: its fast path's temporaries around the output, which
    is the operator's own (its fake implementation, and the synthetic index shadow a sampled token gets)."""
    op = torch.ops.aten.multinomial.default
    if replacement and num_samples > 1:
        return op(probs, num_samples, replacement, generator=generator)
    low, high = torch.aminmax(probs)
    valid = (high < float("inf")) & (low >= 0)  # at::_assert_async reads it
    zero = (probs.sum(1) == 0).any() if probs.dim() == 2 else probs.sum() == 0
    _ = ~zero  # the second assertion's operand, freed at once
    del _
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    torch.div(probs, q, out=q)
    out = op(probs, num_samples, replacement, generator=generator)
    values = torch.empty(tuple(out.shape), dtype=probs.dtype, device=probs.device) if num_samples > 1 else None
    del low, high, valid, zero, q, values  # the kernel's locals, freed as it returns
    return out


COMPOSITES: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.multinomial.default: multinomial,
    torch.ops.aten.binary_cross_entropy_with_logits.default:
        run_composite(torch.ops.aten.binary_cross_entropy_with_logits.default),  # no device kernel of its own
    torch.ops.aten._embedding_bag_backward.default: embedding_bag_backward,  # builds a sparse gradient inside
}


class FakeKernelsMode(torch.utils._python_dispatch.TorchDispatchMode):
    """`FAKE_KERNELS` in place of the fake mode's own implementations, for fake-tensor work outside the tracker
    whose shapes must agree with the trace's (a pipeline's stage metadata inference: an MoE stage's fp32
    ``_grouped_mm`` fails in torch's meta function). Enter it inside the fake mode."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return FAKE_KERNELS.get(func, func)(*args, **(kwargs or {}))
