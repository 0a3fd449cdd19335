"""Step-by-step measurement of real training steps, and how it is compared with the prediction."""

from __future__ import annotations

import copy

import pytest
import torch

import preflight
from preflight._steps import run_steps
from preflight._verify import StepPeakMeter, compare
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
    measured = preflight.measure(twin, torch.optim.AdamW(twin.parameters()), batch, steps=2)
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
    assert len(bad.warnings) == 1 and "above the predicted" in bad.warnings[0]
    assert bad.steps_measured == 3 and bad.measured_peak_bytes == 1060


def test_growth_step_over_step_is_reported_as_a_leak():
    mb = 2**20
    leak = compare(100 * mb, [50 * mb, 80 * mb, 90 * mb, 100 * mb], method="cpu-profiler")
    assert any("grows step over step" in w for w in leak.warnings)
    flat = compare(100 * mb, [50 * mb, 100 * mb, 100 * mb, 100 * mb], method="cpu-profiler")
    assert flat.warnings == ()
    short = compare(100 * mb, [50 * mb, 90 * mb], method="cpu-profiler")  # one steady step: no trend to judge
    assert short.warnings == ()


def test_meter_rejects_other_devices():
    with pytest.raises(ValueError, match="CUDA or CPU"):
        StepPeakMeter(torch.device("meta"))
