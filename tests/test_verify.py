"""Step-by-step measurement of real training steps, and how it is compared with the prediction."""

from __future__ import annotations

import copy

import pytest
import torch

import preflight
from preflight._steps import run_steps
from preflight._verify import StepPeakMeter, compare, summary
from conftest import lm_batch, make_gpt2


def _resident(model, optimizer, batch):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [list(model.parameters()), list(model.buffers()), grads,
            [list(s.values()) for s in optimizer.state.values()], batch]


def test_step_peaks_match_preflight_measure():
    model = make_gpt2(n_layer=2, n_embd=64)
    twin = copy.deepcopy(model)
    batch = lm_batch(4, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    meter = StepPeakMeter(torch.device("cpu"))
    for _ in range(3):
        meter.start(_resident(model, optimizer, batch))
        run_steps(model, optimizer, batch, step=None, precision=None, device_type="cpu", steps=1)
        meter.stop()
    measured = preflight.measure(twin, torch.optim.AdamW(twin.parameters()), batch, run=preflight.Run(loop=preflight.Loop(steps=2)))
    assert len(meter.step_peaks) == 3
    assert meter.step_peaks[0] < meter.step_peaks[1] == meter.step_peaks[2]  # step 1 has no optimizer state yet
    assert abs(meter.step_peaks[1] - measured.peak_bytes) <= 256


def test_late_resident_counts_the_batch():
    model = make_gpt2(n_layer=1, n_embd=32)
    batch = lm_batch(2, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    meter = StepPeakMeter(torch.device("cpu"))
    meter.start(_resident(model, optimizer, batch))
    run_steps(model, optimizer, batch, step=None, precision=None, device_type="cpu", steps=1)
    with_batch = meter.stop()
    meter.start(_resident(model, optimizer, None))
    run_steps(model, optimizer, batch, step=None, precision=None, device_type="cpu", steps=1)
    late = meter.stop(also_resident=batch)
    assert late == with_batch


def test_under_prediction_warns_beyond_five_percent():
    ok = compare(1000, [900, 1040, 1040], method="cpu-profiler")
    assert ok.warnings == () and ok.relative_error == pytest.approx(-40 / 1040)
    bad = compare(1000, [900, 1060, 1060], method="cpu-profiler")
    assert len(bad.warnings) == 1 and "above the prediction" in bad.warnings[0]
    assert bad.steps_measured == 3 and bad.measured_peak_bytes == 1060


def test_each_step_is_compared_with_the_prediction_for_its_own_batch():
    # Variable-length batches: the steps' peaks follow their lengths; the worst case is larger than all of them.
    result = compare(2000, [900, 1500, 1100], method="cpu-profiler", predicted_step_peaks=[950, 1499, 1100])
    # The accuracy, not the headroom; the first step is shown but judged by the later ones (see compare).
    assert result.relative_error == pytest.approx(-1 / 1500)
    assert result.predicted_step_peaks == (950, 1499, 1100)
    assert result.worst_case_headroom == pytest.approx(500 / 1500)
    assert result.warnings == ()
    under = compare(2000, [900, 1500, 1100], method="cpu-profiler", predicted_step_peaks=[900, 1400, 1100])
    assert under.relative_error == pytest.approx(-100 / 1500) and "own batch" in under.warnings[0]
    line = summary(2000, result)
    assert "predicted 1.46 KiB for these batches (error -0.07%)" in line and "33.3% above the largest" in line


def test_the_headline_error_is_the_one_its_two_numbers_give():
    # Issue 24, item 8: "measured 125.12 MiB, predicted 125.12 MiB for these batches (error +1.88%)": the error of
    # another step beside the two maxima. Now the headline's error is computed from the numbers beside it, and the
    # largest error of one step is named as such.
    result = compare(1500, [900, 1500, 1000], method="cpu-profiler", predicted_step_peaks=[950, 1500, 1019])
    assert result.relative_error == pytest.approx(0.019)
    line = summary(1500, result)
    assert "measured 1.46 KiB, predicted 1.46 KiB for these batches (error +0.00%)" in line
    assert "largest error of one step +1.90%" in line
    assert "worst case predicted 1.46 KiB, equal to the largest measured step" in line  # never "-0.0% above"
    below = summary(1490, compare(1490, [1500], method="cpu-profiler"))
    assert "(error -0.67%)" in below and "0.7% below the largest measured step" in below
    assert "largest error of one step" not in below  # one number, said once


def test_percentages_keep_their_sign_honest_and_two_significant_digits():
    from preflight._units import margin_text, signed_percent
    from preflight.report._console import share_text

    assert signed_percent(-0.00001, 2) == "+0.00%" and signed_percent(-0.0188, 2) == "-1.88%"
    assert margin_text(-0.00001) == "equal to" and margin_text(0.012) == "1.2% above"
    assert [share_text(x) for x in (0.0023, 0.0987, 0.32, 0.0)] == ["0.23%", "9.9%", "32%", "0%"]


def test_a_leak_is_memory_retained_step_after_step_not_growing_peaks():
    mb = 2**20
    peaks = [50 * mb, 80 * mb, 70 * mb, 90 * mb]  # follow the batch lengths, up and down
    leak = compare(100 * mb, peaks, method="cpu-profiler", step_retained=[30 * mb, 2 * mb, 2 * mb, 3 * mb])
    assert any("step after step" in w for w in leak.warnings)
    flat = compare(100 * mb, peaks, method="cpu-profiler", step_retained=[30 * mb, 0, 96, -64])
    assert flat.warnings == ()
    growing = compare(100 * mb, [50 * mb, 80 * mb, 90 * mb, 100 * mb], method="cpu-profiler",
                      step_retained=[30 * mb, 0, 0, 0])
    assert growing.warnings == ()  # peaks that grow with the batch are not a leak
    short = compare(100 * mb, [50 * mb, 90 * mb], method="cpu-profiler", step_retained=[30 * mb, 2 * mb])
    assert short.warnings == ()  # one steady step: no trend to judge


@pytest.mark.parametrize("leak", ["none", "every step", "until the next step", "freed between the steps"])
def test_meter_measures_what_a_step_leaves_alive(leak):
    """A leak is growth: outputs cached every step are; an output kept until the next step replaces it (an
    accelerate loop's ``outputs`` variable, Lightning holding gradients until the next backward) is not, nor is one
    freed between the measured steps, outside every profile (Lightning sets the gradients to None as its
    validation starts)."""
    model = make_gpt2(n_layer=1, n_embd=32)
    optimizer = torch.optim.AdamW(model.parameters())
    kept = []

    def step(m, b):
        out = m(**b)
        if leak == "every step":
            kept.append(out.logits)  # caches every step's outputs
        elif leak in ("until the next step", "freed between the steps"):
            kept[:] = [out.logits]  # the last output stays alive between steps
        return out.loss

    meter = StepPeakMeter(torch.device("cpu"))
    for length in (48, 16, 32, 24):  # variable lengths, neither ascending nor descending
        batch = lm_batch(2, length)
        meter.start(_resident(model, optimizer, batch))
        run_steps(model, optimizer, batch, step=step, precision=None, device_type="cpu", steps=1)
        meter.stop()
        if leak == "freed between the steps":
            kept.clear()
    result = compare(None, meter.step_peaks, method="cpu-profiler", step_retained=meter.step_retained)
    assert meter.step_retained[0] > 0  # the optimizer state
    assert any("step after step" in w for w in result.warnings) == (leak == "every step")
    if leak in ("until the next step", "freed between the steps"):  # only the last step's output is still held
        assert meter.step_retained[1:3] == [0, 0] and meter.step_retained[3] > 0


def test_meter_rejects_other_devices():
    with pytest.raises(ValueError, match="CUDA or CPU"):
        StepPeakMeter(torch.device("meta"))


def test_forgetting_freed_blocks_survives_objects_that_raise_when_inspected():
    """The scan for tensors still alive (`StepPeakMeter._release_unheld`) walks every object the garbage collector
    tracks: a dead weak proxy (Lightning keeps some) raises on any attribute, and must not stop the measurement."""
    import weakref

    class Holder:
        pass

    target = Holder()
    dead = weakref.proxy(target)
    del target
    model = make_gpt2(n_layer=1, n_embd=32)
    optimizer = torch.optim.AdamW(model.parameters())
    kept = []
    meter = StepPeakMeter(torch.device("cpu"))
    for length in (16, 24, 32):
        batch = lm_batch(2, length)
        meter.start(_resident(model, optimizer, batch))
        run_steps(model, optimizer, batch, step=lambda m, b: (kept.__setitem__(slice(None), [m(**b).logits]),
                                                              m(**b).loss)[1],
                  precision=None, device_type="cpu", steps=1)
        meter.stop()
        kept.clear()  # freed between the measured windows
    assert [dead] and meter.step_retained[0] > 0 and meter.step_retained[1] == 0  # step 2 freed before step 3
