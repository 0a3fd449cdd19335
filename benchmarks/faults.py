"""Faults and bad input, tried as a new user would (issue 13): one row per probe, and the counts per outcome.

Each probe is a `Probe(name, section, run)` in `PROBES`; ``run()`` returns ``(outcome, detail)`` with outcome one of

- ``clear error``: refused with the expected exception (or exit status 2 for the CLI) whose message names the
  argument or the value, or the user's own exception re-raised as the real step would raise it;
- ``correct result``: accepted, and what came back (or what was left behind) is right;
- ``unclear error``: an error that does not say what is wrong (an internal exception, exit status 1 with a
  traceback), or a bad input accepted with a misleading result (a verdict for a step that crashes, a changed
  random stream, "could not trace" for the user's own bug);
- ``crash``: the process died (a signal, a timeout).

Add a row by appending to `PROBES`. Probes of issue 13's other sections (compiled models, dtype and index checks,
dataset faults, SIGTERM) are here too, so the table follows each fix.

Run: python benchmarks/faults.py [--only NAME,NAME] [--fast]   (about 6 minutes on 2 CPU cores; --fast skips the
probes that train in fresh processes, about 1 minute). Prints a markdown table and the counts.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

import preflight

CLEAR, CORRECT, UNCLEAR, CRASH = "clear error", "correct result", "unclear error", "crash"
OUTCOMES = (CLEAR, CORRECT, UNCLEAR, CRASH)
REPO = Path(__file__).resolve().parents[1]
Result = tuple[str, str]


class Probe(NamedTuple):
    name: str
    section: str  # the section: "§3 nothing global changes", ...
    run: Callable[[], Result]
    slow: bool = False  # trains in fresh processes (skipped by --fast)


# ---- helpers ---------------------------------------------------------------------------------------------------


def _quietly(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return fn()


def _text(err: BaseException) -> str:
    return " ".join([str(err), *getattr(err, "__notes__", [])])


def raises(fn: Callable[[], Any], expected: type | tuple[type, ...], *needles: str) -> Result:
    """Clear when ``fn`` raises ``expected`` with every needle in its message (or notes)."""
    try:
        result = _quietly(fn)
    except expected as err:
        if all(n in _text(err) for n in needles):
            return CLEAR, f"{type(err).__name__}: {_text(err)}"
        return UNCLEAR, f"{type(err).__name__} without {needles}: {_text(err)}"
    except Exception as err:  # noqa: BLE001 - a probe classifies every failure
        return UNCLEAR, f"{type(err).__name__}: {_text(err)}"
    return UNCLEAR, f"accepted: returned {_describe(result)}"


def users_error(fn: Callable[[], Any], expected: type, message: str) -> Result:
    """Clear when the user's own exception comes back as it is, with preflight's note; a lower bound is not."""
    try:
        result = _quietly(fn)
    except expected as err:
        if message in str(err) and any("preflight" in n for n in getattr(err, "__notes__", [])):
            return CLEAR, f"{type(err).__name__}: {_text(err)}"
        return UNCLEAR, f"{type(err).__name__} without preflight's note: {err}"
    except Exception as err:  # noqa: BLE001
        return UNCLEAR, f"{type(err).__name__}: {_text(err)}"
    return UNCLEAR, f"accepted: returned {_describe(result)}"


def _describe(result: Any) -> str:
    if isinstance(result, preflight.Estimate):
        kind = "a lower bound ('could not trace')" if result.coverage.lower_bound else "a traced estimate"
        return f"{kind} of {preflight.format_bytes(result.peak_bytes)}"
    if isinstance(result, preflight.Report):
        return f"a report (fits={result.fits})"
    return type(result).__name__


def cli(*args: str, expect: int = 2, needle: str = "") -> Result:
    """Clear when ``preflight ARGS`` exits ``expect`` with ``needle`` on stderr and no traceback."""
    from preflight._cli import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    except Exception as exc:  # noqa: BLE001 - exit 1 with a traceback
        return UNCLEAR, f"exit 1: {type(exc).__name__}: {exc}"
    text = err.getvalue().strip().splitlines()
    last = next((line for line in reversed(text) if line.startswith("preflight: error")), text[-1] if text else "")
    if code == expect and needle in err.getvalue():
        return CLEAR, f"exit {code}: {last}"
    return UNCLEAR, f"exit {code}: {last}"


def tiny_config(tmp: str, **change: Any) -> str:
    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 64,
              **change}
    path = os.path.join(tmp, f"config-{abs(hash(json.dumps(config, sort_keys=True)))}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


@functools.cache
def _tmp() -> str:
    return tempfile.mkdtemp(prefix="preflight-faults-")  # the probes' configs and scripts
EST = ("estimate", "--hf-config")


def est_cli(*args: str, config: dict | None = None, seq: str = "8", **kw: Any) -> Result:
    return cli(*EST, tiny_config(_tmp(), **(config or {})), "--batch", "1", "--seq", seq, *args, **kw)


def linear() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def sum_step(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(batch).sum()


# ---- §3: nothing global changes ---------------------------------------------------------------------------------


def side_effects(entry: str) -> Callable[[], Result]:
    """The same run with and without preflight, each in a fresh process (`tests/side_effects.py`)."""

    def run() -> Result:
        extra = []
        if entry == "cli":
            extra = [tiny_config(_tmp())]
        elif entry == "hf":
            extra = [os.path.join(_tmp(), "hf-out")]
        states = []
        for flag in ([], ["--without"]):
            try:
                done = subprocess.run([sys.executable, str(REPO / "tests" / "side_effects.py"), entry, *extra, *flag],
                                      capture_output=True, text=True, timeout=600)
            except subprocess.TimeoutExpired:
                return CRASH, "timed out"
            if done.returncode < 0:
                return CRASH, f"killed by signal {-done.returncode}"
            line = next((x for x in done.stdout.splitlines() if x.startswith("SIDE_EFFECTS ")), None)
            if line is None:
                return UNCLEAR, f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
            states.append(json.loads(line.removeprefix("SIDE_EFFECTS ")))
        with_, without = states
        with_["logging"] = {k: v for k, v in with_["logging"].items() if k in without["logging"]}
        changed = [k for k in without if with_[k] != without[k]]
        if changed:
            return UNCLEAR, f"differs from the run without preflight: {', '.join(changed)}"
        return CORRECT, "random, numpy, torch streams, weights, warning filters and logging as without preflight"

    return run


def fake_tensor_tracebacks() -> Result:
    script = textwrap.dedent("""
        import torch, warnings, preflight
        warnings.simplefilter("ignore")
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(7, 1))
        preflight.estimate(m, torch.optim.SGD(m.parameters(), lr=0.1), torch.randn(4, 8), step=lambda m, b: m(b).sum())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    lines = [x for x in done.stderr.splitlines() if "fake_tensor.py" in x]
    if done.returncode != 0:
        return UNCLEAR, f"exit {done.returncode}"
    return (CORRECT, "no fake-tensor ERROR lines for a failure preflight reports") if not lines else \
        (UNCLEAR, f"{len(lines)} ERROR traceback lines from fake_tensor.py on stderr")


# ---- §5: user errors are the user's ------------------------------------------------------------------------------


class RaisesValueError(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin(x)
        raise ValueError("user bug")


def _user_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = RaisesValueError()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def dry_run_user_error() -> Result:
    script = os.path.join(_tmp(), "train_user_bug.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(f"""
            import sys, torch
            sys.path.insert(0, {str(REPO / 'benchmarks')!r})
            import preflight
            from faults import _user_model
            model, opt = _user_model()
            preflight.check(model, opt, torch.randn(4, 8), preflight.Run(target=preflight.Target(budget="1GiB")),
                            step=lambda m, b: m(b))
        """))
    done = subprocess.run([sys.executable, "-m", "preflight", "check", "--", sys.executable, script],
                          capture_output=True, text=True, timeout=300)
    if done.returncode == 2 and "ValueError: user bug" in done.stderr:
        return CLEAR, "exit 2: the script's own ValueError: user bug, no report"
    return UNCLEAR, f"exit {done.returncode}: {done.stdout.strip().splitlines()[-1:]}"


# ---- other sections ------------------------------------------------------------------------------------------------


def bf16_batch() -> Result:
    model, opt = linear()
    return raises(lambda: preflight.estimate(model, opt, torch.randn(4, 8, dtype=torch.bfloat16), step=sum_step),
                  (RuntimeError, TypeError, ValueError), "dtype")


def token_id_out_of_range() -> Result:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return raises(lambda: preflight.estimate(model, opt, torch.tensor([[3, 12]]), step=sum_step),
                  (IndexError, RuntimeError, ValueError), "12")


class RaisesAtThree(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 3:
            raise OSError("corrupt sample")  # the index is preflight's to name
        return torch.randn(8)


def dataset_raises_at_one_index() -> Result:
    loader = torch.utils.data.DataLoader(RaisesAtThree(), batch_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            batch, info = preflight.worst_case_batch(loader)
        except Exception as err:  # noqa: BLE001
            ok = "3" in str(err) and "corrupt sample" in str(err)
            return (CLEAR if ok else UNCLEAR), f"{type(err).__name__}: {err}"
    said = [str(w.message) for w in caught if "3" in str(w.message)]
    said += [f"batch info: {i} raised {e}" for i, e in getattr(info, "failures", ()) if i == 3]
    return (CORRECT, f"batch {tuple(batch.shape)}; {said[0]}") if said else (UNCLEAR, "no word of index 3")


class Pointwise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.lin(x)).cos().sum()


def compiled_model() -> Result:
    import torch._dynamo.utils as dynamo_utils

    model = torch.compile(Pointwise(), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        est = _quietly(lambda: preflight.estimate(model, opt, torch.randn(4, 8), step=lambda m, b: m(b)))
    except Exception as err:  # noqa: BLE001
        return UNCLEAR, f"{type(err).__name__}: {err}"
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    torch.compile(Pointwise(), backend="eager")(torch.randn(4, 8))  # a new model of the same class, for real
    compiled = dynamo_utils.counters["stats"]["unique_graphs"] > before
    said = any("compil" in n for n in est.coverage.notes)
    if compiled and said:
        return CORRECT, "compilation still works afterwards; the coverage says what was predicted"
    return UNCLEAR, ("a new model of the same class is not compiled afterwards; " if not compiled else "") + \
        ("no word of compilation in the coverage" if not said else "")


def sigterm_check() -> Result:
    pid_file = os.path.join(_tmp(), "child.pid")
    child = f"import os, time; open({pid_file!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-m", "preflight", "check", "--", sys.executable, "-c", child],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not os.path.exists(pid_file) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    parent.send_signal(signal.SIGTERM)
    parent.wait(timeout=30)
    pid = int(open(pid_file).read())
    time.sleep(1)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return CORRECT, "the script ended with preflight check"
    os.kill(pid, signal.SIGKILL)  # the probe's own orphan
    return UNCLEAR, "the script kept running after SIGTERM to preflight check"


# ---- the probes ----------------------------------------------------------------------------------------------------

S1, S2, S3, S4, S5, S6, S7 = ("§1 compiled models", "§2 interrupts", "§3 nothing global changes",
                              "§4 the real step would fail", "§5 user errors", "§6 bad input", "§7 one bad part")


def _not_executable() -> Result:
    path = os.path.join(_tmp(), "train.sh")
    with open(path, "w") as f:
        f.write("#!/bin/sh\necho hi\n")
    os.chmod(path, 0o644)
    return cli("check", "--", path, needle="not executable")


def _numpy_budget() -> Result:
    import numpy as np

    model, opt = linear()
    try:
        report = _quietly(lambda: preflight.check(model, opt, torch.randn(2, 8), step=sum_step,
                                                  run=preflight.Run(target=preflight.Target(budget=np.int64(2**30))), suggest=False))
    except Exception as err:  # noqa: BLE001
        return UNCLEAR, f"{type(err).__name__}: {err}"
    ok = report is not None and report.budget_bytes == 2**30
    return (CORRECT, "budget 1.00 GiB") if ok else (UNCLEAR, f"report {report}")


def _api_budget(value: Any, *needles: str) -> Callable[[], Result]:
    def run() -> Result:
        model, opt = linear()
        return raises(lambda: preflight.check(model, opt, torch.randn(2, 8), step=sum_step, run=preflight.Run(target=preflight.Target(budget=value))),
                      ValueError, "budget", *needles)

    return run


PROBES: list[Probe] = [
    # §3
    *(Probe(f"side effects: {entry}", S3, side_effects(entry), slow=True)
      for entry in ("estimate", "check", "check-over", "cli", "accelerate", "lightning", "hf")),
    Probe("fake-tensor ERROR tracebacks during a handled trace failure", S3, fake_tensor_tracebacks),
    # §5
    Probe("forward raises ValueError: estimate", S5, lambda: users_error(
        lambda: preflight.estimate(*_user_model(), torch.randn(4, 8), step=lambda m, b: m(b)), ValueError,
        "user bug")),
    Probe("forward raises ValueError: check", S5, lambda: users_error(
        lambda: preflight.check(*_user_model(), torch.randn(4, 8), step=lambda m, b: m(b), run=preflight.Run(target=preflight.Target(budget="1GiB"))),
        ValueError, "user bug")),
    Probe("forward raises ValueError: preflight check dry run", S5, dry_run_user_error),
    Probe("batch of the wrong type (a list)", S5, lambda: users_error(
        lambda: preflight.estimate(*linear(), [1.0, 2.0]), TypeError, "must be Tensor")),
    Probe("step with the wrong arity", S5, lambda: raises(
        lambda: preflight.estimate(*linear(), torch.randn(2, 8), step=lambda m: m.weight.sum()), TypeError,
        "`step`", "(model, batch)")),
    # §6 CLI
    Probe("--seq -1", S6, lambda: est_cli(seq="-1", needle="--seq")),
    Probe("--seq 0", S6, lambda: est_cli(seq="0", needle="--seq")),
    Probe("--budget with 400 digits", S6, lambda: est_cli("--budget", "1" + "0" * 400, needle="--budget")),
    Probe("--budget 0", S6, lambda: est_cli("--budget", "0", needle="--budget")),
    Probe("--offload-params with zero1", S6, lambda: est_cli("--sharding", "zero1", "--world-size", "2",
                                                             "--offload-params", needle="--offload-params")),
    Probe("--lora-r -4", S6, lambda: est_cli("--lora-r", "-4", needle="--lora-r")),
    Probe("--lora-r 0", S6, lambda: est_cli("--lora-r", "0", needle="--lora-r")),
    Probe("unknown --lora-targets", S6, lambda: est_cli("--lora-r", "4", "--lora-targets", "nope",
                                                        needle="--lora-targets")),
    Probe("unwritable --json", S6, lambda: est_cli("--json", "/no/such/folder/out.json", needle="--json")),
    Probe("check -- ./not-executable", S6, _not_executable),
    Probe("n_layer=-1 in the config", S6, lambda: est_cli(config={"num_hidden_layers": -1},
                                                          needle="num_hidden_layers")),
    Probe("unknown model_type lists the closest names", S6, lambda: est_cli(
        config={"model_type": "llamaa"}, needle="closest it knows: llama")),
    # §6 API
    Probe("budget=nan", S6, _api_budget(float("nan"), "nan")),
    Probe("budget=inf", S6, _api_budget(float("inf"), "inf")),
    Probe("budget with 400 digits", S6, _api_budget(10**400, "more than any memory")),
    Probe("budget=0", S6, _api_budget(0, "more than 0 bytes")),
    Probe("budget=numpy.int64(2**30)", S6, _numpy_budget),
    Probe("measure(steps='2')", S6, lambda: raises(
        lambda: preflight.measure(*linear(), torch.randn(2, 8), step=sum_step, run=preflight.Run(loop=preflight.Loop(steps="2"))), TypeError, "`steps`")),
    # other sections' user-visible faults
    Probe("compiled model: estimate, then compile a new one", S1, compiled_model),
    Probe("bf16 batch into an fp32 Linear", S4, bf16_batch),
    Probe("token id >= vocabulary size", S4, token_id_out_of_range),
    Probe("dataset raises on one index", S7, dataset_raises_at_one_index),
    Probe("SIGTERM to preflight check", S7, sigterm_check),
]


def run_probes(probes: list[Probe]) -> list[tuple[Probe, str, str]]:
    rows = []
    for probe in probes:
        try:
            outcome, detail = probe.run()
        except Exception as err:  # noqa: BLE001 - a probe that breaks is an unclear outcome, said as such
            outcome, detail = UNCLEAR, f"the probe itself failed: {type(err).__name__}: {err}"
        rows.append((probe, outcome, " ".join(detail.split())))
        print(f"[{outcome}] {probe.name}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[tuple[Probe, str, str]]) -> str:
    lines = ["| probe | section | outcome | what happened |", "|---|---|---|---|"]
    for probe, outcome, detail in rows:
        detail = detail.replace("|", "\\|")
        lines.append(f"| {probe.name} | {probe.section} | {outcome} | "
                     f"{detail[:160] + '...' if len(detail) > 160 else detail} |")
    counts = Counter(outcome for _, outcome, _ in rows)
    lines += ["", "| outcome | probes |", "|---|---|"]
    lines += [f"| {o} | {counts.get(o, 0)} |" for o in OUTCOMES]
    lines.append(f"| total | {len(rows)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated probe names (exact)")
    parser.add_argument("--fast", action="store_true", help="skip the probes that train in fresh processes")
    args = parser.parse_args(argv)
    probes = PROBES
    if args.only:
        wanted = [n.strip() for n in args.only.split(",")]
        unknown = sorted(set(wanted) - {p.name for p in PROBES})
        if unknown:
            parser.error(f"unknown probe(s) {unknown}; known: {[p.name for p in PROBES]}")
        probes = [p for p in PROBES if p.name in wanted]
    if args.fast:
        probes = [p for p in probes if not p.slow]
    print(f"Command: `python benchmarks/faults.py{' --fast' if args.fast else ''}` (torch {torch.__version__}, "
          f"{len(probes)} probes)\n")
    print(table(run_probes(probes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
