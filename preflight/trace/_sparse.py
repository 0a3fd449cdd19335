"""Sparse gradients (``nn.Embedding(..., sparse=True)``, ``nn.EmbeddingBag(..., sparse=True)``) traced with their
real number of entries.

A sparse COO tensor holds an ``indices`` tensor of ``(sparse_dim, nnz)`` int64 and a ``values`` tensor of ``(nnz,
*dense_shape)``; its memory is theirs, and ``nnz`` depends on the batch: an embedding's sparse gradient has one
entry per looked-up index (``embedding_sparse_backward`` in ``aten/src/ATen/native/Embedding.cpp`` builds it from
views of the indices and of the output's gradient), and coalescing it (Adagrad and ``SparseAdam`` do) leaves one per
distinct index. torch's fake kernels make most sparse results with no entries (``clone``, ``detach``, ``add``,
``coalesce``, ``sparse_mask``: ``nnz == 0``, torch 2.13), so each operator that makes or changes a sparse tensor is
computed here, as its CPU kernel does in ``aten/src/ATen/native/sparse/SparseTensorMath.cpp`` and
``SparseTensor.cpp``:

- ``detach``/``alias``: the same ``indices`` and ``values``; ``clone``: copies of both.
- ``add``/``add_``/``sub`` of two sparse tensors: both coalesced, the union of their entries (merged); otherwise
  their concatenation (``cat`` of indices and of values, uncoalesced), the one autograd builds when it accumulates a
  second micro-batch's gradient into the first's.
- ``mul``/``div`` by a scalar: the indices copied, the values computed; in place: nothing new.
- ``coalesce``: new indices and values with one entry per distinct index.
- ``dense.sparse_mask(mask)``: the mask's indices, new values.

The number of distinct indices is read from the indices' values: the embedding's indices come from the batch, whose
small integer tensors carry value shadows (`preflight.trace._tracker`), so each sparse tensor keeps the real
indices beside it (``index_shadows``). Without them a coalesce keeps every entry (an upper bound, noted). Dense
results of sparse inputs (``dense.add_(sparse)``, ``to_dense``, ``_values()``) are the fake kernels' own. Any other
operator that makes a sparse tensor stops the trace (a labelled lower bound naming it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["CONSTRUCT", "SparseShadows", "constructed", "embedding_bag_backward", "is_sparse", "sparse_call"]

aten = torch.ops.aten
CONSTRUCT = aten._sparse_coo_tensor_with_dims_and_tensors.default


def is_sparse(x: Any) -> bool:
    """A sparse COO tensor."""
    return isinstance(x, torch.Tensor) and x.layout == torch.sparse_coo


class SparseShadows:
    """The real indices of the trace's sparse tensors where they are known (``shadows``), and the coalesces that
    had to keep every entry for want of them (``unknown``)."""

    def __init__(self) -> None:
        self.shadows: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.unknown = 0
        # The indices and values an in-place call replaced, alive until the tracker has counted their successors:
        # the real kernel makes the new ones before it lets go of the old.
        self.replaced: tuple[torch.Tensor, ...] = ()

    def release(self) -> None:
        """The tracker has counted the last call's results: what it replaced may be freed now."""
        self.replaced = ()

    def note(self) -> str | None:
        if not self.unknown:
            return None
        return (f"{self.unknown} coalesce(s) of a sparse gradient whose indices are not known from the batch kept "
                "every entry (an upper bound: repeated indices merge in the real step)")


def _make(like: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, coalesced: bool) -> torch.Tensor:
    return CONSTRUCT(like.sparse_dim(), like.dense_dim(), list(like.shape), indices, values, layout=torch.sparse_coo,
                     device=values.device, dtype=values.dtype, is_coalesced=coalesced)


def _stand_in(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """A real sparse tensor with ``x``'s sparse shape, the real indices ``real`` and one zero per entry."""
    return torch.sparse_coo_tensor(real, torch.zeros(real.shape[1]), tuple(x.shape[:x.sparse_dim()]),
                                   is_coalesced=x.is_coalesced(), check_invariants=False)


def _entries(x: torch.Tensor, rows: int, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices and values shaped as ``x``'s, allocated for ``rows`` entries and narrowed to the first ``kept``, as
    the CPU kernels make them (``set_nnz_and_narrow``: the storage keeps its size)."""
    indices = x._indices().new_empty((x.sparse_dim(), rows))[:, :kept]
    values = x._values().new_empty((rows, *x._values().shape[1:]))[:kept]
    return indices, values


def sparse_call(shadows: SparseShadows, func: Any, args: tuple, kwargs: dict, *, accumulating: bool) -> Any:
    """``func(*args, **kwargs)`` for a call with a sparse tensor among its arguments, under the fake mode (the
    tracker's mode off); the tracker counts the result's ``indices`` and ``values``. ``accumulating``: the call is
    made by the backward pass with gradients off (where autograd's ``AccumulateGrad`` copies a new gradient).

    Raises:
        NotImplementedError: an operator not listed in the module docstring makes a sparse tensor.
    """
    if accumulating and func is aten.clone.default and _stealable(args[0]):
        # AccumulateGrad keeps a new sparse gradient whose indices and values are contiguous and held by it alone
        # (a shallow copy, torch/csrc/autograd/functions/accumulate_grad.h), where a Python mode's references make
        # it clone them: in the real step nothing is copied.
        return _alias(shadows, args[0])
    handler = _HANDLERS.get(func)
    if handler is not None:
        return handler(shadows, *args, **kwargs)
    out = func(*args, **kwargs)
    if any(is_sparse(t) for t in tree_flatten(out)[0]):
        raise NotImplementedError(f"sparse tensors: {func} is not traced (its fake kernel makes a sparse result "
                                  "without its entries)")
    return out


def _stealable(x: torch.Tensor) -> bool:
    return is_sparse(x) and x._indices().is_contiguous() and x._values().is_contiguous()


def constructed(shadows: SparseShadows, args: tuple, out: torch.Tensor, shadow_of: Callable[[Any], Any]) -> None:
    """After ``CONSTRUCT``: keep the real indices beside the new sparse tensor where its ``indices`` argument has a
    value shadow."""
    real = shadow_of(args[3])
    if real is not None:
        shadows.shadows[out] = real


def _alias(shadows: SparseShadows, x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    out = _make(x, x._indices(), x._values(), x.is_coalesced())
    _carry(shadows, x, out)
    return out


def _clone(shadows: SparseShadows, x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    out = _make(x, x._indices().clone(), x._values().clone(), x.is_coalesced())
    _carry(shadows, x, out)
    return out


def _carry(shadows: SparseShadows, source: torch.Tensor, out: torch.Tensor) -> None:
    real = shadows.shadows.get(source)
    if real is not None:
        shadows.shadows[out] = real


def _sum(shadows: SparseShadows, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool, Any]:
    """Indices, values, coalesced flag and real indices of ``a + b``: ``add_out_sparse_contiguous`` allocates both
    inputs' entries and keeps those its merge of the two index lists leaves (run here on stand-ins of the real
    indices; all of them where those are not known)."""
    rows = a._nnz() + b._nnz()
    ra, rb = shadows.shadows.get(a), shadows.shadows.get(b)
    real = None
    if ra is not None and rb is not None:
        with _disable_current_modes():
            real = (_stand_in(a, ra) + _stand_in(b, rb))._indices().clone()
    indices, values = _entries(a, rows, rows if real is None else real.shape[1])
    return indices, values, a.is_coalesced() and b.is_coalesced(), real


def _add(shadows: SparseShadows, a: torch.Tensor, b: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    if not (is_sparse(a) and is_sparse(b)):
        raise NotImplementedError("sparse tensors: a sum of a sparse and a dense tensor is not traced")
    indices, values, coalesced, real = _sum(shadows, a, b)
    out = _make(a, indices, values, coalesced)
    if real is not None:
        shadows.shadows[out] = real
    return out


def _add_(shadows: SparseShadows, a: torch.Tensor, b: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    if not is_sparse(a):  # a dense tensor accumulating a sparse one (an optimizer's step): the fake kernel's
        return aten.add_.Tensor(a, b, *_, **__)
    rows = a._nnz() + b._nnz()
    indices, values, coalesced, real = _sum(shadows, a, b)
    shadows.replaced = (a._indices(), a._values())
    aten.copy_sparse_to_sparse_(a, _make(a, indices, values, coalesced))  # copies of the narrowed entries
    for part, allocated in ((a._indices(), (a.sparse_dim(), rows)), (a._values(), (rows, *values.shape[1:]))):
        kept = tuple(part.shape)
        part.resize_(allocated)  # the storage the kernel allocated, for every entry of both
        part.resize_(kept)
    shadows.shadows.pop(a, None)
    if real is not None:
        shadows.shadows[a] = real
    return a


def _scaled(shadows: SparseShadows, x: torch.Tensor, other: Any, *_: Any, **__: Any) -> torch.Tensor:
    if not is_sparse(x) or is_sparse(other):
        raise NotImplementedError("sparse tensors: a product of two sparse tensors, or of a dense one by a sparse "
                                  "one, is not traced")
    out = _make(x, x._indices().clone(), x._values().new_empty(x._values().shape), x.is_coalesced())
    _carry(shadows, x, out)
    return out


def _scaled_(shadows: SparseShadows, x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    return x  # the values scaled in place


def _coalesce(shadows: SparseShadows, x: torch.Tensor) -> torch.Tensor:
    """``_coalesce_sparse_cpu``: indices and values allocated for every entry, narrowed to the distinct ones."""
    real = shadows.shadows.get(x)
    if real is None:
        shadows.unknown += 1
        kept = x._nnz()
    else:
        with _disable_current_modes():
            real = _stand_in(x, real).coalesce()._indices().clone()
        kept = real.shape[1]
    indices, values = _entries(x, x._nnz(), kept)
    out = _make(x, indices, values, True)
    if real is not None:
        shadows.shadows[out] = real
    return out


def _sparse_mask(shadows: SparseShadows, dense: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    values = dense.new_empty((mask._nnz(), *dense.shape[mask.sparse_dim():]))
    out = _make(mask, mask._indices().clone(), values, mask.is_coalesced())
    _carry(shadows, mask, out)
    return out


_HANDLERS: dict[Any, Callable[..., Any]] = {
    aten.detach.default: _alias, aten.alias.default: _alias, aten.clone.default: _clone,
    aten.add.Tensor: _add, aten.add_.Tensor: _add_, aten.sub.Tensor: _add,
    aten.mul.Tensor: _scaled, aten.div.Tensor: _scaled, aten.mul.Scalar: _scaled, aten.div.Scalar: _scaled,
    aten.mul_.Tensor: _scaled_, aten.div_.Tensor: _scaled_, aten.mul_.Scalar: _scaled_, aten.div_.Scalar: _scaled_,
    aten._coalesce.default: _coalesce, aten.sparse_mask.default: _sparse_mask,
}


def embedding_bag_backward(grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, offset2bag: torch.Tensor,
                           bag_size: torch.Tensor, maximum_indices: torch.Tensor, num_weights: int,
                           scale_grad_by_freq: bool, mode: int, sparse: bool,
                           per_sample_weights: torch.Tensor | None = None, padding_idx: int = -1) -> torch.Tensor:
    """``aten._embedding_bag_backward`` as its CPU and CUDA kernels run it with ``sparse=True``
    (``_embedding_bag_backward_symint`` and ``_embedding_bag_sparse_backward_symint`` in
    ``aten/src/ATen/native/EmbeddingBag.cpp``), as operators the tracker sees one by one: the ids reach the sparse
    gradient it builds with their values, as ``nn.Embedding``'s do. The dense case is the operator itself."""
    if not sparse:
        return aten._embedding_bag_backward.default(grad, indices, offsets, offset2bag, bag_size, maximum_indices,
                                                    num_weights, scale_grad_by_freq, mode, sparse,
                                                    per_sample_weights, padding_idx)
    if indices.numel() and not offset2bag.numel():  # the sum mode's forward leaves it empty: make_offset2bag
        made = offsets.new_zeros((indices.shape[0] + 1,))
        made.index_add_(0, offsets, torch.ones_like(offsets))
        made[0] -= 1
        offset2bag = made.cumsum(0, dtype=made.dtype)[:indices.shape[0]]  # resize_ to fewer keeps the storage
    index_grad = grad.index_select(0, offset2bag)
    if mode == 1:  # mean: apply_bag_size_backward
        index_grad *= (1 / bag_size.unsqueeze(1).to(index_grad.dtype)).index_select(0, offset2bag)
    if per_sample_weights is not None:
        index_grad.mul_(per_sample_weights.unsqueeze(1))
    return _embedding_sparse_backward(index_grad, indices, num_weights, padding_idx, scale_grad_by_freq)


def _embedding_sparse_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int,
                               scale_grad_by_freq: bool) -> torch.Tensor:
    """``embedding_sparse_backward_symint`` (``aten/src/ATen/native/Embedding.cpp``), written out: called from a
    kernel, its CompositeImplicitAutograd kernel would reach the tracker as one operator."""
    if scale_grad_by_freq:
        raise RuntimeError("embedding_backward: scale_grad_by_freq not supported with sparse gradients")
    features = grad.shape[-1]
    if padding_idx != -1:
        kept = indices != padding_idx
        indices, grad = indices[kept], grad[kept]
    if grad.numel() == 0:
        index, values = indices.new_empty((1, 0), dtype=torch.long), grad.new_empty((0, features))
    else:
        index, values = indices.reshape(1, -1).to(torch.long), grad.reshape(-1, features)
    return CONSTRUCT(1, 1, [num_weights, features], index, values, layout=torch.sparse_coo, device=values.device,
                     dtype=values.dtype)
