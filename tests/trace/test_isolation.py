"""A trace changes nothing the step touches outside the model: real tensors it writes, global hooks, what it rebinds,
torch's flags, the environment, outer modes, and other threads' random draws (preflight.trace._process and the
tracker's adoption of real tensors)."""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

import preflight

STATE = {"pos": torch.zeros(1)}
COUNTER = torch.zeros(1)


class Helper:
    def __init__(self) -> None:
        self.t = torch.zeros(2)


HELPER = Helper()


class Touchy(nn.Module):
    """Writes a tensor counter on itself, a module-level tensor, a module-level dict and a helper's attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.seen = torch.zeros((), dtype=torch.long)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        COUNTER.add_(1)
        STATE["pos"] = STATE["pos"] + 1
        HELPER.t = HELPER.t * 2 + 1
        return nn.functional.mse_loss(self.lin(x), y)


def _batch() -> dict:
    return {"x": torch.randn(4, 8), "y": torch.randn(4, 4)}


def test_real_tensors_the_step_writes_keep_their_values():
    model = Touchy()
    criterion = nn.BatchNorm1d(4)  # a loss-side module with buffers, outside the model

    def step(m, b):
        return m(**b) + criterion(b["y"]).sum()

    before = {"running_mean": criterion.running_mean.clone(), "pos": STATE["pos"], "helper": HELPER.t}
    estimate = preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), _batch(), step=step)
    assert estimate.peak_bytes > 0 and not estimate.coverage.lower_bound
    assert model.seen.item() == 0 and COUNTER.item() == 0
    assert criterion.num_batches_tracked.item() == 0 and torch.equal(criterion.running_mean, before["running_mean"])
    # Slots the forward rebound hold the user's own tensors again, not deleted entries.
    assert STATE["pos"] is before["pos"] and HELPER.t is before["helper"]
    assert criterion.weight.grad is None  # the traced backward reached the criterion's real parameter
    # The next real step runs as it would have.
    model(**_batch()).backward()
    assert model.seen.item() == 4 and STATE["pos"].item() == 1 and COUNTER.item() == 1
    STATE["pos"], HELPER.t = torch.zeros(1), torch.zeros(2)
    COUNTER.zero_()


def test_global_hooks_do_not_run_on_the_trace():
    calls = {"optimizer": 0, "forward": 0}
    averaged_steps = []

    def after_step(optimizer, args, kwargs):  # an SWA-style average updated after every optimizer step
        calls["optimizer"] += 1
        averaged_steps.append(type(optimizer).__name__)

    def forward_hook(module, args, output):
        calls["forward"] += 1

    h1 = register_optimizer_step_post_hook(after_step)
    h2 = nn.modules.module.register_module_forward_hook(forward_hook)
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        batch = torch.randn(4, 8)
        estimate = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                                      step=lambda m, b: m(b).sum())
        assert calls == {"optimizer": 0, "forward": 0}
        assert any("global hook(s)" in n for n in estimate.coverage.notes)
        model(batch)  # still registered for the real run
        assert calls["forward"] == 4
    finally:
        h1.remove()
        h2.remove()


def test_flags_environment_and_outer_modes_are_left_as_they_were():
    class SetsFlags(nn.Linear):
        def forward(self, x):
            torch.set_float32_matmul_precision("medium")
            torch.backends.cudnn.benchmark = True
            os.environ["PREFLIGHT_TEST_FLAG"] = "1"
            return super().forward(x)

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fake = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            from torch._subclasses.fake_tensor import FakeTensor
            self.fake += any(isinstance(a, FakeTensor) for a in args)
            return func(*args, **(kwargs or {}))

    packed = []
    model = SetsFlags(8, 2)
    precision, benchmark = torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark
    with Counting() as mode, torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        estimate = preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8),
                                      step=lambda m, b: m(b).sum())
    assert mode.fake == 0 and packed == []
    assert torch.get_float32_matmul_precision() == precision and torch.backends.cudnn.benchmark == benchmark
    assert "PREFLIGHT_TEST_FLAG" not in os.environ
    assert any("put back" in n and "PREFLIGHT_TEST_FLAG" in n for n in estimate.coverage.notes)


def test_anomaly_detection_does_not_make_a_lower_bound():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters())
    plain = preflight.estimate(model, opt, torch.randn(4, 8), step=lambda m, b: m(b).sum())
    with torch.autograd.detect_anomaly():
        anomaly = preflight.estimate(model, opt, torch.randn(4, 8), step=lambda m, b: m(b).sum())
        assert torch.is_anomaly_enabled()
    assert not anomaly.coverage.lower_bound and anomaly.peak_bytes == plain.peak_bytes


def test_other_threads_draws_are_not_rewound():
    """A thread drawing from the global streams while a trace runs: its draws continue the stream, the trace's draws
    (the step draws too) come from a private copy, and the main thread's next draw follows the other thread's."""
    random.seed(7)
    np.random.seed(7)
    expected_python = random.Random(7)
    expected_numpy = np.random.RandomState(7)
    in_trace, drawn = threading.Event(), threading.Event()
    background: dict[str, list] = {}

    def draw_meanwhile():
        in_trace.wait(30)
        background["python"] = [random.random() for _ in range(5)]
        background["numpy"] = list(np.random.random(5))
        drawn.set()

    def step(m, b):
        in_trace.set()
        drawn.wait(30)
        random.random()  # the step draws too: from the trace's private copy
        np.random.random()
        return m(b).sum()

    thread = threading.Thread(target=draw_meanwhile)
    thread.start()
    model = nn.Linear(8, 1)
    preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8), step=step)
    thread.join()
    assert background["python"] == [expected_python.random() for _ in range(5)]
    assert background["numpy"] == list(expected_numpy.random_sample(5))
    assert random.random() == expected_python.random()  # not a repeat of the other thread's first draw
    assert np.random.random() == expected_numpy.random_sample()


def test_a_step_that_seeds_does_not_change_the_stream():
    random.seed(3)
    expected = random.Random(3).random()
    model = nn.Linear(8, 1)

    def step(m, b):
        random.seed(123)
        torch.manual_seed(123)
        return m(b).sum()

    batch = torch.randn(4, 8)
    torch.manual_seed(5)
    torch_expected = torch.rand(3)
    torch.manual_seed(5)
    preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, step=step)
    assert random.random() == expected
    assert torch.equal(torch.rand(3), torch_expected)


@pytest.fixture(autouse=True)
def _no_leftover_hooks():
    yield
    assert not nn.modules.module._global_forward_hooks


def test_optimizer_in_backward_hooks_are_carried_to_the_trace():
    """torch's tutorial pattern: one optimizer per parameter stepped from a post-accumulate-grad hook. The trace
    runs the hooks (gradients freed in backward, state built there), matching the measured peak, and leaves the
    user's optimizers, weights and gradients as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    optimizers = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}

    def hook(p):
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    gradient_hook_calls = []
    model[0].bias.register_hook(lambda g: gradient_hook_calls.append(type(g).__name__))
    placeholder = torch.optim.SGD(model.parameters(), lr=0.0)  # steps nothing: every gradient is gone by then
    batch = torch.randn(16, 128)
    step = lambda m, b: m(b).sum()  # noqa: E731
    weights = [p.detach().clone() for p in model.parameters()]
    est = preflight.estimate(model, placeholder, batch, step=step)
    assert gradient_hook_calls == ["FakeTensor", "FakeTensor"]  # one per traced step
    assert all(len(o.state) == 0 for o in optimizers.values())
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    measured = preflight.measure(model, placeholder, batch, step=step)
    assert abs(est.peak_bytes - measured.peak_bytes) <= 0.001 * measured.peak_bytes
    assert est.breakdown["gradients"] == 0  # freed by the hooks before the optimizer phase


def test_past_the_lookup_limit_a_rebound_slot_is_repaired_as_a_leftover_and_said(monkeypatch):
    from preflight.trace import _leftovers

    monkeypatch.setattr(_leftovers._Before, "LOOKUPS", 0)
    model = Touchy()
    try:
        estimate = preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), _batch(), step=None)
        assert "pos" not in STATE  # removed, not given its tensor back: the documented fallback
        assert any("came after the first 0" in n for n in estimate.coverage.notes)
        assert COUNTER.item() == 0  # the tensor itself is still never written
    finally:
        STATE["pos"], HELPER.t = torch.zeros(1), torch.zeros(2)
