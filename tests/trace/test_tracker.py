"""The storage tracker's reading of what ATen's composite kernels do in a plain run (`preflight.trace._tracker`)."""

from __future__ import annotations

import pytest
import torch
from conftest import predicted_and_measured, sgd
from torch import nn

from preflight import Loop, Run
from preflight import estimate as preflight_estimate


class _WideProjection(nn.Module):
    """A wide projection of a transposed (non-contiguous) input, the largest tensors of the step, then a small
    head: the peak is where the projection's product and bias meet."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.wide = nn.Linear(64, 2048)
        self.head = nn.Linear(32, 100)
        self.how = how

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).transpose(0, 1)  # (tokens, batch, features): what at::linear cannot flatten
        if self.how == "F.linear":
            wide = self.wide(h)
        else:  # the same product and bias written in Python: the plain run holds both at once
            wide = h @ self.wide.weight.t() + self.wide.bias
        return self.head(wide.mean(-1).t())


def _step(model, batch):
    tokens, labels = batch
    return nn.functional.cross_entropy(model(tokens), labels)


@pytest.mark.parametrize("how", ["F.linear", "written out"])
def test_linears_bias_add_on_its_own_product_is_counted_in_place(how):
    # at::linear adds the bias out of place under a dispatch mode; in the plain run, in place. The trace held one
    # product more (+1.5% to +2.4% on a batch-first attention block with accumulation, benchmarks/torch_modules.py;
    # +1 MiB here). The same arithmetic written in Python allocates the sum in the plain run too: still counted.
    batch = (torch.randint(0, 100, (4, 32)), torch.randint(0, 100, (4,)))
    est, measured = predicted_and_measured(lambda: _WideProjection(how), sgd, batch, step=_step)
    assert not est.coverage.lower_bound
    assert est.peak_bytes == measured


def test_a_batch_first_attention_block_with_accumulation_is_exact():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(100, 64)
            self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
            self.head = nn.Linear(64, 100)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens)
            return self.head(self.attn(h, h, h, need_weights=False)[0])

    def step(model, batch):
        tokens, labels = batch
        return nn.functional.cross_entropy(model(tokens).reshape(-1, 100), labels.reshape(-1))

    run = Run(loop=Loop(accumulate=2))
    batch = (torch.randint(0, 100, (4, 32)), torch.randint(0, 100, (4, 32)))
    est, measured = predicted_and_measured(Block, torch.optim.AdamW, batch, run, step=step)
    assert est.peak_bytes == measured  # +14,328 B (+1.7%) before


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 10))


def test_parameters_of_a_teacher_outside_the_model_are_counted_as_measured():
    # A distillation step reads a frozen teacher that is not part of the model: its weights sit on the device for
    # the whole run (a GPU's max_memory_allocated counts them), so the prediction and the measurement count them.
    torch.manual_seed(0)
    teacher = _mlp(1024).eval().requires_grad_(False)
    teacher_bytes = sum(p.untyped_storage().nbytes() for p in teacher.parameters())
    batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))

    def distill(model, batch):
        x, y = batch
        with torch.no_grad():
            target = teacher(x).softmax(-1)
        out = model(x)
        return nn.functional.cross_entropy(out, y) + nn.functional.kl_div(out.log_softmax(-1), target,
                                                                          reduction="batchmean")

    def alone(model, batch):  # the same step without the teacher's forward
        x, y = batch
        out = model(x)
        return nn.functional.cross_entropy(out, y) + out.log_softmax(-1).mean()

    est, measured = predicted_and_measured(lambda: _mlp(64), sgd, batch, step=distill)
    without, measured_without = predicted_and_measured(lambda: _mlp(64), sgd, batch, step=alone)
    assert est.outside_parameter_bytes == teacher_bytes
    assert without.outside_parameter_bytes == 0
    assert abs(est.peak_bytes - measured) <= 64, (est.peak_bytes, measured)
    assert measured - measured_without >= teacher_bytes  # the measurement counts the teacher too
    assert any(n.startswith("outside the model: the step called a Sequential that is not part of the model (at test_tracker.py:") for n in est.coverage.notes)


def test_a_parameter_of_the_model_reached_through_another_reference_is_counted_once():
    torch.manual_seed(0)
    model = _mlp(64)
    head = model[2].weight  # held by the step's closure, not reached through the model's forward
    batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))

    def step(m, batch):
        x, y = batch
        return nn.functional.cross_entropy(m(x), y) + 1e-4 * head.pow(2).sum()

    est = preflight_estimate(model, sgd(model.parameters()), batch, step=step)
    assert est.outside_parameter_bytes == 0
    assert est.breakdown["parameters"] == sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert not any(n.startswith("outside the model") for n in est.coverage.notes)
