"""A step the real run would stop at (dtype or device mismatch, index out of range) is an error, never a peak.

Each case runs the real step first and asserts that preflight raises `StepWouldFailError` carrying the real
kernel's message and exception type, naming the operator, the user's line and the tensors.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import preflight
from preflight import StepWouldFailError
from tests.conftest import VOCAB, lm_batch, make_gpt2


def _real_error(model: nn.Module, batch, step, precision: str | None = None) -> BaseException:
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else torch.autocast("cpu",
                                                                                                        enabled=False)
    try:
        with ctx:
            step(model, batch).backward()
    except (RuntimeError, IndexError) as err:
        model.zero_grad(set_to_none=True)
        return err
    raise AssertionError("the real step did not fail")


def _predicted_error(model: nn.Module, batch, step=None, run=None) -> StepWouldFailError:
    with pytest.raises(StepWouldFailError) as info:
        preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, run, step=step)
    return info.value


def _linear_step(m, b):
    return m(b).sum()


@pytest.mark.parametrize("dtype, precision", [(torch.float64, None), (torch.bfloat16, None),
                                              (torch.float64, "bf16-mixed")])
def test_a_batch_of_another_dtype_into_a_linear(dtype, precision):
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    batch = torch.randn(2, 8, dtype=dtype)
    real = _real_error(model, batch, _linear_step, precision)
    err = _predicted_error(model, batch, _linear_step, run=preflight.Run(precision=precision))
    assert str(real) in str(err) and type(err.__cause__) is type(real)
    assert "aten.addmm" in str(err) and "test_step_checks.py" in str(err)  # the operator and the user's line
    assert f"the batch ({str(dtype).removeprefix('torch.')} 2x8)" in str(err)
    assert "parameter '0.weight'" in str(err) or precision  # under autocast the weight reaching it is a cast copy


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_what_autocast_or_a_true_precision_casts_is_not_a_mismatch(precision):
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(2, 8), step=_linear_step,
                             run=preflight.Run(precision=precision))
    assert est.coverage.traced and est.peak_bytes > 0


def test_a_batch_of_another_dtype_into_a_convolution():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    batch = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    real = _real_error(model, batch, _linear_step)
    err = _predicted_error(model, batch, _linear_step)
    assert str(real) in str(err) and "conv.py" in str(err) and "test_step_checks.py" in str(err)


class _ExpertLoop(nn.Module):
    """Experts' outputs summed into an fp32 buffer with `index_add_` (DBRX's loop): under bf16 autocast the
    experts compute in bf16 and the real kernel refuses the mix."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = nn.Linear(8, 8)

    def forward(self, x):
        out = torch.zeros_like(x)
        rows = torch.arange(x.shape[0])
        return out.index_add_(0, rows, self.expert(x))


class _MaskedScores(nn.Module):
    """Attention scores masked with float32's minimum whatever their dtype (DeBERTa's `masked_fill`)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        scores = self.proj(x)
        return scores.masked_fill(x < 0, torch.finfo(torch.float32).min).clamp(min=-1e4)


@pytest.mark.parametrize("module", [_ExpertLoop, _MaskedScores])
def test_dtype_and_fill_value_mismatches_under_autocast(module):
    torch.manual_seed(0)
    model, batch = module(), torch.randn(4, 8)
    real = _real_error(model, batch, _linear_step, "bf16-mixed")
    err = _predicted_error(model, batch, _linear_step, run=preflight.Run(precision="bf16-mixed"))
    assert str(real) in str(err) and type(err.__cause__) is type(real)
    assert "test_step_checks.py" in str(err)
    # In fp32 both steps run, and are predicted.
    assert preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, step=_linear_step).coverage.traced


def test_token_ids_beyond_the_vocabulary():
    model = make_gpt2()
    batch = lm_batch(2, 16)
    batch["input_ids"] = batch["input_ids"].clone()
    batch["input_ids"][1, 3] = VOCAB + 7
    real = _real_error(model, batch, lambda m, b: m(**b).loss)
    err = _predicted_error(model, batch)
    assert str(real) in str(err) and type(err.__cause__) is IndexError
    assert "parameter 'transformer.wte.weight'" in str(err) and "the batch['input_ids']" in str(err)
    assert f"id {VOCAB + 7}" in str(err) and f"{VOCAB} rows" in str(err)


def test_a_sequence_longer_than_the_position_table():
    model = make_gpt2()  # 256 positions
    batch = lm_batch(1, 300)
    real = _real_error(model, batch, lambda m, b: m(**b).loss)
    err = _predicted_error(model, batch)
    assert str(real) in str(err)
    assert "parameter 'transformer.wpe.weight'" in str(err) and "truncate sequences to 256 tokens" in str(err)


def test_labels_beyond_the_classes():
    model = make_gpt2()
    batch = lm_batch(2, 16)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][0, 5] = VOCAB + 3
    real = _real_error(model, batch, lambda m, b: m(**b).loss)
    err = _predicted_error(model, batch)
    assert str(real) == f"Target {VOCAB + 3} is out of bounds." and str(real) in str(err)
    assert "aten.nll_loss_forward" in str(err)


def test_ignored_labels_and_in_range_ids_pass():
    model = make_gpt2()
    batch = lm_batch(2, 256)  # the whole position table
    batch["labels"] = batch["labels"].clone()
    batch["labels"][:, :10] = -100
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch)
    assert est.coverage.traced


def test_index_ops_on_shadowed_indices():
    table = nn.Parameter(torch.randn(5, 3))

    class Lookup(nn.Module):
        def __init__(self, op: str) -> None:
            super().__init__()
            self.table, self.op = table, op

        def forward(self, idx):
            if self.op == "index_select":
                return self.table.index_select(0, idx).sum()
            if self.op == "gather":
                return self.table.gather(0, idx[:, None].expand(-1, 3)).sum()
            return self.table[idx].sum()

    for op in ("index_select", "gather", "index"):
        model, batch = Lookup(op), torch.tensor([0, 4, 9])
        real = _real_error(model, batch, lambda m, b: m(b))
        err = _predicted_error(model, batch, lambda m, b: m(b))
        assert str(real) in str(err), op
        model, batch = Lookup(op), torch.tensor([0, 4])
        assert preflight.estimate(model, torch.optim.SGD(model.parameters()), batch,
                                  step=lambda m, b: m(b)).coverage.traced
    # Negative indices count from the end for advanced indexing.
    model = Lookup("index")
    assert preflight.estimate(model, torch.optim.SGD(model.parameters()), torch.tensor([-5, -1]),
                              step=lambda m, b: m(b)).coverage.traced


def test_a_tensor_created_on_another_device():
    class Offset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return (self.lin(x) + torch.ones(8, device="meta")).sum()  # forgot device=x.device

    model, batch = Offset(), torch.randn(2, 8)
    real = _real_error(model, batch, _linear_step)
    err = _predicted_error(model, batch, _linear_step)
    assert "on the same device" in str(err) and "cpu and meta" in str(err) and "test_step_checks.py" in str(err)
    assert "meta" in str(real)


def test_check_raises_it_instead_of_warning():
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    with pytest.raises(StepWouldFailError, match="mat1 and mat2 must have the same dtype"):
        preflight.check(model, torch.optim.SGD(model.parameters()), torch.randn(2, 8, dtype=torch.float64),
                        step=_linear_step, run=preflight.Run(target=preflight.Target(budget="1GiB")))


@pytest.mark.slow
def test_preflight_check_exits_5_with_the_reason(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, preflight
        model = torch.nn.Linear(8, 4)
        preflight.check(model, torch.optim.SGD(model.parameters()), torch.randn(2, 8, dtype=torch.float64),
                        preflight.Run(target=preflight.Target(budget="1GiB")), step=lambda m, b: m(b).sum())
        raise SystemExit("training ran in a dry run")
    """))
    result = subprocess.run([sys.executable, "-m", "preflight", "check", "--", sys.executable, str(script)],
                            capture_output=True, text=True)
    assert result.returncode == 5, result.stderr
    assert "THE STEP WOULD FAIL" in result.stderr and "mat1 and mat2 must have the same dtype" in result.stderr


def test_dtensor_mixing_is_explained_by_where_it_happens():
    from preflight.trace._step_checks import mixed_dtensor_failure

    err = RuntimeError("aten.add.Tensor got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to "
                       "DTensor before calling distributed operators!")
    in_step = mixed_dtensor_failure(err, "aten._foreach_add_.List at adamw.py:1 in _multi_tensor_adamw "
                                         "(step1/optimizer)")
    in_forward = mixed_dtensor_failure(err, "aten.add.Tensor at model.py:9 in forward (step1/forward)")
    assert "foreach=False on the optimizer" in in_step and "foreach" not in in_forward
    assert "a tensor the parallel layout does not distribute meets one it does" in in_forward
    assert mixed_dtensor_failure(RuntimeError("shapes differ"), "x (step1/forward)") is None
