"""The decision layer: eval and trainer-schedule predictions against measurement, verdict, errors, dry run, outputs."""

from __future__ import annotations

import copy
import io
import json
import re
import sys
import warnings

import pytest
import torch
from conftest import lm_batch, make_gpt2, make_llama

import preflight
from preflight.verdict import Options, VerifySession, check, decide, eval_resident, internal_failures, predict
from preflight._device import live_storage_bytes
from preflight._eval import estimate_eval
from preflight._measure import cpu_profiled_peak
from preflight._steps import Loop, compute_loss
from preflight._verify import StepPeakMeter
from preflight.cuda import WORKSPACE_UIDS

REQUIRED = ("version", "device", "budget_bytes", "predicted_peak_bytes", "predicted_breakdown", "peak_phase",
            "eval_predicted_peak_bytes", "worst_case_batch_shape", "fits", "coverage", "measured_peak_bytes",
            "relative_error", "steps_measured")


def _profiled(fn, *tensors) -> int:
    """Bytes alive before ``fn`` (``tensors``) plus the profiled peak of ``fn``: how preflight.measure counts."""
    before = live_storage_bytes(list(tensors), torch.device("cpu"))
    peak, _ = cpu_profiled_peak(fn)
    return before + peak


@pytest.mark.parametrize("make", [make_gpt2, make_llama])
def test_eval_step_matches_a_profiled_no_grad_forward(make):
    model = make()
    batch = lm_batch(4, 96)
    est = estimate_eval(model, batch, resident={"optimizer_state": 4096})
    assert est.peak_phase == "eval/forward" and est.breakdown["optimizer_state"] == 4096
    assert model.training  # restored

    def forward():
        with torch.no_grad():
            del_out = model(**batch)
            del del_out

    model.eval()
    measured = _profiled(forward, list(model.parameters()), list(model.buffers()), batch) + 4096
    assert abs(est.peak_bytes - measured) <= 128


def _state(model, optimizer, batch):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [list(model.parameters()), grads, [list(s.values()) for s in optimizer.state.values()], batch]


@pytest.mark.slow
def test_lightning_order_keeps_gradients_through_the_next_forward():
    # Parameter-heavy and activation-light: the peak is the forward with last step's gradients alive.
    model = make_gpt2(n_layer=2, n_embd=128)
    real = copy.deepcopy(model)
    batch = lm_batch(2, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    est = preflight.estimate(model, optimizer, batch, run=preflight.Run(loop=preflight.Loop(zero_grad="before_backward")))
    plain = preflight.estimate(model, optimizer, batch)
    assert not optimizer.state and all(p.grad is None for p in model.parameters())

    real_opt = torch.optim.AdamW(real.parameters())

    def lightning_step():  # lightning/pytorch/loops/optimization/automatic.py: training_step, zero_grad, backward
        loss = compute_loss(real, batch, None)
        real_opt.zero_grad()
        loss.backward()
        del loss
        real_opt.step()

    # Measured step by step as verification does: step 2 frees the gradients step 1 made, which the profiler
    # reports only if it saw them allocated.
    meter = StepPeakMeter(torch.device("cpu"))
    for _ in range(2):
        meter.start(_state(real, real_opt, batch))
        lightning_step()
        meter.stop()
    measured = meter.step_peaks[1]
    assert est.peak_phase == "step2/forward"
    assert abs(est.peak_bytes - measured) / measured < 0.001
    assert est.peak_bytes > plain.peak_bytes * 1.05


@pytest.mark.slow
def test_accumulation_keeps_gradients_across_micro_batches():
    model = make_gpt2(n_layer=2, n_embd=64)
    real = copy.deepcopy(model)
    batch = lm_batch(4, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    est = preflight.estimate(model, optimizer, batch, run=preflight.Run(loop=preflight.Loop(accumulate=4)))

    real_opt = torch.optim.AdamW(real.parameters())

    def hf_step():  # transformers Trainer: micro-batches forward+backward, then step and zero_grad
        for _ in range(4):
            loss = compute_loss(real, batch, None)
            loss.backward()
            del loss
        real_opt.step()
        real_opt.zero_grad(set_to_none=True)

    hf_step()
    measured = _profiled(hf_step, *_state(real, real_opt, batch))
    assert abs(est.peak_bytes - measured) / measured < 0.001


def _check(budget=None, **kwargs):
    model = make_gpt2(n_layer=1, n_embd=32)
    optimizer = torch.optim.AdamW(model.parameters())
    options = Options(suggest=False, **kwargs)
    run = preflight.Run(target=preflight.Target(budget=budget))
    return predict(model, optimizer, lm_batch(2, 16), run, options=options, eval_batch=lm_batch(4, 16)), options


def test_report_has_the_issue_fields_and_is_json():
    report, _ = _check(budget="1GiB")
    data = json.loads(json.dumps(report.to_dict()))
    assert set(REQUIRED) <= set(data)
    assert data["fits"] is True and data["budget_bytes"] == 2**30
    assert data["eval_predicted_peak_bytes"] > 0
    assert sum(data["predicted_breakdown"].values()) == data["predicted_peak_bytes"]


def test_overflow_raises_with_numbers_and_warn_mode_warns():
    report, options = _check(budget=100_000)
    assert report.fits is False
    with pytest.raises(preflight.PreflightError) as info:
        decide(report, options)
    message = str(info.value)
    assert "over the usable" in message and "KiB" in message and "on_overflow='warn'" in message
    assert info.value.report["fits"] is False
    _, warn_options = _check(budget=100_000, on_overflow="warn")
    with pytest.warns(RuntimeWarning, match="over the usable") as warned:
        decide(report, warn_options)
    # Training goes on under "warn": the warning says so, not that nothing was trained.
    text = str(warned[0].message)
    assert "Training goes on" in text and "Nothing was trained" not in text
    assert "Nothing was trained" in message


def test_the_prediction_says_what_it_is_doing(capsys):
    """A trace takes seconds: the callbacks say so on stderr (rank zero), as the CLI does."""
    _check(budget="1GiB")
    err = capsys.readouterr().err
    assert "preflight: tracing the training step on fake tensors ..." in err
    assert "preflight: tracing the training step on fake tensors: done in" in err
    assert "preflight: tracing the evaluation step on fake tensors: done in" in err


def test_no_budget_on_cpu_gives_no_verdict():
    report, options = _check()
    assert report.fits is None and report.usable_bytes is None
    assert decide(report, options) is report


def test_suggestions_are_ranked_into_the_error(monkeypatch):
    import preflight.advice as _advise

    class Suggestion:
        def __init__(self, description, peak, fits):
            self.description, self.predicted_peak_bytes, self.fits = description, peak, fits
            self.change, self.cost = {"micro_batch_size": 1}, "slower"
            self.changes = ("micro_batch",)

        def to_dict(self):
            return {"description": self.description, "predicted_peak_bytes": self.predicted_peak_bytes,
                    "fits": self.fits, "change": self.change, "cost": self.cost}

    monkeypatch.setattr(_advise, "advise", lambda *a, **k: [Suggestion("micro-batch 1 x 2", 90_000, True)])
    model = make_gpt2(n_layer=1, n_embd=32)
    options = Options()
    run = preflight.Run(target=preflight.Target(budget=200_000))
    report = predict(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 16), run, options=options)
    assert report.suggestions[0]["fits"] is True
    with pytest.raises(preflight.PreflightError, match="micro-batch 1 x 2"):
        decide(report, options)

    def broken(*a, **k):
        raise RuntimeError("no advice today")

    monkeypatch.setattr(_advise, "advise", broken)
    report = predict(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 16), run, options=options)
    assert report.suggestions == [] and "no advice today" in report.warnings[0]


@pytest.mark.parametrize(("budget", "code"), [("1GiB", 0), (100_000, 3)])
def test_dry_run_exits_with_the_verdict(monkeypatch, budget, code, tmp_path):
    monkeypatch.setenv("PREFLIGHT_DRY_RUN", "1")
    report, options = _check(budget=budget, report_path=str(tmp_path / "r.json"))
    with pytest.raises(SystemExit) as info:
        decide(report, options)
    assert info.value.code == code
    assert json.loads((tmp_path / "r.json").read_text())["fits"] is (code == 0)


def test_dry_run_after_a_failed_prediction_is_not_success(monkeypatch):
    monkeypatch.setenv("PREFLIGHT_DRY_RUN", "1")
    with pytest.raises(SystemExit) as info:
        decide(None, Options())
    assert info.value.code == 1


def test_public_check_raises_and_honours_preflight_check_environment(monkeypatch, tmp_path):
    model = make_gpt2(n_layer=1, n_embd=32)
    with pytest.raises(preflight.PreflightError):
        check(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 16), run=preflight.Run(target=preflight.Target(budget=100_000)), suggest=False)
    # `preflight check -- python train.py` asks through the environment (preflight._dryrun): a larger budget
    # and a report path win over the arguments.
    monkeypatch.setenv("PREFLIGHT_BUDGET", "1GiB")
    monkeypatch.setenv("PREFLIGHT_REPORT", str(tmp_path / "cli.json"))
    report = check(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 16), run=preflight.Run(target=preflight.Target(budget=100_000)), suggest=False)
    assert report.fits is True and report.budget_bytes == 2**30
    data = json.loads((tmp_path / "cli.json").read_text())
    assert data["predicted_required_bytes"] == report.verdict_bytes


def test_internal_failures_become_warnings_but_preflight_errors_pass():
    with pytest.warns(RuntimeWarning, match="the prediction failed and was skipped.*boom"):
        with internal_failures("the prediction"):
            raise KeyError("boom")
    with pytest.raises(preflight.PreflightError):
        with internal_failures("the prediction"):
            raise preflight.PreflightError("over")


def test_verify_session_fills_the_report(tmp_path):
    model = make_gpt2(n_layer=1, n_embd=32)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = lm_batch(2, 16)
    report, _ = _check()
    options = Options(verify_steps=2, report_path=str(tmp_path / "r.json"))
    session = VerifySession(report, options, torch.device("cpu"))
    from preflight._steps import run_steps

    for _ in range(2):
        session.step_started(_state(model, optimizer, batch) + [list(model.buffers())])
        run_steps(model, optimizer, batch, step=None, precision=None, device_type="cpu", steps=1)
        finished = session.step_ended()
    assert finished and not session.active
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["steps_measured"] == 2 and data["measured_peak_bytes"] > 0
    assert data["relative_error"] is not None


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"on_overflow": "stop"}, "either of"), ({"headroom": 1.5}, "headroom"), ({"verify_steps": -1}, "verify_steps"),
    ({"check_eval": "yes"}, "check_eval"),
])
def test_options_are_checked_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Options(**kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [({"budget": "lots"}, "Cannot read"), ({"gpu": "Z9000"}, "Z9000")])
def test_the_target_is_checked_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        preflight.Target(**kwargs)


def test_console_and_plot(tmp_path, capsys, monkeypatch):
    from preflight.report._console import format_report, print_report
    from preflight.report._plot import plot_report

    report, _ = _check(budget="1GiB")
    print_report(report)
    out = capsys.readouterr().out
    assert "training peak" in out and "fits" in out
    assert "worst-case batch" in format_report(report)
    plot_report(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install matplotlib \(or, in your preflight clone, pip install -e '\.\[plot\]'\)"):
        plot_report(report, tmp_path / "s.png")
    monkeypatch.setitem(sys.modules, "rich.console", None)
    print_report(report)  # plain text without rich
    assert "training peak" in capsys.readouterr().out
    warnings.resetwarnings()


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("with_rich", [True, False])
def test_tables_render_for_the_terminal_width(monkeypatch, with_rich):
    from preflight.report._console import print_report

    report, _ = _check(budget="1GiB")
    report.worst_case_batch = {"method": "scanned", "note": "largest 4 of all 24 samples, by total tokens per sample"}
    report.suggestions = [{"fits": True, "description": "micro-batch 2 with gradient accumulation 2 (global batch "
                                                        "kept): 123.45 MiB, 48% of usable"}]
    report.warnings.append("precision '64-true' is traced with the tensors' own dtypes (not modelled) and "
                           "{'input_ids': [16, 256], 'labels': [16, 256]} is the eval batch")
    if not with_rich:
        monkeypatch.setitem(sys.modules, "rich.console", None)
    monkeypatch.setenv("COLUMNS", "80")
    terminal = _Terminal()
    print_report(report, file=terminal)
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in terminal.getvalue().splitlines()]
    assert lines and all(len(line) <= 80 for line in lines), lines
    assert not [line for line in lines if line != line.rstrip()], "trailing spaces"
    text = "\n".join(lines)
    for whole in ("[16, 256]", "123.45 MiB", "'64-true'", str(report.worst_case_batch_shape["input_ids"])):
        assert whole in text, (whole, text)  # wrapped between values, never inside one
    assert len([line for line in lines if line.strip()]) > 10

    piped = io.StringIO()  # not a terminal: every value on one line, however long
    print_report(report, file=piped)
    out = re.sub(r"\x1b\[[0-9;]*m", "", piped.getvalue())
    assert report.warnings[-1] in out and not [line for line in out.splitlines() if line != line.rstrip()]


def test_gpu_verdict_uses_the_device_total():
    # On a GPU target the need is reserved memory + CUDA context + cuBLAS workspace, as `preflight estimate` says.
    model = make_gpt2(n_layer=1, n_embd=32)
    optimizer = torch.optim.AdamW(model.parameters())
    options = Options(headroom=0.0, suggest=False)
    run = preflight.Run(target=preflight.Target(gpu="H100-80GB", budget="100MiB"))
    report = predict(model, optimizer, lm_batch(2, 16), run, options=options)
    assert report.predicted_peak_bytes < 100 * 2**20 < report.predicted_device_total_bytes
    assert report.verdict_bytes == report.predicted_device_total_bytes
    assert report.fits is False


def test_the_eval_step_is_planned_for_the_gpu_too():
    # Under gpu= the evaluation forward is traced for the CUDA target (512-byte blocks, the GPU's kernels), as
    # estimate_eval(gpu=...) does on its own, not for the CPU model's device.
    model = make_gpt2(n_layer=1, n_embd=32)
    optimizer = torch.optim.AdamW(model.parameters())
    options = Options(suggest=False)
    run = preflight.Run(target=preflight.Target(gpu="H100-80GB", budget="80GiB"))
    report = predict(model, optimizer, lm_batch(2, 16), run, options=options, eval_batch=lm_batch(3, 15))
    assert report.eval_estimate.device == "cuda"
    resident = {k: v for k, v in eval_resident(model, optimizer, precision=None, schedule=Loop()).items() if v}
    alone = estimate_eval(model, lm_batch(3, 15), run=preflight.Run(target=preflight.Target(gpu="H100-80GB")), resident=resident)
    # plus the autograd thread's cuBLAS workspace, resident since the training step's backward
    assert report.eval_predicted_peak_bytes == alone.peak_bytes + 32 * 2**20
    # 3 x 15 tokens x 32 floats is not a multiple of 512 B: the CPU figure differs
    assert report.eval_predicted_peak_bytes > estimate_eval(model, lm_batch(3, 15), resident=resident).peak_bytes
    # Its CUDA terms: the forward thread's cuBLAS workspace (the autograd thread's is resident from training),
    # reserved memory and the context, in the verdict's figure.
    assert [e.nbytes for e in alone.events if e.uid in WORKSPACE_UIDS] == [32 * 2**20]
    assert report.eval_estimate.breakdown["temporaries"] >= 2 * 32 * 2**20
    assert report.eval_predicted_device_total_bytes == report.eval_estimate.device_total_bytes
    assert report.eval_predicted_device_total_bytes > report.eval_estimate.peak_reserved_bytes >= \
        report.eval_predicted_peak_bytes
    assert report.verdict_bytes == max(report.predicted_device_total_bytes, report.eval_predicted_device_total_bytes)


def test_check_raises_for_a_step_without_a_loss():
    model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="step="):
        check(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 8), run=preflight.Run(target=preflight.Target(budget="1GiB")))


@pytest.mark.parametrize("budget, error, message", [
    (float("nan"), ValueError, "`budget`: A size should be a finite number of bytes, got nan"),
    (float("inf"), ValueError, "`budget`: A size should be a finite number of bytes, got inf"),
    pytest.param(10**400, ValueError, "`budget`: 1000.*more than any memory", id="400-digits"),
    (0, ValueError, "`budget` should be more than 0 bytes, got 0"),
])
def test_an_unusable_budget_is_an_error_naming_budget(budget, error, message):
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=message):
        check(model, optimizer, torch.randn(2, 8), step=lambda m, b: m(b).sum(), run=preflight.Run(target=preflight.Target(budget=budget)))
    with pytest.raises(error, match=message):
        preflight.advise(model, optimizer, torch.randn(2, 8), step=lambda m, b: m(b).sum(), run=preflight.Run(target=preflight.Target(budget=budget)))


def test_a_numpy_integer_budget_is_accepted():
    np = pytest.importorskip("numpy")
    model = torch.nn.Linear(8, 1)
    report = check(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 8),
                   step=lambda m, b: m(b).sum(), run=preflight.Run(target=preflight.Target(budget=np.int64(2**30))), suggest=False)
    assert report.budget_bytes == 2**30 and report.fits is True


def test_measure_with_steps_of_the_wrong_type_is_a_clear_type_error():
    model = torch.nn.Linear(8, 1)
    with pytest.raises(TypeError, match="`steps` should be a positive integer .*got str '2'"):
        preflight.measure(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 8),
                          step=lambda m, b: m(b).sum(), run=preflight.Run(loop=preflight.Loop(steps="2")))


def test_the_overflow_message_of_a_rank_whose_prediction_failed_has_no_empty_batch_line():
    from preflight.verdict._decide import _overflow_message
    from preflight.verdict import lower_bound_report

    model = make_gpt2(n_layer=1, n_embd=32)
    report = lower_bound_report(model, torch.optim.AdamW(model.parameters()), Options(headroom=0.0),
                                preflight.Run(target=preflight.Target(budget="100KiB")), device=torch.device("cpu"),
                                reason="a test")
    assert report.fits is False
    message = _overflow_message(report, [], False)
    assert "(training peak)" in message and "worst-case batch" not in message and "None" not in message


def test_the_overflow_message_names_the_evaluation_when_its_device_total_decides():
    from preflight.verdict._decide import _overflow_message

    model = make_gpt2(n_layer=1, n_embd=32)
    options = Options(headroom=0.0, suggest=False)
    run = preflight.Run(target=preflight.Target(gpu="H100-80GB", budget="600MiB"))
    report = predict(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 16), run, options=options,
                     eval_batch=lm_batch(64, 128))
    assert report.eval_predicted_device_total_bytes > report.predicted_device_total_bytes
    assert report.verdict_bytes == report.eval_predicted_device_total_bytes and report.fits is False
    assert "(evaluation peak)" in _overflow_message(report, [], False)


def test_the_options_are_planned_under_the_runs_plan(monkeypatch):
    """`options_plan`: the plan the suggestions and the HF batch step-down predict each option under."""
    from preflight.verdict import options_plan
    from preflight.parallel import ParallelPlan, fsdp_plan

    model = make_gpt2(n_layer=1, n_embd=32)
    full = fsdp_plan("FULL_SHARD", world_size=4)
    assert options_plan(model, full) is full
    assert options_plan(model, ParallelPlan(4, "ddp")) == ParallelPlan(4, "ddp")  # DDP's ranks: per rank too
    assert options_plan(model, None) is None and options_plan(model, ParallelPlan(1, None)) is None
    # A model the strategy already sharded (here marked as DeepSpeed ZeRO-3 marks its parameters) has no plan to
    # follow: dividing its shards again would be wrong.
    zero3 = make_gpt2(n_layer=1, n_embd=32)
    next(zero3.parameters()).ds_numel = 123
    assert options_plan(zero3, full) is None
    # `preflight check --world-size 8 --sharding zero2` takes precedence over the trainer's plan.
    monkeypatch.setenv("PREFLIGHT_WORLD_SIZE", "8")
    monkeypatch.setenv("PREFLIGHT_SHARDING", "zero2")
    planned = options_plan(model, full)
    assert (planned.world_size, planned.sharding) == (8, "zero2")


def test_a_deepspeed_16_bit_plan_predicts_training_and_evaluation_as_deepspeed_casts_the_model():
    # DeepSpeed's bf16 mode casts the model: training, the resident state and evaluation are all the cast model's.
    from conftest import Stack

    from preflight.parallel import deepspeed_plan

    plan = deepspeed_plan({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}, "bf16": {"enabled": True}},
                          world_size=2)
    reports = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = Stack(depth=2, width=64).to(dtype)
        x = torch.randn(4, 64).to(dtype)
        reports.append(predict(model, torch.optim.AdamW(model.parameters()), x,
                               preflight.Run(target=preflight.Target(budget="1GiB"), parallel=plan),
                               step=lambda m, b: m(b), options=Options(suggest=False), eval_batch=x))
    planned, cast = reports
    assert planned.predicted_peak_bytes == cast.predicted_peak_bytes
    assert planned.eval_predicted_peak_bytes == cast.eval_predicted_peak_bytes is not None


def test_resident_bytes_the_profiler_cannot_see_are_added_to_its_measurement_only():
    # DDP's buckets and a callback's model copies were allocated before the CPU profiler starts, so they are added
    # to what it measures; the CUDA allocator's peak counts every allocated byte already (added again, they were
    # counted twice on a GPU).
    import types

    session = VerifySession(None, Options(verify_steps=1), torch.device("cpu"), extra_resident_bytes=4096)
    session.meter = types.SimpleNamespace(method="cpu-profiler")
    assert session._unseen() == 4096
    session.meter = types.SimpleNamespace(method="cuda-allocator")
    assert session._unseen() == 0
