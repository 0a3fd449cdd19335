"""`preflight._guard.untouched`: each distinct warning raised inside is shown once, filters still apply."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import preflight
from preflight._guard import untouched


class Warns(nn.Module):
    """Warns in every forward, then opens and closes a ``catch_warnings`` as libraries do, which invalidates the
    registries that keep a shown warning from repeating."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warnings.warn("this layer is deprecated", UserWarning)
        with warnings.catch_warnings():
            pass
        return self.linear(x)


def _shown(caught: list[warnings.WarningMessage], text: str) -> int:
    return sum(text in str(w.message) for w in caught)


def test_a_warning_raised_on_every_ranks_trace_is_shown_once():
    # 2 FSDP2 ranks x 2 steps trace the forward 4 times (more with the evaluation); "always" would show each.
    model = Warns()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(4, 8),
                                 step=lambda m, b: m(b).sum(),
                                 run=preflight.Run(parallel=preflight.ParallelPlan(2, "fsdp2")))
    assert est.per_rank_peak_bytes is not None and len(est.per_rank_peak_bytes) == 2
    assert _shown(caught, "this layer is deprecated") == 1
    with warnings.catch_warnings(record=True) as caught:  # the window is closed: the user's own warnings repeat
        warnings.simplefilter("always")
        model(torch.randn(1, 8))
        model(torch.randn(1, 8))
    assert _shown(caught, "this layer is deprecated") == 2


def test_distinct_warnings_are_each_shown_and_filters_still_apply():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with untouched():
            for text in ("a", "b", "a", "b", "a"):
                warnings.warn(text, UserWarning)  # one line: the texts tell them apart
            warnings.warn("a", RuntimeWarning)  # another category, another line
            with warnings.catch_warnings(record=True) as inner:  # a recorder inside still sees every one
                warnings.simplefilter("always")
                warnings.warn("a", UserWarning)
                warnings.warn("a", UserWarning)
    assert [(w.category, str(w.message)) for w in caught] == [(UserWarning, "a"), (UserWarning, "b"),
                                                               (RuntimeWarning, "a")]
    assert len(inner) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="stop"), untouched():
            warnings.warn("stop", UserWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")
        with untouched():
            warnings.warn("dropped", UserWarning)
    assert caught == []
    assert warnings.showwarning is warnings._showwarning_orig  # put back
