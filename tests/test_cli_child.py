"""`preflight check` and the user's script it runs: signals reach the script's whole process group, `--timeout`
stops it, and nothing of it is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from preflight._cli import EXIT_TIMEOUT, main

# The script under check: starts a grandchild in its process group (a launcher's worker), writes both pids, and
# waits forever (a training script stuck before its preflight check).
_STUCK = textwrap.dedent("""
    import os, subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {worker.pid}")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its new parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start(tmp_path: Path, *options: str) -> tuple[subprocess.Popen, list[int]]:
    script, pids = tmp_path / "stuck.py", tmp_path / "pids"
    script.write_text(_STUCK)
    check = subprocess.Popen([sys.executable, "-m", "preflight", "check", *options, "--", sys.executable,
                              str(script), str(pids)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(600):  # up to 60 s for two interpreters to start on a loaded machine
        if pids.exists():
            return check, [int(p) for p in pids.read_text().split()]
        if check.poll() is not None:
            break
        time.sleep(0.1)
    check.kill()
    pytest.fail(f"the script did not start: {check.communicate()}")


def _gone(pids: list[int]) -> bool:
    for _ in range(50):  # the grandchild is reaped by init shortly after SIGKILL
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_check_stops_the_scripts_whole_group(tmp_path, signum):
    check, pids = _start(tmp_path)
    check.send_signal(signum)
    _, err = check.communicate(timeout=60)
    assert check.returncode == 128 + signum, err
    assert _gone(pids), f"left running: {[p for p in pids if _alive(p)]}"


@pytest.mark.slow
def test_timeout_stops_the_script_with_its_own_status(tmp_path):
    check, pids = _start(tmp_path, "--timeout", "3")
    _, err = check.communicate(timeout=60)
    assert check.returncode == EXIT_TIMEOUT == 124, err
    assert "did not finish within --timeout 3 s" in err
    assert _gone(pids), f"left running: {[p for p in pids if _alive(p)]}"


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_timeout_must_be_a_positive_number(value, capsys):
    assert main(["check", "--timeout", value, "--", sys.executable, "-c", "pass"]) == 2
    assert f"--timeout should be a positive number of seconds, got {float(value)}" in capsys.readouterr().err


def test_timeout_and_exit_statuses_are_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--timeout SECONDS" in text and f"{EXIT_TIMEOUT} --timeout reached" in text
    assert "SIGINT/SIGTERM are passed on to the script's process group" in text
