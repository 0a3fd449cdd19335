"""benchmarks/gpu_validation.py runs in CPU mode: the CPU-host predictions, and a plain statement that the
measurements need a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU mode only; on a GPU the harness measures")
def test_quick_cpu_mode_prints_the_planned_column_and_says_measurements_need_a_gpu():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_validation.py"), "--quick",
                           "--no-write", "--gpu", "A100-80GB"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "planning for A100-80GB" in out
    assert "the on-device trace and the measurements need a GPU" in out
    rows = [line for line in out.splitlines() if line.startswith("| GPT-2") or line.startswith("| BERT")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        allocated, reserved, total = (float(c.replace(",", "")) for c in cells[1:4])
        assert 0 < allocated <= reserved < total  # reserved from the allocator simulation, total adds the context
        assert not re.search("lower bound", row)
