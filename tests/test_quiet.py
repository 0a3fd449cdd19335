"""The CPU profiler's native log lines stay off stderr while preflight measures; everything else is kept."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, warnings
import torch
import preflight
from preflight._verify import StepPeakMeter

old = torch.randn(512, 512)  # allocated before the profiler starts, freed inside the step
meter = StepPeakMeter(torch.device("cpu"))
meter.start([old])
del old
print("python print inside the step", file=sys.stderr)
warnings.warn("python warning inside the step")
x = torch.randn(64, 64) @ torch.randn(64, 64)
meter.stop()
model = torch.nn.Linear(8, 8)
preflight.measure(model, torch.optim.SGD(model.parameters()), torch.randn(4, 8), step=lambda m, b: m(b).sum())
print("after", file=sys.stderr)
print("PEAK", meter.step_peaks[0])
"""


def test_profiler_log_lines_are_silenced_and_python_output_kept():
    # A fresh process: c10 logs the unknown-size free once per 1000, so an earlier profile in this one hides it.
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PEAK" in done.stdout
    assert "profiler_start" not in done.stderr and "profiler_stop" not in done.stderr, done.stderr
    assert "Memory block of unknown size" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert "python print inside the step" in lines
    assert any("UserWarning: python warning inside the step" in line for line in lines)
    assert lines.index("python print inside the step") < lines.index("after")


def test_a_process_that_exits_inside_a_measured_step_keeps_its_output_and_status():
    script = ("import sys, torch\nfrom preflight._verify import StepPeakMeter\n"
              "meter = StepPeakMeter(torch.device('cpu'))\nmeter.start([])\n"
              "print('inside', file=sys.stderr)\nraise SystemExit('bye from inside')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # not a segfault: torch's, at exit with a profiler still running
    assert "inside" in done.stderr and "bye from inside" in done.stderr, done.stderr
    assert "profiler_start" not in done.stderr


def test_quiet_import_logs_holds_back_a_package_s_warnings_and_restores_its_level():
    import logging

    from preflight._quiet import quiet_import_logs

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    child = logging.getLogger("some_optional_package.backends")  # as bitsandbytes logs, from a submodule
    child.addHandler(handler)
    try:
        with quiet_import_logs("some_optional_package"):
            child.warning("Failed to load an optional kernel")
            child.error("a real error")
        child.warning("the user's own use, afterwards")
    finally:
        child.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["a real error", "the user's own use, afterwards"]
    assert logging.getLogger("some_optional_package").level == logging.NOTSET
