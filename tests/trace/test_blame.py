"""User errors are the user's: an exception of the user's own code inside the trace is re-raised (with a note naming
the line), and only what the trace itself cannot do becomes a labelled lower bound."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import preflight


class Raises(nn.Module):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.error = error

    def forward(self, x):
        y = self.lin(x)
        raise self.error


class ReadsAParameterValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x):
        y = self.lin(x)
        return y.sum() if y.sum() > 0 else y.mean()  # data-dependent branch on fake values


class ReadsAFakeStorage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x):
        y = self.lin(x)
        return y.sum() * len(y.untyped_storage().tolist())  # a fake storage has no data


def _line(fn, text: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    return f"test_blame.py:{start + next(i for i, line in enumerate(lines) if text in line)}"


def _estimate(model, batch, step=lambda m, b: m(b)):
    return preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, step=step)


@pytest.mark.parametrize("error", [ValueError("user bug"), RuntimeError("user runtime bug"), KeyError("input_ids"),
                                   AssertionError("shape check")])
def test_an_exception_raised_by_the_users_forward_is_reraised_with_a_note(error):
    with pytest.raises(type(error)) as caught:
        _estimate(Raises(error), torch.randn(4, 8))
    assert caught.value is error
    note = "\n".join(caught.value.__notes__)
    assert "preflight" in note and "real training step raises it too" in note
    assert _line(Raises.forward, "raise self.error") in note


def test_a_batch_of_the_wrong_type_raises_the_users_type_error():
    model = nn.Linear(8, 1)
    with pytest.raises(TypeError, match="must be Tensor, not list") as caught:
        _estimate(model, [1.0, 2.0], step=None)
    assert "preflight" in caught.value.__notes__[0]
    with pytest.raises(TypeError, match="unexpected keyword argument 'x'"):
        _estimate(model, {"x": torch.randn(4, 8)}, step=None)


def test_a_step_with_the_wrong_arity_is_a_clear_type_error_before_tracing():
    with pytest.raises(TypeError, match=r"`step` is called as step\(model, batch\), but its signature is \(m\)"):
        _estimate(nn.Linear(8, 1), torch.randn(4, 8), step=lambda m: m.weight.sum())
    with pytest.raises(TypeError, match="`step` should be a callable"):
        _estimate(nn.Linear(8, 1), torch.randn(4, 8), step="m(b)")


@pytest.mark.parametrize("model, batch, failed", [
    (ReadsAParameterValue(), torch.randn(4, 8), "aten._local_scalar_dense"),
    (ReadsAFakeStorage(), torch.randn(4, 8), "NotImplementedError at"),
    (nn.Sequential(nn.Linear(8, 8), nn.Linear(7, 1)), torch.randn(4, 8), "aten.addmm"),  # a fake kernel's check
])
def test_what_the_trace_cannot_do_stays_a_labelled_lower_bound(model, batch, failed):
    with pytest.warns(RuntimeWarning, match="could not trace"):
        est = _estimate(model, batch, step=lambda m, b: m(b).sum())
    assert est.coverage.lower_bound and failed in est.coverage.failed_op


def test_check_reraises_the_users_error_instead_of_returning_no_verdict():
    model = Raises(ValueError("user bug"))
    with pytest.raises(ValueError, match="user bug"):
        preflight.check(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8),
                        step=lambda m, b: m(b), run=preflight.Run(target=preflight.Target(budget="1GiB")))


def test_check_rejects_a_step_of_the_wrong_arity_before_tracing():
    model = nn.Linear(8, 1)
    with pytest.raises(TypeError, match="`eval_step` is called as eval_step"):
        preflight.check(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8),
                        step=lambda m, b: m(b).sum(), eval_step=lambda m, b, extra: None, run=preflight.Run(target=preflight.Target(budget="1GiB")))


_LIBRARY = '''
import torch
from torch import nn


class PointerKernel(nn.Linear):
    def forward(self, x):
        if x.data_ptr() == 0:  # a C kernel called through ctypes refuses a tensor without data
            raise RuntimeError("null data pointer")
        return super().forward(x)


class PlainOnly(nn.Linear):
    def forward(self, x):
        if type(x) is not torch.Tensor:  # a kernel wrapper that only takes plain tensors
            raise TypeError("plain tensors only")
        return super().forward(x)
'''


@pytest.fixture
def library(tmp_path, monkeypatch):
    """A third-party package installed under a site-packages folder."""
    import importlib
    import sys

    root = tmp_path / "site-packages"
    (root / "quantlib").mkdir(parents=True)
    (root / "quantlib" / "__init__.py").write_text(_LIBRARY)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "quantlib", raising=False)
    return importlib.import_module("quantlib")


@pytest.mark.parametrize("layer", ["PointerKernel", "PlainOnly"])
def test_a_library_failing_only_on_fake_tensors_is_a_coverage_gap_not_the_users_error(library, layer):
    model = nn.Sequential(getattr(library, layer)(8, 8), nn.Linear(8, 1))
    batch = torch.randn(4, 8)
    model(batch).sum().backward()  # the real step trains
    with pytest.warns(RuntimeWarning, match="could not trace"):
        est = _estimate(model, batch, step=lambda m, b: m(b).sum())
    assert est.coverage.lower_bound and "quantlib/__init__.py" in est.coverage.failed_op
    # check (what the callbacks call) does not stop the run: a lower bound under the budget is no verdict
    verdict = preflight.check(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, step=lambda m, b: m(b).sum(),
                              run=preflight.Run(target=preflight.Target(budget="1GiB")))
    assert verdict.fits is not False and verdict.estimate.coverage.lower_bound


def test_a_jagged_nested_tensor_batch_is_a_labelled_lower_bound_not_an_internal_error():
    model = nn.Linear(8, 1)
    batch = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=torch.jagged)
    step = lambda m, b: m(b).values().sum()  # noqa: E731
    step(model, batch)  # the real step runs
    with pytest.warns(RuntimeWarning, match="nested"):
        est = _estimate(model, batch, step=step)
    assert est.coverage.lower_bound and "fake copies" in est.coverage.failed_op
