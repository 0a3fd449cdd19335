"""torch.compile'd models: a trace changes nothing about their compilation, and the estimate says what it covers.

Each test defines its own module classes: Dynamo's decisions stick to code objects, so classes shared with other
tests would make them depend on each other.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn

import preflight


class CountingBackend:
    """A Dynamo backend that runs the captured graph as it is and counts the graphs it was given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return gm.forward


def _estimate(model: nn.Module, batch: torch.Tensor) -> preflight.Estimate:
    return preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), batch)


def test_a_new_model_of_a_traced_compiled_class_is_still_compiled():
    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x):
            return self.lin(x).sin().cos().sum()

    backend = CountingBackend()
    est = _estimate(torch.compile(Chain(), backend=backend), torch.randn(4, 32))
    assert est.coverage.traced
    assert backend.graphs == 0  # the trace itself compiles nothing

    torch.compile(Chain(), backend=backend)(torch.randn(4, 32))
    assert backend.graphs == 1  # before the fix: 0, Chain.forward was marked "skip" for the process


def test_compiled_submodules_and_functions_stay_compiled():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x):
            return torch.relu(self.lin(x))

    backend = CountingBackend()

    @torch.compile(backend=backend)
    def gelu_chain(x):
        return torch.nn.functional.gelu(x) * 2

    class Outer(nn.Module):  # as a LightningModule would hold it: `self.block = torch.compile(block)`
        def __init__(self) -> None:
            super().__init__()
            self.block = torch.compile(Block(), backend=backend)
            self.head = nn.Linear(32, 1)

        def forward(self, x):
            return self.head(gelu_chain(self.block(x))).sum()

    model = Outer()
    est = _estimate(model, torch.randn(4, 32))
    assert est.coverage.traced and backend.graphs == 0
    note = " ".join(est.coverage.notes)
    assert "block (CountingBackend)" in note and "function (CountingBackend)" in note and "upper bound" in note

    torch.compile(Block(), backend=backend)(torch.randn(4, 32))
    assert backend.graphs == 1
    gelu_chain(torch.randn(4, 32))
    assert backend.graphs == 2


def test_dynamo_caches_are_kept():
    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(x).tanh().sum()

    backend = CountingBackend()
    model = torch.compile(Mlp(), backend=backend)
    model(torch.randn(2, 16)).backward()
    assert backend.graphs == 1
    _estimate(model, torch.randn(2, 16))
    model(torch.randn(2, 16)).backward()  # the cached graph, not a recompilation and not eager
    assert backend.graphs == 1
    assert torch.compiler.is_compiling() is False
    assert torch._dynamo.eval_frame._stance.stance == "default"


def test_an_eager_model_gets_no_compile_note():
    est = _estimate(nn.Sequential(nn.Linear(8, 1), nn.Flatten(0)), torch.randn(1, 8))
    assert not any("torch.compile" in n for n in est.coverage.notes)


@pytest.mark.slow
def test_an_inductor_compiled_model_is_predicted_as_the_compiled_run():
    class SinChain(nn.Module):  # eager saves every intermediate; inductor's partitioner saves x and recomputes
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(256, 256)

        def forward(self, x):
            y = self.lin(x)
            for _ in range(6):
                y = torch.sin(y) * 1.5 + 0.1
            return y.square().mean()

    def build(compiled: bool):
        torch.manual_seed(0)
        model = torch.compile(SinChain()) if compiled else SinChain()
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)

    batch = torch.randn(512, 256)
    model, opt = build(compiled=True)
    est = preflight.estimate(model, opt, batch, step=lambda m, b: m(b))
    eager = preflight.estimate(*build(compiled=False), batch, step=lambda m, b: m(b))
    model(batch).backward()  # compile outside the measured window
    model.zero_grad(set_to_none=True)
    measured = preflight.measure(model, opt, batch, step=lambda m, b: m(b)).peak_bytes
    assert eager.peak_bytes > 3 * measured  # the eager figure, which is what main predicted for the compiled model
    assert abs(est.peak_bytes - measured) <= 0.25 * measured, (est.peak_bytes, measured)
    assert any("inductor's partitioner" in n for n in est.coverage.notes)


def test_a_compiled_graph_that_cannot_be_captured_is_traced_eagerly_and_labelled():
    class Holder:  # not a pytree: AOTAutograd cannot return it from a graph
        def __init__(self, loss):
            self.loss = loss

    class Boxed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return Holder(self.lin(x).relu().sum())

    model = torch.compile(Boxed())
    est = preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 16),
                             step=lambda m, b: m(b).loss)
    note = " ".join(est.coverage.notes)
    assert est.coverage.traced and "Boxed (inductor: " in note and "eager peak, an upper bound" in note
