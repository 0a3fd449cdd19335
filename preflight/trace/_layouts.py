"""Give fake outputs the memory layout and dtype the real kernel gives them.

A fake tensor's strides come from the operator's meta function or decomposition, which can choose another
layout than the device kernel. LayerNorm's backward with a transposed ``grad_output`` is one: the CPU kernel
returns a contiguous ``grad_input``, the fake one follows ``grad_output``'s layout, and a later ``reshape`` then
copies in the trace only (Swin: +1.1% of the peak). Layouts only diverge when an output has the shape of an
input that is not contiguous (the layout a kernel may or may not propagate), so for each such operator
configuration (the operator, its inputs' shapes, strides and dtypes, its other
arguments) `LayoutCalibration` runs the real kernel once on zero-filled inputs of the same layout, and where
its outputs' strides differ, the fake outputs get the kernel's strides. Views are never changed: their layout
is the operator's definition, not a kernel's choice.

Output dtypes diverge the same way where the floating inputs mix dtypes: the CPU LayerNorm and GroupNorm kernels
return their saved ``mean`` and ``rstd`` in fp32 when a bf16 input meets fp32 weights (``param_scalar_type`` in
``aten/src/ATen/native/layer_norm.cpp``, as CPU autocast runs them), while torch's reference implementation
casts them to the input's dtype on the CPU (``torch/_refs/__init__.py``, ``native_layer_norm``): half the bytes,
for every normalisation layer's saved statistics (Swin under bf16-mixed: -0.74% of the peak). So configurations
with mixed floating dtypes are run once too, and the fake outputs get the kernel's dtypes as well as its strides.

Known limitations: it runs on the CPU, so it applies only when the target is the CPU (CUDA kernels can choose
otherwise); configurations larger than `MAX_BYTES` are not run, and are counted in `note`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["LayoutCalibration", "MAX_BYTES", "empty_kernel_state"]

# One real run of a configuration this size costs little next to a trace; larger ones are not run.
MAX_BYTES = 64 << 20


# Arguments that carry a kernel's own state from its forward to its backward (oneDNN's RNN workspace, cuDNN's
# reserve space): opaque bytes the backward reads at offsets of its own.
_KERNEL_STATE_ARGS = ("workspace", "reserve", "reserveSpace", "reserve_space")


def empty_kernel_state(func: Any, args: Any, kwargs: dict | None = None) -> bool:
    """Whether a call passes an empty tensor (or tensor spec) where the kernel reads its own state: a meta function
    that returns an empty workspace. Run for real on zeros of that shape, the kernel reads past the end (a oneDNN
    LSTM backward on the empty workspace torch's meta function gives crashed the process), so such a call is never
    run for a layout or a scratch calibration."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    given = dict(zip((a.name for a in schema.arguments), args))
    given.update(kwargs or {})
    return any(hasattr(given.get(name), "shape") and 0 in tuple(given[name].shape) for name in _KERNEL_STATE_ARGS)


class LayoutCalibration:
    """Match fake outputs' strides and dtypes with the real CPU kernel's, once per operator configuration."""

    def __init__(self) -> None:
        # config -> the kernel's output (strides, dtype)s
        self._layouts: dict[Any, list[tuple[tuple[int, ...], torch.dtype]] | None] = {}
        self.corrected: dict[str, int] = {}  # operator -> outputs whose layout was corrected
        self.unchecked = 0  # configurations too large to run

    def match(self, func: Any, args: Any, kwargs: dict, out: Any) -> Any:
        """``out`` with each freshly allocated tensor's strides and dtype set to the real kernel's."""
        if any(r.alias_info is not None for r in func._schema.returns) or func._schema.is_mutable:
            return out
        flat_args = tree_flatten((args, kwargs))[0]
        tensors = [a for a in flat_args if isinstance(a, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        # An output can only inherit the layout of an input of its own shape (elementwise ops, norms' backward):
        # a matmul with a transposed weight has no layout to propagate, and is not run.
        shapes = {tuple(a.shape) for a in tensors if a.dim() > 1 and not a.is_contiguous()}
        inherits_layout = any(tuple(t.shape) in shapes for t in outs)
        mixed_dtypes = len({a.dtype for a in tensors if a.is_floating_point()}) > 1
        if not (inherits_layout or mixed_dtypes) or empty_kernel_state(func, args, kwargs):
            return out
        key = (func, *(_spec(a) for a in flat_args))
        if key not in self._layouts:
            self._layouts[key] = self._run_real(func, args, kwargs, flat_args, outs)
        layouts = self._layouts[key]
        if layouts is None or len(layouts) != len(outs):
            return out
        fixed = {}
        for t, (stride, dtype) in zip(outs, layouts):
            if (tuple(t.stride()) != stride or t.dtype != dtype) and t.dim() == len(stride):
                fixed[id(t)] = torch.empty_strided(tuple(t.shape), stride, dtype=dtype, device=t.device)
        if not fixed:
            return out
        self.corrected[str(func)] = self.corrected.get(str(func), 0) + len(fixed)
        return tree_map(lambda x: fixed.get(id(x), x), out)

    def _run_real(self, func: Any, args: Any, kwargs: dict, flat_args: list[Any],
                  outs: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]] | None:
        tensors = [a for a in flat_args if isinstance(a, torch.Tensor)] + outs
        if sum(t.untyped_storage().nbytes() for t in tensors) > MAX_BYTES:
            self.unchecked += 1
            return None

        def zeros_like_layout(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            real = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="cpu")
            return real.zero_() if real.numel() else real

        def on_cpu(x: Any) -> Any:
            return torch.device("cpu") if isinstance(x, torch.device) else x

        with _disable_current_modes():
            try:
                real_out = func(*tree_map(zeros_like_layout, tree_map(on_cpu, args)),
                                **tree_map(zeros_like_layout, tree_map(on_cpu, kwargs)))
            except Exception:  # noqa: BLE001 - a kernel that cannot run on zeros keeps the fake layout
                return None
        return [(tuple(t.stride()), t.dtype) for t in tree_flatten(real_out)[0] if isinstance(t, torch.Tensor)]

    def note(self) -> str | None:
        parts = []
        if self.corrected:
            parts.append("memory layout or dtype of outputs taken from the real CPU kernel where the fake one "
                         "differs: " + ", ".join(f"{op} ({n})" for op, n in sorted(self.corrected.items())))
        if self.unchecked:
            parts.append(f"{self.unchecked} operator configuration(s) with non-contiguous or mixed-dtype inputs "
                         f"were too large (> {MAX_BYTES >> 20} MiB) to check their outputs against the kernel")
        return "; ".join(parts) or None


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.storage_offset())
    if isinstance(x, (torch.device, torch.dtype, torch.layout, torch.memory_format)):
        return str(x)
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return x
