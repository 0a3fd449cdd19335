"""The kernels a CUDA device picks where CPU kernels would differ: attention, softmax and dropout.

**Attention.** ``scaled_dot_product_attention`` is a composite that asks ``_fused_sdp_choice`` for a backend and
calls it. On CUDA the choice follows ``select_sdp_backend`` (``aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp``): the first of the priority order (``Context.h``: flash, memory-efficient, math, cuDNN; cuDNN first
when the runtime cuDNN is newer than 9.15 on sm_90 / sm_100, ``check_prefer_cudnn_attention``) whose filters pass:

- flash: sm_80..sm_121, fp16/bf16, no ``attn_mask``, q/k/v head dims equal and <= 256, on sm_86..sm_89 and
  sm_120/121 when training head dim <= 192 (or > 224 without dropout), ``is_causal`` only with equal sequence
  lengths, 4-D inputs with unit last stride, equal batch sizes and head counts (or a GQA multiple);
- memory-efficient: sm_50..sm_121, fp16/fp32 (and bf16 from sm_80), head dims multiples of the GEMM alignment
  (sm_80+: 8 for 16-bit, 4 for fp32; sm_70/75: 8 for fp16, 1 for fp32), storage offsets aligned on sm_80+,
  equal head counts (no grouped-query attention in this torch's kernel);
- cuDNN (only when preferred): sm_80..sm_121, fp16/bf16, head dims multiples of 8 and <= 128, dropout a multiple
  of 1/16, key length > 1, q/k/v in the (B, S, H, D) layout;
- math otherwise.

Each backend's saved tensors differ, and the trace takes them from the kernel's own fake (meta) implementation:
flash saves the output and an fp32 log-sum-exp (B, H, L) plus the philox seed and offset; memory-efficient an fp32
log-sum-exp padded to a multiple of 32 queries, and a float bias made from a boolean mask, padded to 16 keys;
cuDNN an fp32 log-sum-exp (B, H, L, 1); math decomposes into matmul, softmax (in fp32: it upcasts 16-bit inputs)
and dropout, saving the (B, H, L, S) probabilities.

**Memory-efficient attention's backward.** Besides its gradients, the CUDA kernel (``_efficient_attention_backward``
in ``aten/src/ATen/native/transformers/cuda/attention_backward.cu``) allocates and frees inside the call, which its
fake implementation does not: a contiguous copy of the output gradient when its (B, L, H, D) view is not contiguous;
the ``delta`` term, an fp32 (B, H, L) tensor that fp32 kernels compute as ``(grad_out.float() *
out.float()).sum(-1)`` (a full-size fp32 product, its sum and a transposed copy) and 16-bit kernels fill in the
kernel (only the fp32 tensor; on sm_70 only those that hold dK and dV in registers); and an fp32 workspace for the
query gradient's partial tiles (and the key and value gradients' when a 16-bit kernel cannot hold them in
registers), sized by ``Params::workspace_size`` in ``mem_eff_attention/kernel_backward.h`` for the kernel that
``dispatch_cutlassB`` (``kernels/cutlassB.h``, whose lists are read from the headers torch 2.13's wheel installs)
takes first for the head dim, dtype and dropout (`efficient_backward_workspace`). The kernel's shared-memory limit,
which can pass a kernel over on GPUs with less shared memory, is not modelled: the first kernel of the list is
assumed. Where another runs, the workspace differs by the query tiles' padding, and on sm_86 / sm_89 with 16-bit
head dims over 96 by the key and value gradients' fp32 tiles if the 64 x 64 kernel runs instead of the 128 x 128 one
(64 keys x the head dim, per key split, batch and head). Measured on an H200 (torch 2.11): 4,198,400 B for GPT-2's
(8, 8, 256, 64) fp32 attention and 12,595,200 B for a ViT's (32, 6, 197, 64), as computed.

**Softmax of fp16 into fp32.** CUDA autocast asks ``softmax`` and ``log_softmax`` for an fp32 result; for an fp16
CUDA input ATen then runs the kernel with ``half_to_float`` (``SoftMax.cpp``), where a CPU tensor is first copied to
fp32: the CUDA path holds no fp32 copy of the scores, and its backward hands back fp16 gradients. Only fp16: a bf16
input is copied on CUDA too.

**Dropout.** ``torch.dropout`` runs the fused ``native_dropout`` on CUDA tensors (``is_fused_kernel_acceptable``
in ``aten/src/ATen/native/Dropout.cpp``), which keeps a boolean mask (1 byte per element) for the backward; on
CPU it draws a mask of the input's dtype (2 or 4 bytes per element).

`cuda_kernels` registers, for one trace, ``AutogradCPU`` kernels for ``scaled_dot_product_attention``, the
memory-efficient kernel's backward, ``softmax``, ``log_softmax`` and ``dropout`` that do what CUDA would, on the CPU
fake tensors that stand for CUDA ones. `choose_sdpa_backend` is the choice alone, for tests and reports.

Known limitations: the runtime cuDNN version is not known on a CPU host (cuDNN is assumed not preferred unless
``cudnn_version`` says otherwise: its saved tensors have the sizes of flash's); nested tensors are not handled; the
flash and cuDNN kernels' backward scratch is not modelled (on the H200, Llama's bf16 attention backward held one
8,454,400-byte block per layer beside its gradients).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["SDPA_BACKENDS", "SdpaChoices", "choose_sdpa_backend", "cuda_kernels", "device_backward_scratch",
           "efficient_backward_workspace"]

SDPA_BACKENDS = ("flash", "efficient", "math", "cudnn")
_DEFAULT_ORDER = ("flash", "efficient", "math", "cudnn")  # Context.h sdp_priority_order
_CUDNN_ORDER = ("cudnn", "flash", "efficient", "math")  # sdp_utils.cpp priority_order() when cuDNN is preferred


def _is_16bit(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


def _in_range(cc: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= cc <= high


def _common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> str | None:
    """check_tensor_shapes, check_batch_size_and_num_heads_dense, check_nonzero_sequence_lengths_dense."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "inputs are not 4-D"
    if not (q.size(0) == k.size(0) == v.size(0)):
        return "batch sizes differ"
    qh, kh, vh = q.size(1), k.size(1), v.size(1)
    if enable_gqa:
        if kh != vh or qh % kh:
            return "grouped-query head counts do not divide"
    elif not (qh == kh == vh):
        return "head counts differ"
    if 0 in (q.size(2), k.size(2)):
        return "a sequence length is 0"
    return None


def _last_stride_one(ts: tuple[torch.Tensor, ...], ignore_singleton: bool) -> bool:
    return all(t.stride(-1) == 1 or (ignore_singleton and t.size(-1) == 1) for t in ts)


def _gemm_alignment(cc: tuple[int, int], dtype: torch.dtype) -> int:
    """minimum_gemm_alignment in sdp_utils.cpp."""
    half = _is_16bit(dtype)
    tensor_cores = cc[0] >= 8 or (cc[0] >= 7 and half)
    alignment = 4 if cc[0] >= 8 else 1
    if tensor_cores:
        alignment = max(alignment, 128 // (16 if half else 32))
    return alignment


def _why_not_flash(cc: tuple[int, int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                   dropout_p: float, is_causal: bool, enable_gqa: bool, training: bool) -> str | None:
    if not torch.backends.cuda.flash_sdp_enabled():
        return "disabled at runtime"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "inputs are not 4-D"
    if mask is not None:
        return "an attn_mask is given"
    d = q.size(-1)
    if not (d == k.size(-1) == v.size(-1) and d <= 256):
        return f"head dims {q.size(-1)}/{k.size(-1)}/{v.size(-1)} are not equal and <= 256"
    if not _in_range(cc, (8, 0), (12, 1)):
        return f"sm_{cc[0]}{cc[1]} is outside [sm_80, sm_121]"
    if training and (_in_range(cc, (8, 6), (8, 9)) or _in_range(cc, (12, 0), (12, 1))):
        if not (d <= 192 or (dropout_p == 0 and d > 224)):
            return f"training with head dim {d} is not supported on sm_{cc[0]}{cc[1]}"
    if is_causal and q.size(-2) != k.size(-2):
        return "is_causal with different query and key lengths"
    if not _is_16bit(q.dtype):
        return f"dtype {q.dtype} is not float16/bfloat16"
    reason = _common(q, k, v, enable_gqa)
    if reason:
        return reason
    if not _last_stride_one((q, k, v), ignore_singleton=True):
        return "last dimension is not contiguous"
    return None


def _why_not_efficient(cc: tuple[int, int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       enable_gqa: bool) -> str | None:
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return "disabled at runtime"
    if not _in_range(cc, (5, 0), (12, 1)):
        return f"sm_{cc[0]}{cc[1]} is outside [sm_50, sm_121]"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "inputs are not 4-D"
    align = _gemm_alignment(cc, q.dtype)
    dq, dk, dv = q.size(-1), k.size(-1), v.size(-1)
    if not (dq == dk and dq % align == 0 and dv % align == 0 and dq > 0 and dv > 0):
        return f"head dims {dq}/{dk}/{dv} are not multiples of {align}"
    if cc[0] >= 8:
        align_bytes = align * q.element_size()
        if any(t.numel() and (t.storage_offset() * t.element_size()) % align_bytes for t in (q, k, v)):
            return f"storage offsets are not aligned to {align_bytes} bytes"
    # Same head counts: the installed torch's memory-efficient kernel has no grouped-query support (its backward's
    # fake implementation returns key/value gradients with the query's heads); newer sources list GQA for it.
    reason = _common(q, k, v, False)
    if reason:
        return reason
    if not _last_stride_one((q, k, v), ignore_singleton=False):
        return "last dimension is not contiguous"
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if cc[0] >= 8 else (torch.float16, torch.float32)
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} is not one of {dtypes} on sm_{cc[0]}{cc[1]}"
    return None


def _why_not_cudnn(cc: tuple[int, int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                   dropout_p: float, enable_gqa: bool) -> str | None:
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "disabled at runtime"
    if not _in_range(cc, (8, 0), (12, 1)):
        return f"sm_{cc[0]}{cc[1]} is outside [sm_80, sm_121]"
    if not _is_16bit(q.dtype):
        return f"dtype {q.dtype} is not float16/bfloat16"
    if dropout_p * 16 != math.floor(dropout_p * 16):
        return "dropout is not a multiple of 1/16"
    reason = _common(q, k, v, True)
    if reason:
        return reason
    dq, dv = q.size(-1), v.size(-1)
    if dq > 128 or dv > 128 or dq % 8 or dv % 8:
        return f"head dims {dq}/{dv} are not multiples of 8 up to 128"
    if k.size(2) == 1:
        return "key length 1"
    for t in (q, k, v):
        h, s, d = t.size(1), t.size(2), t.size(3)
        if t.stride() != (s * h * d, d, h * d, 1):
            return "q/k/v are not in the (batch, seq, heads, dim) layout"
    return None


@dataclasses.dataclass(frozen=True)
class SdpaChoices:
    """What `choose_sdpa_backend` decided: the backend and why each earlier one in the order was passed over."""

    backend: str
    passed_over: tuple[tuple[str, str], ...]


def choose_sdpa_backend(compute_capability: tuple[int, int], query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                        is_causal: bool = False, enable_gqa: bool = False, *,
                        cudnn_version: int | None = None) -> SdpaChoices:
    """The backend CUDA's ``select_sdp_backend`` picks for this call on a GPU of ``compute_capability``.

    Only shapes, dtypes, strides, ``requires_grad`` and the grad mode are read, so fake tensors do.

    Args:
        cudnn_version: the runtime cuDNN version as ``torch.backends.cudnn.version()`` gives it (e.g. 91501);
            None when unknown (then cuDNN attention is not preferred).

    Returns:
        `SdpaChoices` with the backend (one of `SDPA_BACKENDS`).

    Example:
        >>> q = torch.empty(1, 8, 128, 64, dtype=torch.float16)
        >>> choose_sdpa_backend((7, 0), q, q, q).backend
        'efficient'
    """
    cc = tuple(compute_capability)
    prefer_cudnn = (cudnn_version is not None and cudnn_version > 91500 and cc[0] in (9, 10)
                    and cc[1] in (0, 3))
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    passed: list[tuple[str, str]] = []
    for backend in _CUDNN_ORDER if prefer_cudnn else _DEFAULT_ORDER:
        if backend == "flash":
            reason = _why_not_flash(cc, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, training)
        elif backend == "efficient":
            reason = _why_not_efficient(cc, query, key, value, enable_gqa)
        elif backend == "cudnn":
            reason = _why_not_cudnn(cc, query, key, value, attn_mask, dropout_p, enable_gqa)
        else:
            reason = None if torch.backends.cuda.math_sdp_enabled() else "disabled at runtime"
        if reason is None:
            return SdpaChoices(backend, tuple(passed))
        passed.append((backend, reason))
    raise RuntimeError(f"No available kernel for scaled_dot_product_attention on sm_{cc[0]}{cc[1]}: "
                       + "; ".join(f"{b}: {r}" for b, r in passed))


def _bool_mask_to_float(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """convert_boolean_attn_mask (attention.cpp): True keeps, False becomes -inf, in the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), -math.inf, torch.zeros((), dtype=dtype, device=mask.device))


def _pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.size(-1) % multiple
    return torch.nn.functional.pad(t, (0, extra)) if extra else t


def _efficient_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """preprocess_mask (attention.cpp): expand to (B, H, L, S), pad the keys to 16 (pad_bias), else make the
    strides 16-aligned."""
    bias = mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))
    if bias.size(-1) % 16:
        pad = 16 - bias.size(-1) % 16
        return torch.nn.functional.pad(bias, (0, pad))[..., :bias.size(-1)]
    if any(s % 16 for s in bias.stride()[:3]):
        return bias.contiguous()
    return bias


class _Sdpa:
    """The ``scaled_dot_product_attention`` composite as it runs on a CUDA device of ``compute_capability``."""

    def __init__(self, compute_capability: tuple[int, int], cudnn_version: int | None) -> None:
        self.cc = compute_capability
        self.cudnn_version = cudnn_version
        self.calls: dict[str, int] = {}

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False, *,
                 scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        choice = choose_sdpa_backend(self.cc, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa,
                                     cudnn_version=self.cudnn_version)
        backend = choice.backend
        self.calls[backend] = self.calls.get(backend, 0) + 1
        if backend == "math" and _sequence_sharded(query):
            raise _ring_refuses_math(self.cc, query, choice)
        aten = torch.ops.aten
        if scale is None:
            scale = 1.0 / math.sqrt(query.size(-1))
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if backend == "flash":
            d = query.size(-1)
            q, k, v = (_pad_last(t, 8) for t in (query, key, value))  # pad_last_dim<8> before the kernel
            out = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
            return out[..., :d] if out.size(-1) != d else out
        if backend == "cudnn":
            mask = _bool_mask_to_float(attn_mask, query.dtype)
            return aten._scaled_dot_product_cudnn_attention(query, key, value, mask, grad, dropout_p, is_causal,
                                                            False, scale=scale)[0]
        mask = _bool_mask_to_float(attn_mask, query.dtype)
        if backend == "efficient":
            if mask is not None:
                mask = _efficient_bias(mask, query, key)
            return aten._scaled_dot_product_efficient_attention(query, key, value, mask, grad, dropout_p,
                                                                is_causal, scale=scale)[0]
        return aten._scaled_dot_product_attention_math(query, key, value, mask, dropout_p, is_causal, None,
                                                       scale=scale, enable_gqa=enable_gqa)[0]


def _sequence_sharded(query: torch.Tensor) -> bool:
    """Whether ``query`` is a DTensor, as context parallelism's ring hands attention its sequence-sharded inputs."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build of torch without distributed support
        return False
    return isinstance(query, DTensor)


def _ring_refuses_math(cc: tuple[int, int], query: torch.Tensor, choice: SdpaChoices) -> Exception:
    """The error of attention under context parallelism when the target GPU's choice is the math kernel: torch's ring
    handles the flash, memory-efficient and cuDNN kernels only, and the math kernel's causal mask (a plain tensor)
    meets the DTensor scores, which DTensor refuses in the real job as in the trace."""
    from preflight._errors import StepWouldFailError

    why = "; ".join(f"{backend}: {reason}" for backend, reason in choice.passed_over)
    return StepWouldFailError(
        f"The training step would fail at its first step: under context parallelism, scaled_dot_product_attention "
        f"on sm_{cc[0]}{cc[1]} with {str(query.dtype).replace('torch.', '')} inputs of shape {tuple(query.shape)} "
        f"falls back to the math kernel ({why}), which torch's ring does not handle (it handles the flash, "
        "memory-efficient and cuDNN kernels). Fix: inputs the GPU's fused kernels take (bf16 or fp16 on a GPU with "
        "flash attention, fp16 or fp32 for memory-efficient attention on older GPUs), or no context parallelism. No "
        "memory was predicted: a step that fails has no peak.")


def _softmax_factory(fused: Any) -> Any:
    """``softmax.int`` / ``log_softmax.int`` as ATen runs them for a CUDA tensor (``SoftMax.cpp``): an fp16 input asked
    for an fp32 result (what CUDA autocast asks) goes to the kernel with ``half_to_float``, without the fp32 copy of
    the input the CPU path makes; its backward returns the fp16 gradient directly."""

    def softmax(input: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        if input.dtype == torch.float16 and dtype == torch.float32:
            return fused(input, dim, True)
        return fused(input.to(dtype) if dtype is not None else input, dim, False)

    return softmax


def _cuda_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``at::dropout`` for a CUDA tensor (Dropout.cpp): the fused kernel, else ``_dropout<false>``."""
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, train)[0]
    if p == 0 or not train or input.numel() == 0:
        return input
    return input * torch.zeros((), dtype=input.dtype, device=input.device)  # p == 1


# The memory-efficient backward kernels of ``dispatch_cutlassB`` (kernels/cutlassB.h of torch 2.13, read from the
# headers its wheel installs) as (block size I, block size J, largest head dim), in dispatch order: the first whose
# head dim fits runs. The "seqaligned" and unaligned variants have the same blocks and are left out.
_FP32 = ((64, 64, 32), (64, 64, 64), (64, 64, 128), (64, 64, 65536))  # sm50, sm70, sm75
_FP32_SM80 = ((64, 64, 32), (64, 64, 64), (128, 64, 128), (64, 64, 128), (128, 64, 65536), (64, 64, 65536))
_16BIT_SM70 = _FP32_SM80  # the fp16 lists of sm70 and sm75 (sm50's is _FP32)
_16BIT_SM80 = ((64, 64, 32), (64, 64, 64), (128, 128, 128), (64, 64, 128), (128, 64, 65536), (64, 64, 65536))
_16BIT_K96 = (128, 64, 96)  # before the 128x128 kernel on sm_86 and sm_89, without dropout only


@dataclasses.dataclass(frozen=True)
class _EfficientKernel:
    """The template parameters of the backward kernel that runs, and what they decide (kernel_backward.h)."""

    arch: int  # ArchTag::kMinComputeCapability: 50, 70, 75 or 80
    half: bool  # kIsHalf
    block_i: int
    block_j: int
    max_k: int

    @property
    def output_in_registers(self) -> bool:  # kOutputInRF: dK and dV stay in registers
        return self.half and self.max_k <= self.block_i

    @property
    def computes_delta(self) -> bool:  # kKernelComputesDelta
        return self.half and (self.output_in_registers or self.arch != 70)


def _efficient_kernel(cc: tuple[int, int], dtype: torch.dtype, head_dim: int, dropout: bool) -> _EfficientKernel:
    """The backward kernel ``dispatch_cutlassB`` launches on sm_``cc`` for ``dtype`` and the larger head dim."""
    half = dtype in (torch.float16, torch.bfloat16)
    sm = cc[0] * 10 + cc[1]
    arch = 80 if sm >= 80 else 75 if sm >= 75 else 70 if sm >= 70 else 50
    if arch == 80:
        kernels = _16BIT_SM80 if half else _FP32_SM80
        if half and not dropout and sm in (86, 89):
            kernels = kernels[:2] + (_16BIT_K96,) + kernels[2:]
    else:
        kernels = _16BIT_SM70 if half and arch >= 70 else _FP32
    block_i, block_j, max_k = next(k for k in kernels if k[2] >= head_dim)
    return _EfficientKernel(arch, half, block_i, block_j, max_k)


def efficient_backward_workspace(compute_capability: tuple[int, int], dtype: torch.dtype, batch: int, heads: int,
                                 queries: int, keys: int, head_dim: int, value_dim: int, *, dropout: bool = False,
                                 deterministic: bool = False) -> int:
    """Bytes of the fp32 workspace the memory-efficient attention backward allocates on a GPU of
    ``compute_capability`` (``Params::workspace_size`` in kernel_backward.h, with the key-split heuristic of
    ``_efficient_attention_backward``), for the kernel ``dispatch_cutlassB`` picks first (module docstring).

    Example:
        >>> efficient_backward_workspace((9, 0), torch.float32, 8, 8, 256, 256, 64, 64)  # measured on an H200
        4198400
    """
    k = _efficient_kernel(tuple(compute_capability), dtype, max(head_dim, value_dim), dropout)
    split_keys = k.arch >= 70  # kEnableSplitKeys
    accum_q = split_keys or k.half  # kNeedsAccumGradQ (the accumulator is fp32)
    accum_kv = k.half and not k.output_in_registers  # kNeedsAccumGradK / V
    splits = -(-keys // k.block_j)
    if heads * batch >= 256 and keys <= 2 * k.block_j:  # enough parallelism without splitting short keys
        splits = 1
    if accum_kv:
        splits = min(splits, 200 // (batch * heads))
    if not split_keys or splits < 1 or deterministic:
        splits = 1

    def align(n: int, to: int) -> int:
        return -(-n // to) * to

    gk = splits * k.block_j * align(head_dim, k.block_i) if accum_kv else 0
    gv = splits * k.block_j * align(value_dim, k.block_i) if accum_kv else 0
    # GradQTempStorage: lock, counter and 2 pad ints, then a block_i x block_j fp32 tile, per query block and column.
    gq = -(-queries // k.block_i) * -(-head_dim // k.block_j) * (4 + k.block_i * k.block_j) if accum_q else 0
    return batch * heads * align(gk + gv + gq, 4) * 4


def _efficient_backward_factory(cc: tuple[int, int]) -> Any:
    """The ``AutogradCPU`` kernel of ``_scaled_dot_product_efficient_attention_backward`` for a CUDA target: the
    gradients from the fake kernel, with the scratch the CUDA kernel allocates and frees around them (module
    docstring), in its order: the output gradient's contiguous copy, the gradients, delta, the workspace."""
    aten = torch.ops.aten

    def backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_bias: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor, philox_seed: torch.Tensor,
                 philox_offset: torch.Tensor, dropout_p: float, grad_input_mask: list[bool], is_causal: bool = False,
                 *, scale: float | None = None) -> tuple[torch.Tensor, ...]:
        with torch._C._AutoDispatchBelowAutograd():
            # The CUDA wrapper hands the kernel (B, L, H, D) views; it copies the gradient if that is not contiguous.
            grad_copy = grad_out.transpose(1, 2).contiguous()
            grads = aten._scaled_dot_product_efficient_attention_backward(
                grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
                grad_input_mask, is_causal, scale=scale)
            if grad_out.numel() and query.numel():
                batch, heads, queries, head_dim = query.shape
                kernel = _efficient_kernel(cc, query.dtype, max(head_dim, value.size(-1)), dropout_p != 0)
                if kernel.computes_delta:  # the kernel fills it: only the tensor
                    delta = torch.empty((batch, heads, queries), dtype=torch.float32, device=query.device)
                else:
                    delta = (grad_copy.float() * out.transpose(1, 2).float()).sum(-1).transpose(-2, -1).contiguous()
                nbytes = efficient_backward_workspace(
                    cc, query.dtype, batch, heads, queries, key.size(2), head_dim, value.size(-1),
                    dropout=dropout_p != 0, deterministic=torch.are_deterministic_algorithms_enabled())
                held = [delta, torch.empty((nbytes,), dtype=torch.uint8, device=query.device) if nbytes else None]
                del delta
                while held:  # delta (a local of the launching lambda) is freed first, then the workspace
                    held.pop(0)
            del grad_copy
        return grads

    return backward


@contextlib.contextmanager
def device_backward_scratch(device: torch.device) -> Iterator[None]:
    """While the block runs, fake tensors on the CUDA ``device`` itself (a trace on the GPU) allocate the scratch
    of the memory-efficient attention's backward that its fake kernel does not (module docstring); every other
    choice is the device's own there."""
    cc = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else (8, 0)
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("_scaled_dot_product_efficient_attention_backward", _efficient_backward_factory(tuple(cc)),
                 "AutogradCUDA")
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def cuda_kernels(compute_capability: tuple[int, int], *, cudnn_version: int | None = None) -> Iterator[_Sdpa]:
    """While the block runs, CPU tensors take CUDA's attention backend (for ``compute_capability``) and CUDA's
    fused dropout (module docstring). Yields the attention stand-in, whose ``calls`` counts backends used."""
    sdpa = _Sdpa(tuple(compute_capability), cudnn_version)
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("scaled_dot_product_attention", sdpa, "AutogradCPU")
        lib.impl("_scaled_dot_product_efficient_attention_backward", _efficient_backward_factory(sdpa.cc),
                 "AutogradCPU")
        lib.impl("dropout", _cuda_dropout, "AutogradCPU")
        lib.impl("softmax.int", _softmax_factory(torch.ops.aten._softmax), "AutogradCPU")
        lib.impl("log_softmax.int", _softmax_factory(torch.ops.aten._log_softmax), "AutogradCPU")
        yield sdpa
    finally:
        lib._destroy()
