"""Backward formulas that write in place in the plain run and out of place under a dispatch mode.

Several of torch's backward formulas make a fresh tensor of zeros and write the gradient into it in place, unless
a tensor is "subclass-like" (``at::isTensorSubclassLike``), which every tensor is while a dispatch mode runs
(``c10::impl::dispatch_mode_enabled()``). Then they call the out-of-place operator, and the trace would hold the
zeros and the result at once where the plain run holds one tensor: a gather over a vocabulary-sized tensor
(log-probabilities of chosen tokens), the unsorting ``index_select`` of ``pad_packed_sequence``, ``x[idx]``.

`IN_PLACE_IN_BACKWARD` maps the autograd node each formula backs to the operators it calls out of place instead
of in place, read from torch 2.13's source and checked against a logging dispatch mode:

- ``index_select_backward`` (aten/src/ATen/native/TensorAdvancedIndexing.cpp): ``new_zeros(...).index_add_``.
- ``gather_backward`` (same file): ``new_zeros(...).scatter_add_``.
- ``masked_select_backward`` (same file): ``zeros_like(...).masked_scatter_``.
- ``value_selecting_reduction_backward`` (ReduceOps.cpp; ``max``/``min``/``median``/``nanmedian``/``kthvalue``/
  ``mode`` along a dimension, ``topk``, ``sort``): ``zeros(...).scatter_``.
- ``cummaxmin_backward`` (ReduceOps.cpp; ``cummax``, ``cummin``): ``zeros(...).scatter_add_``.
- ``index_backward`` (torch/csrc/autograd/FunctionsManual.cpp; ``x[idx]``, ``x[mask]``): ``_index_put_impl_`` into
  the zeros; ``take_backward``: ``zeros_like(self).put_``.
- ``binary_cross_entropy_with_logits_backward`` (FunctionsManual.cpp): ``input.sigmoid().sub_(target)``, or with
  ``pos_weight`` ``t = pos_weight.mul(target); t.add(1).sub_(target).mul_(input.sigmoid()).sub_(t)``, then
  ``.mul_(grad)`` and ``.mul_(weight)``.

The tracker (`preflight.trace._tracker`) counts such an operator in place when it runs inside one of these nodes
with grad mode off, its first operand is a tensor an earlier operator of the same node made (the formula's own
fresh tensor: in the plain run the in-place call writes into it), and its result has the operand's shape, dtype and
device; otherwise as the new allocation it is. That holds for a chain of out-of-place calls in one C++ expression
too, whose temporaries a dispatch mode keeps alive to the expression's end (``pos_weight`` above: +38.5% before on
a step whose peak is that backward). The forward-mode formulas with the same branches (``_invstd_jvp``,
``logsumexp_jvp``, ...) are not listed.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["IN_PLACE_IN_BACKWARD"]

_aten = torch.ops.aten
_SCATTER = frozenset({_aten.scatter.src})
_SCATTER_ADD = frozenset({_aten.scatter_add.default})

IN_PLACE_IN_BACKWARD: dict[str, frozenset[Any]] = {
    "IndexSelectBackward0": frozenset({_aten.index_add.default}),
    "GatherBackward0": _SCATTER_ADD,
    "MaskedSelectBackward0": frozenset({_aten.masked_scatter.default}),
    "IndexBackward0": frozenset({_aten.index_put.default}),
    "TakeBackward0": frozenset({_aten.put.default}),
    "CummaxBackward0": _SCATTER_ADD,
    "CumminBackward0": _SCATTER_ADD,
    "BinaryCrossEntropyWithLogitsBackward0": frozenset({_aten.sub.Tensor, _aten.mul.Tensor}),
    **{name: _SCATTER for name in (
        "MaxBackward0", "MinBackward0", "MedianBackward1", "NanmedianBackward1", "KthvalueBackward0",
        "ModeBackward0", "TopkBackward0", "SortBackward0", "SortBackward1")},
}
