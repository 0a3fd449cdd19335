"""Sparse gradients traced with their real number of entries (`preflight.trace._sparse`)."""

from __future__ import annotations

import pytest
import torch
from conftest import predicted_and_measured
from torch import nn

import preflight
from preflight.trace._sparse import SparseShadows, sparse_call


class SparseTable(nn.Module):
    """A recommender-style table with sparse gradients under a dense head."""

    def __init__(self, bag: bool = False, **options) -> None:
        super().__init__()
        self.bag = bag
        self.table = (nn.EmbeddingBag if bag else nn.Embedding)(20_000, 64, sparse=True, **options)
        self.head = nn.Linear(64, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids) if self.bag else self.table(ids).mean(1))


def _batch(pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 300, (32, 24), generator=gen)  # repeated ids: coalescing merges them
    if pad:
        ids[:, 16:] = 0
    return ids, torch.randint(0, 4, (32,), generator=gen)


def _step(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps),
}


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sparse_gradients_are_traced_to_the_measured_peak(name, accumulate):
    """Autograd keeps the embedding's sparse gradient without a copy, a second micro-batch's is summed into it (the
    kernel allocates for both), momentum SGD clones and sums, Adagrad coalesces (one entry per distinct id, its
    storage sized for all): each as the CPU kernels allocate, to within the step's CPU scalars."""
    run = preflight.Run(loop=preflight.Loop(accumulate=accumulate))
    est, measured = predicted_and_measured(SparseTable, OPTIMIZERS[name], _batch(), run, step=_step)
    assert not est.coverage.lower_bound, est.coverage
    assert 0 <= measured - est.peak_bytes <= 16


def test_sparse_adam_and_a_padding_index_are_traced():
    def sparse_adam(parameters):
        return torch.optim.SparseAdam([p for p in parameters if p.dim() == 2 and p.shape[0] == 20_000])

    est, measured = predicted_and_measured(SparseTable, sparse_adam, _batch(), step=lambda m, b: m(b[0]).sum())
    assert not est.coverage.lower_bound and 0 <= measured - est.peak_bytes <= 16
    # padding_idx drops the padded ids' entries (a mask over the ids, whose values the batch gives)
    est, measured = predicted_and_measured(lambda: SparseTable(padding_idx=0), OPTIMIZERS["adagrad"], _batch(True),
                                           step=_step)
    assert not est.coverage.lower_bound and abs(measured - est.peak_bytes) <= 0.001 * measured


@pytest.mark.parametrize("name", ["sgd-nesterov", "adagrad"])
def test_an_embedding_bag_s_sparse_gradient_is_traced_with_its_ids(name):
    # EmbeddingBag's backward is one operator that builds the sparse gradient inside: it is run as its kernel's
    # operators, so the ids reach the gradient (before: a coalesce keeping every entry, +3% with Adagrad).
    est, measured = predicted_and_measured(lambda: SparseTable(bag=True), OPTIMIZERS[name], _batch(), step=_step)
    assert not est.coverage.lower_bound and 0 <= measured - est.peak_bytes <= 16
    assert not any("coalesce(s)" in n for n in est.coverage.notes)


def test_a_coalesce_of_unknown_indices_keeps_every_entry_and_says_so():
    from torch._subclasses.fake_tensor import FakeTensorMode

    shadows = SparseShadows()
    with FakeTensorMode() as mode:
        x = torch.sparse_coo_tensor(torch.zeros(1, 6, dtype=torch.long), torch.ones(6, 3), (5, 3))
    with mode:
        out = sparse_call(shadows, torch.ops.aten._coalesce.default, (x,), {}, accumulating=False)
    assert out._nnz() == 6 and out.is_coalesced()  # the real one has 1 entry: an upper bound
    assert shadows.note().startswith("1 coalesce(s) of a sparse gradient whose indices are not known")
    shadows.shadows[x] = torch.zeros(1, 6, dtype=torch.long)  # with the ids known, the distinct ones are kept
    with mode:
        out = sparse_call(shadows, torch.ops.aten._coalesce.default, (x,), {}, accumulating=False)
    assert out._nnz() == 1 and out._values().untyped_storage().nbytes() == 6 * 3 * 4  # allocated for all six


def test_an_operator_that_makes_a_sparse_tensor_not_listed_stops_the_trace():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = torch.sparse_coo_tensor(torch.zeros(1, 3, dtype=torch.long), torch.ones(3), (5,))
    assert x.layout == torch.sparse_coo
    with mode, pytest.raises(NotImplementedError, match="sparse tensors: aten.neg.default is not traced"):
        sparse_call(SparseShadows(), torch.ops.aten.neg.default, (x,), {}, accumulating=False)


def test_a_cuda_target_says_how_sparse_kernels_are_sized():
    torch.manual_seed(0)
    model = SparseTable()
    est = preflight.estimate(model, OPTIMIZERS["adagrad"](model.parameters()), _batch(),
                             preflight.Run(target=preflight.Target(gpu="H100-80GB")), step=_step)
    assert not est.coverage.lower_bound
    assert any(n.startswith("sparse gradients on a CUDA target: sized as torch's CPU kernels") for n in
               est.coverage.notes)
    # The sparse gradient's entries are in the figure: a model without it predicts less.
    assert est.breakdown["gradients"] > (64 * 4 + 4) * 4
