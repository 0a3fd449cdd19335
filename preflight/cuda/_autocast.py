"""CUDA's autocast, applied to the CPU fake tensors a CUDA target is traced with.

torch's autocast is a set of kernels registered for a dispatch key per device (``Autocast`` for CUDA,
``AutocastCPU``), above autograd, so the casts are recorded by autograd and the backward saves the cast tensors
(``aten/src/ATen/autocast_mode.cpp``). The CPU and CUDA kernels follow different op lists: on CUDA, softmax,
log_softmax, layer_norm, the losses, ``pow``, ``exp``, ``sum`` and ``cumsum`` run in fp32; on CPU most of them stay
in the low-precision dtype. A CUDA target is traced on CPU fake tensors (autograd on fake CUDA tensors needs a
GPU), which only ever reach the ``AutocastCPU`` key, so `cuda_autocast` registers, for the duration of a trace,
Python kernels for ``AutocastCPU`` that apply CUDA's lists and policies to those tensors:

- ``lower_precision_fp`` (matmuls, convolutions, linear, SDPA): eligible inputs cast to the autocast dtype, with
  the weight cast cache: a floating leaf that requires grad (a parameter) is cast once per autocast region and
  the copy is held until the outermost autocast exits, as ``cached_cast`` does;
- ``fp32``: eligible inputs cast to float32;
- ``fp32_set_opt_dtype`` (softmax, log_softmax, sum, cumsum, prod, vector/matrix norms): ``dtype=float32`` unless
  given, when the first input is eligible;
- ``fp32_append_dtype`` (``norm.Scalar``, ``norm.ScalarOpt_dim``): redispatched to the dtype overload;
- ``promote``: inputs cast to the widest floating type among them;
- ``binary_cross_entropy`` raises, as on CUDA;
- ops only CPU autocast lists (``cat``, ``stack``, ``cross_entropy_loss``, the pools and pads, ...) run
  untouched, as on CUDA.

Eligible means floating point and not float64, on the trace device. The lists are those of the installed torch's
``AT_FORALL_*`` macros (``ATen/autocast_mode.h``); `CUDA_POLICIES` is checked against the operators the installed
torch registers for ``AutocastCUDA`` (``tests/cuda/test_autocast.py``).

While it is active, ``torch.autocast("cuda", ...)`` (and ``torch.cuda.amp.autocast``) in the user's code enables
this emulation instead of being disabled for want of a GPU, an autocast of either device keeps
``torch.is_autocast_enabled("cuda")`` and ``torch.get_autocast_dtype("cuda")`` in step (code such as PEFT's
``torch.is_autocast_enabled()`` asks about CUDA), and an autocast without a dtype uses CUDA's default (float16).

Known limitations: the kernels and the patched ``torch.autocast`` are process-wide while a trace runs (the trace is
single-threaded; CPU autocast elsewhere in the process would see CUDA's lists meanwhile); ``custom_fwd(
device_type="cuda", cast_inputs=...)`` does not cast CPU tensors.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.amp.autocast_mode import autocast as _Autocast

__all__ = ["CUDA_POLICIES", "cuda_autocast"]

_LOWER = "lower_precision_fp"
_FP32 = "fp32"
_SET_OPT_DTYPE = "fp32_set_opt_dtype"
_APPEND_DTYPE = "fp32_append_dtype"
_PROMOTE = "promote"
_BANNED = "banned"

# ATen/autocast_mode.h (torch 2.13): AT_FORALL_LOWER_PRECISION_FP plus cudnn_convolution(_transpose), AT_FORALL_FP32,
# AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE, AT_FORALL_PROMOTE; autocast_mode.cpp
# registers them for the CUDA autocast key, and bans binary_cross_entropy there. Names are "op.overload".
_LISTS = {
    _LOWER: (
        "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
        "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
        "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
        "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
        "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
        "cudnn_convolution", "cudnn_convolution_transpose",
    ),
    _FP32: (
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
        "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
        "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    ),
    _SET_OPT_DTYPE: (
        "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
        "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
    ),
    _APPEND_DTYPE: ("norm.Scalar", "norm.ScalarOpt_dim"),
    _PROMOTE: (
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
        "scatter_add",
    ),
    _BANNED: ("binary_cross_entropy",),
}
CUDA_POLICIES: dict[str, str] = {name: policy for policy, names in _LISTS.items() for name in names}

# The dtype overload each fp32_append_dtype op redispatches to (AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE).
_APPEND_TARGET = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}

_KEY = "AutocastCPU"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _overload(name: str) -> Any:
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


class _CastCache:
    """The weight cast cache of ``cached_cast``: fp32 leaves that require grad, cast to the low-precision dtype
    once per autocast region (keyed by identity, with a weak reference guarding against reused ids)."""

    def __init__(self) -> None:
        self._casts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def cast(self, t: torch.Tensor, dtype: torch.dtype, lower: torch.dtype) -> torch.Tensor:
        cacheable = (dtype == lower and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                     and not t._is_view() and torch.is_autocast_cache_enabled())
        if not cacheable:
            return t.to(dtype)
        hit = self._casts.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        casted = t.to(dtype)
        self._casts[id(t)] = (weakref.ref(t), casted)
        return casted

    def clear(self) -> None:
        self._casts.clear()

    def __len__(self) -> int:
        return len(self._casts)


def _eligible(x: Any) -> bool:
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
            and x.device.type == "cpu")


def _map(fn: Any, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(fn(v) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _promote_type(args: tuple, kwargs: dict, lower: torch.dtype) -> torch.dtype:
    """``promote_type`` / ``prioritize`` of autocast_mode.h."""
    current = lower
    for t in _tensors(args, kwargs):
        if not _eligible(t):
            continue
        if current == torch.float32 or t.dtype == torch.float32:
            current = torch.float32
        elif current == lower and t.dtype == lower:
            current = lower
        else:
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _make_kernel(name: str, policy: str, cache: _CastCache) -> Any:
    op = _overload(name)
    schema_args = [a.name for a in op._schema.arguments]
    dtype_index = schema_args.index("dtype") if "dtype" in schema_args else None

    def cast_all(args: tuple, kwargs: dict, dtype: torch.dtype, lower: torch.dtype) -> tuple[tuple, dict]:
        def one(t: torch.Tensor) -> torch.Tensor:
            return cache.cast(t, dtype, lower) if _eligible(t) and t.dtype != dtype else t
        return tuple(_map(one, a) for a in args), {k: _map(one, v) for k, v in kwargs.items()}

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            lower = torch.get_autocast_dtype("cpu")
            if policy == _LOWER:
                args, kwargs = cast_all(args, kwargs, lower, lower)
            elif policy == _FP32:
                args, kwargs = cast_all(args, kwargs, torch.float32, lower)
            elif policy == _PROMOTE:
                args, kwargs = cast_all(args, kwargs, _promote_type(args, kwargs, lower), lower)
            elif policy == _SET_OPT_DTYPE:
                first = next(_tensors(args, kwargs), None)
                if _eligible(first):
                    if dtype_index is not None and len(args) > dtype_index:
                        if args[dtype_index] is None:
                            args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1:])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
            elif policy == _APPEND_DTYPE:
                first = args[0]
                out_type = torch.float32 if _eligible(first) else first.dtype
                return _overload(_APPEND_TARGET[name])(*args, **kwargs, dtype=out_type)
            elif policy == _BANNED:
                raise RuntimeError(
                    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast (CUDA "
                    "autocast raises this). Use torch.nn.functional.binary_cross_entropy_with_logits or "
                    "torch.nn.BCEWithLogitsLoss.")
            return op(*args, **kwargs)

    return kernel


def _cpu_only_ops() -> list[str]:
    """Ops the installed torch autocasts on CPU but not on CUDA: they must run untouched."""
    names = []
    for full in torch._C._dispatch_get_registrations_for_dispatch_key(_KEY):
        name = full.removeprefix("aten::")
        if full.startswith("aten::") and name not in CUDA_POLICIES:
            names.append(name)
    return names


@contextlib.contextmanager
def cuda_autocast() -> Iterator[_CastCache]:
    """Apply CUDA's autocast rules to CPU tensors while the block runs (module docstring). Yields the weight cast
    cache (for tests)."""
    cache = _CastCache()
    depth = [0]
    lib = torch.library.Library("aten", "IMPL")
    saved = {attr: getattr(_Autocast, attr) for attr in ("__init__", "__enter__", "__exit__")}
    prev_cpu_dtype = torch.get_autocast_dtype("cpu")

    def init(self: Any, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
             cache_enabled: bool | None = None) -> None:
        if device_type == "cuda":  # the run's tensors are CUDA tensors: CUDA's default dtype, our kernels
            device_type, dtype = "cpu", dtype if dtype is not None else torch.get_autocast_dtype("cuda")
        saved["__init__"](self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    def enter(self: Any) -> Any:
        out = saved["__enter__"](self)
        if self.device == "cpu":
            self._preflight_cuda = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
            torch.set_autocast_enabled("cuda", self._enabled)
            torch.set_autocast_dtype("cuda", self.fast_dtype)
            depth[0] += 1
        return out

    def exit_(self: Any, *exc: Any) -> Any:
        out = saved["__exit__"](self, *exc)
        prev = getattr(self, "_preflight_cuda", None)
        if prev is not None:
            torch.set_autocast_enabled("cuda", prev[0])
            torch.set_autocast_dtype("cuda", prev[1])
            depth[0] -= 1
            if depth[0] == 0:  # leaving the outermost autocast region: autocast_mode.cpp clear_cache()
                cache.clear()
        return out

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
            cpu_only = _cpu_only_ops()
            for name, policy in CUDA_POLICIES.items():
                lib.impl(name, _make_kernel(name, policy, cache), _KEY)
            for name in cpu_only:
                lib.impl(name, torch.library.fallthrough_kernel, _KEY)  # as CUDA's fallback
        torch.set_autocast_dtype("cpu", torch.get_autocast_dtype("cuda"))
        _Autocast.__init__, _Autocast.__enter__, _Autocast.__exit__ = init, enter, exit_
        yield cache
    finally:
        for attr, fn in saved.items():
            setattr(_Autocast, attr, fn)
        torch.set_autocast_dtype("cpu", prev_cpu_dtype)
        lib._destroy()
        cache.clear()
