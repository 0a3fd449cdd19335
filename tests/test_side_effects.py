"""Nothing global changes: every entry point leaves the random streams, the trained weights, warning filters and
logging configuration as a run without preflight has them, including its first call in a fresh process."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import preflight
from preflight import _guard
from preflight._guard import untouched

HERE = Path(__file__).resolve().parent
TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 64}


def _state_after(entry: str, *extra: str, without: bool = False) -> dict:
    args = [sys.executable, str(HERE / "side_effects.py"), entry, *extra] + (["--without"] if without else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("SIDE_EFFECTS "))
    return json.loads(line.removeprefix("SIDE_EFFECTS "))


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["estimate", "check", "check-over", "cli", "accelerate", "lightning", "hf"])
def test_a_run_through_an_entry_point_ends_as_a_run_without_preflight(entry, tmp_path):
    if entry == "lightning":
        pytest.importorskip("lightning")
    if entry in ("hf", "cli", "accelerate"):
        pytest.importorskip("transformers" if entry != "accelerate" else "accelerate")
    extra = ()
    if entry == "cli":
        config = tmp_path / "config.json"
        config.write_text(json.dumps(TINY_LLAMA))
        extra = (str(config),)
    elif entry == "hf":
        extra = (str(tmp_path / "out"),)
    with_preflight = _state_after(entry, *extra)
    without = _state_after(entry, *extra, without=True)
    # Loggers a library configured on import (transformers, boto3 when preflight.advise imports peft) are the
    # library's; every logger the run without preflight has must be configured alike.
    with_preflight["logging"] = {k: v for k, v in with_preflight["logging"].items() if k in without["logging"]}
    for key in without:
        assert with_preflight[key] == without[key], (key, with_preflight[key], without[key])


class FakeCuda:
    """The CUDA generators, as `preflight._guard.CUDA` sees them, on a machine without CUDA."""

    def __init__(self) -> None:
        self.states = [torch.tensor([1, 2, 3], dtype=torch.uint8)]

    def get(self):
        return [s.clone() for s in self.states]

    def set(self, states):
        self.states = [s.clone() for s in states]


def test_untouched_restores_every_stream_filter_and_logger(monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setattr(_guard, "CUDA", cuda)
    library = logging.getLogger("preflight_test.library")
    before = (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state(), list(warnings.filters),
              logging.root.level, list(logging.root.handlers), library.level, list(library.handlers))
    with untouched():
        random.random()
        np.random.rand()
        torch.rand(3)
        cuda.states = [torch.tensor([9, 9, 9], dtype=torch.uint8)]  # a CUDA draw
        warnings.filterwarnings("ignore", message="added inside")
        logging.root.setLevel(logging.CRITICAL)
        logging.root.addHandler(logging.NullHandler())
        library.setLevel(logging.ERROR)
        library.addHandler(logging.NullHandler())
        library.addFilter(lambda record: False)
    assert random.getstate() == before[0]
    assert np.random.get_state()[1].tolist() == before[1]
    assert torch.equal(torch.get_rng_state(), before[2])
    assert cuda.states[0].tolist() == [1, 2, 3]
    assert list(warnings.filters) == before[3]
    assert (logging.root.level, list(logging.root.handlers)) == (before[4], before[5])
    assert (library.level, list(library.handlers), library.filters) == (before[6], before[7], [])


class ShapeMismatch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(7, 1)

    def forward(self, x):
        return self.b(self.a(x)).sum()


def test_fake_tensor_tracebacks_of_a_handled_failure_are_not_logged_and_others_are():
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    seen: list[logging.LogRecord] = []
    catch = logging.Handler()
    catch.emit = seen.append
    logger.addHandler(catch)
    filters = list(logger.filters)
    try:
        model = ShapeMismatch()
        with pytest.warns(RuntimeWarning, match="could not trace"):
            est = preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8),
                                     step=lambda m, b: m(b))
        assert est.coverage.lower_bound and "aten.addmm" in est.coverage.failed_op
        assert seen == []  # preflight reported the failure itself, with the operator and the line
        assert logger.filters == filters
        # Outside preflight's trace torch's own logging is untouched.
        from torch._subclasses.fake_tensor import FakeTensorMode

        with pytest.raises(RuntimeError), FakeTensorMode():
            torch.randn(4, 8) @ torch.randn(7, 1)
        assert [r.msg for r in seen] == ["failed while attempting to run meta for %s"]
    finally:
        logger.removeHandler(catch)
