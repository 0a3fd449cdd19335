"""Backward formulas that write in place in the plain run and out of place under a dispatch mode
(`preflight.trace._in_place`), counted as the plain run allocates them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import predicted_and_measured, sgd

from preflight.trace._in_place import IN_PLACE_IN_BACKWARD

VOCAB = 2048

# One operator per node of the table, as a loss over (batch, tokens, VOCAB) scores `z` and labels in 0..99.
SELECTIONS = {
    "IndexSelectBackward0": lambda z, y: z.index_select(1, torch.arange(z.size(1) - 1, -1, -1)).square().mean(),
    "GatherBackward0": lambda z, y: -z.log_softmax(-1).gather(-1, y[..., None]).mean(),
    "MaskedSelectBackward0": lambda z, y: z.masked_select(y[..., None] > 50).square().mean(),
    "IndexBackward0": lambda z, y: -z.log_softmax(-1)[torch.arange(z.size(0))[:, None], torch.arange(z.size(1)),
                                                      y].mean(),
    "TakeBackward0": lambda z, y: z.take(y.flatten()).mean(),
    "CummaxBackward0": lambda z, y: z.cummax(-1).values.mean(),
    "CumminBackward0": lambda z, y: z.cummin(-1).values.mean(),
    "BinaryCrossEntropyWithLogitsBackward0": lambda z, y: nn.functional.binary_cross_entropy_with_logits(
        z, torch.ones_like(z)),
    "MaxBackward0": lambda z, y: z.max(-1).values.mean(),
    "MinBackward0": lambda z, y: z.min(-1).values.mean(),
    "MedianBackward1": lambda z, y: z.median(-1).values.mean(),
    "NanmedianBackward1": lambda z, y: z.nanmedian(-1).values.mean(),
    "KthvalueBackward0": lambda z, y: z.kthvalue(3, -1).values.mean(),
    "ModeBackward0": lambda z, y: z.mode(-1).values.mean(),
    "TopkBackward0": lambda z, y: z.topk(8, -1).values.mean(),
    "SortBackward0": lambda z, y: z.sort(-1).values[..., -8:].mean(),
    "SortBackward1": lambda z, y: z.sort(stable=True, dim=-1).values[..., -8:].mean(),
}


class Scores(nn.Module):
    """Token scores over a wide vocabulary from a small projection: the scores' gradient, made in the loss's
    backward, is the largest tensor of the step."""

    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node
        self.embed = nn.Embedding(100, 32)
        self.proj = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return SELECTIONS[self.node](self.proj(self.embed(tokens)), labels)


def _step(model, batch):
    return model(*batch)


def test_the_table_names_the_nodes_torch_makes():
    # A rename in a later torch would silently stop the recognition: every name must be a node this torch makes.
    z = torch.randn(2, 3, 16, requires_grad=True)
    y = torch.randint(0, 16, (2, 3))
    for node, loss in SELECTIONS.items():
        fn = loss(z, y).grad_fn
        names = set()
        stack = [fn]
        while stack:
            f = stack.pop()
            if f is not None and f.name() not in names:
                names.add(f.name())
                stack.extend(n for n, _ in f.next_functions)
        assert node in names, (node, names)
    assert set(SELECTIONS) == set(IN_PLACE_IN_BACKWARD)


@pytest.mark.parametrize("node", ["GatherBackward0", "IndexBackward0", "MaxBackward0", "TopkBackward0",
                                  "TakeBackward0", "CummaxBackward0", "MaskedSelectBackward0",
                                  "BinaryCrossEntropyWithLogitsBackward0"])
def test_gradients_written_in_place_are_traced_to_the_measured_peak(node):
    # Before: the trace held the formula's zeros and its out-of-place result at once (max along the vocabulary:
    # +66.6%, take: +46.6%, cummax: +19.4% on (8, 64, 4096) scores). masked_select with a mask from the batch over
    # the scores was a lower bound (-95%): its size is now counted from the mask and its CPU temporaries calibrated.
    batch = (torch.randint(0, 100, (4, 32)), torch.randint(0, 100, (4, 32)))
    est, measured = predicted_and_measured(lambda: Scores(node), sgd, batch, step=_step)
    assert est.coverage.traced and not est.coverage.lower_bound
    # BCE's backward peak has three small scalar tensors alive in the real run that the trace does not see (12 B,
    # the wrapped numbers of its divisions: not located further); every other case is to the byte.
    slack = 12 if node == "BinaryCrossEntropyWithLogitsBackward0" else 0
    assert measured - slack <= est.peak_bytes <= measured


@pytest.mark.parametrize("weights", ["pos_weight", "pos_weight and weight", "pos_weight per element"])
def test_bce_with_pos_weight_chains_its_temporaries_as_the_plain_run_does(weights):
    # With `pos_weight` the formula is one C++ expression of out-of-place calls under a dispatch mode
    # (``t.add(1).sub(target).mul(input.sigmoid()).sub(t)``), whose temporaries live to the expression's end, and of
    # in-place calls on its first result in the plain run. Before: +38.5% on this step (two score-sized tensors).
    class Multilabel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, VOCAB)

        def forward(self, tokens, targets):
            z = self.embed(tokens)
            per_class = torch.linspace(0.5, 4.0, VOCAB)
            pos_weight = per_class.expand_as(z).contiguous() if weights == "pos_weight per element" else per_class
            weight = per_class if weights == "pos_weight and weight" else None
            return nn.functional.binary_cross_entropy_with_logits(z, targets, weight=weight, pos_weight=pos_weight)

    batch = (torch.randint(0, 100, (256,)), (torch.rand(256, VOCAB) > 0.9).float())
    est, measured = predicted_and_measured(Multilabel, sgd, batch, step=_step)
    assert est.coverage.traced and not est.coverage.lower_bound
    assert measured - 12 <= est.peak_bytes <= measured
