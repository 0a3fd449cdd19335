"""`benchmarks/faults.py` keeps running: a few of its probes, one per kind, through its command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "faults.py"
PROBES = ["--lora-r 0", "budget=nan", "step with the wrong arity", "budget=numpy.int64(2**30)"]


def test_the_probe_script_runs_and_counts_its_outcomes():
    done = subprocess.run([sys.executable, str(SCRIPT), "--only", ",".join(PROBES)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and " | §" in line]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == [
        p for p in [probe for probe in _order() if probe in PROBES]]
    assert "| clear error | 3 |" in done.stdout and "| correct result | 1 |" in done.stdout
    assert "| total | 4 |" in done.stdout


def test_an_unknown_probe_name_is_refused_with_the_known_ones():
    done = subprocess.run([sys.executable, str(SCRIPT), "--only", "no such probe"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "unknown probe(s) ['no such probe']" in done.stderr


def _order() -> list[str]:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import faults
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return [p.name for p in faults.PROBES]
