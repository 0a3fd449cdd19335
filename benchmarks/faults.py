"""Faults and bad input, tried as a new user would (issue 13): one row per probe, and the counts per outcome.

Each probe is a `Probe(name, section, run)` in `PROBES`; ``run()`` returns ``(outcome, detail)`` with outcome one of

- ``clear error``: refused with the expected exception (or exit status 2 for the CLI) whose message names the
  argument or the value, or the user's own exception re-raised as the real step would raise it;
- ``correct result``: accepted, and what came back (or what was left behind) is right;
- ``unclear error``: an error that does not say what is wrong (an internal exception, exit status 1 with a
  traceback), or a bad input accepted with a misleading result (a verdict for a step that crashes, a changed
  random stream, "could not trace" for the user's own bug);
- ``changed training``: something the user's training reads afterwards (a tensor, a hook's count, a random
  stream, a flag, an optimizer's state) is not as it would be without preflight;
- ``crash``: the process died (a signal, a timeout).

Issue 24's probes (training unchanged, blame, confident numbers, bad input, noise) are in `ISSUE_24`. Add a row
by appending to `PROBES`. Probes of issue 13's other sections (compiled models, dtype and index checks,
dataset faults, SIGTERM) are here too, so the table follows each fix.

Run: python benchmarks/faults.py [--only NAME,NAME] [--fast]   (about 10 minutes on 2 CPU cores; --fast skips the
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
CHANGED = "changed training"
OUTCOMES = (CLEAR, CORRECT, UNCLEAR, CHANGED, CRASH)
REPO = Path(__file__).resolve().parents[1]
Result = tuple[str, str]


class Probe(NamedTuple):
    name: str
    section: str  # the issue's section: "§3 nothing global changes", ...
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
            return CHANGED, f"differs from the run without preflight: {', '.join(changed)}"
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


# ---- issue 24: never change, stop or mislead a training run ------------------------------------------------------

T1, T2, T3, T4, T5 = ("24 training unchanged", "24 blame", "24 numbers", "24 bad input", "24 noise")
_STATE = {"pos": torch.zeros(1)}
_COUNTER = torch.zeros(1)


class _Helper:
    t = None


_HELPER = _Helper()
_HELPER.t = torch.zeros(2)


class _Touchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.seen = torch.zeros((), dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        _COUNTER.add_(1)
        _STATE["pos"] = _STATE["pos"] + 1
        _HELPER.t = _HELPER.t * 2
        return self.lin(x)


def real_tensors_written() -> Result:
    model, criterion = _Touchy(), nn.BatchNorm1d(4)
    before = (_STATE["pos"], _HELPER.t)
    _quietly(lambda: preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8),
                                        step=lambda m, b: criterion(m(b)).sum()))
    changed = [name for name, bad in (
        ("a tensor counter on the module", model.seen.item() != 0), ("a module-level tensor", _COUNTER.item() != 0),
        ("a loss-side BatchNorm's num_batches_tracked", criterion.num_batches_tracked.item() != 0),
        ("a module-level dict entry", _STATE.get("pos") is not before[0]),
        ("a helper object's attribute", getattr(_HELPER, "t", None) is not before[1])) if bad]
    if changed:
        return CHANGED, "changed: " + ", ".join(changed)
    return CORRECT, "counter, module-level tensor and dict, helper attribute and the criterion's buffers as before"


def global_hooks() -> Result:
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.optim.swa_utils import AveragedModel

    model, opt = linear()
    average = AveragedModel(model)
    forward_calls = []
    h1 = register_optimizer_step_post_hook(lambda o, a, k: average.update_parameters(model))
    h2 = nn.modules.module.register_module_forward_hook(lambda m, a, o: forward_calls.append(type(o).__name__))
    try:
        _quietly(lambda: preflight.estimate(model, opt, torch.randn(4, 8), step=sum_step))
    finally:
        h1.remove()
        h2.remove()
    if average.n_averaged.item() or forward_calls:
        return CHANGED, f"SWA n_averaged {average.n_averaged.item()}, forward hook calls {forward_calls}"
    return CORRECT, "a global optimizer hook (SWA average) and a global forward hook did not run on the trace"


def other_threads_draws() -> Result:
    import random
    import threading

    random.seed(7)
    expected = random.Random(7)
    started, drawn, seen = threading.Event(), threading.Event(), []

    def background() -> None:
        started.wait(30)
        seen.extend(random.random() for _ in range(20))
        drawn.set()

    def step(m: nn.Module, b: Any) -> torch.Tensor:
        started.set()
        drawn.wait(30)
        random.random()
        return m(b).sum()

    thread = threading.Thread(target=background)
    thread.start()
    _quietly(lambda: preflight.estimate(*linear(), torch.randn(4, 8), step=step))
    thread.join()
    ours = [expected.random() for _ in range(21)]
    after = random.random()
    if seen != ours[:20] or after != ours[20]:
        return CHANGED, "the global stream was rewound or advanced by the trace"
    return CORRECT, "20 draws of another thread during the trace continue the stream; the step's draws are private"


def flags_and_modes() -> Result:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        fakes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            from torch._subclasses.fake_tensor import FakeTensor

            Counting.fakes += any(isinstance(a, FakeTensor) for a in args)
            return func(*args, **(kwargs or {}))

    def step(m: nn.Module, b: Any) -> torch.Tensor:
        torch.set_float32_matmul_precision("medium")
        os.environ["PREFLIGHT_FAULTS_FLAG"] = "1"
        return m(b).sum()

    precision = torch.get_float32_matmul_precision()
    with Counting():
        _quietly(lambda: preflight.estimate(*linear(), torch.randn(4, 8), step=step))
    changed = [name for name, bad in (("matmul precision", torch.get_float32_matmul_precision() != precision),
                                      ("an environment variable", "PREFLIGHT_FAULTS_FLAG" in os.environ),
                                      ("an outer dispatch mode saw fake tensors", Counting.fakes > 0)) if bad]
    os.environ.pop("PREFLIGHT_FAULTS_FLAG", None)
    torch.set_float32_matmul_precision(precision)
    return (CHANGED, ", ".join(changed)) if changed else (CORRECT, "flags, environment and outer modes as before")


def library_fails_on_fakes() -> Result:
    # A layer that fails only on fake tensors: a C kernel called through ctypes refusing a tensor without data.
    # (A weight lacking its real subclass's attributes, bitsandbytes' Int8Params.CB, no longer fails: a twin
    # carries them.) Its code must live in a library, not in the user's files: write it into a site-packages folder.
    root = os.path.join(_tmp(), "site-packages", "quantlib_probe")
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "__init__.py"), "w") as f:
        f.write("import torch\nfrom torch import nn\n\nclass QuantLinear(nn.Linear):\n    def forward(self, x):\n"
                "        if x.data_ptr() == 0:\n            raise RuntimeError('null data pointer')\n"
                "        return super().forward(x)\n")
    sys.path.insert(0, os.path.dirname(root))
    try:
        import quantlib_probe
    finally:
        sys.path.pop(0)
    layer = quantlib_probe.QuantLinear(8, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    try:
        report = _quietly(lambda: preflight.check(layer, opt, torch.randn(4, 8), step=sum_step,
                                                  run=preflight.Run(target=preflight.Target(budget="1GiB"))))
    except Exception as err:  # noqa: BLE001
        return UNCLEAR, f"check raised {type(err).__name__} (blamed on the user): {_text(err)}"
    if not report.estimate.coverage.lower_bound:
        return UNCLEAR, "no lower-bound label"
    return CORRECT, f"a lower bound, training goes on: {report.estimate.coverage.failed_op}"


def lbfgs() -> Result:
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.LBFGS(model.parameters(), max_iter=4)
    try:
        est = _quietly(lambda: preflight.estimate(model, opt, torch.randn(8, 16), step=sum_step))
    except Exception as err:  # noqa: BLE001
        return UNCLEAR, f"{type(err).__name__}: {_text(err)}"
    if est.coverage.traced and est.coverage.lower_bound:
        return CORRECT, f"stepped with a closure; a labelled lower bound: {est.coverage.reason}"
    return UNCLEAR, _describe(est)


def _error_against_measure(model: nn.Module, opt: Any, batch: Any, step: Any) -> tuple[float, Any]:
    est = _quietly(lambda: preflight.estimate(model, opt, batch, step=step))
    measured = _quietly(lambda: preflight.measure(model, opt, batch, step=step))
    return (est.peak_bytes - measured.peak_bytes) / measured.peak_bytes, est


def orthogonal() -> Result:
    from torch.nn.utils import parametrizations

    model = nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))
    parametrizations.orthogonal(model[0])
    error, est = _error_against_measure(model, torch.optim.AdamW(model.parameters()), torch.randn(16, 128), sum_step)
    if abs(error) <= 0.01 or est.coverage.lower_bound:
        return CORRECT, f"error {error:+.2%} against the measured peak (matrix_exp calibrated)"
    return UNCLEAR, f"error {error:+.2%} with no lower-bound label"


def optimizer_in_backward() -> Result:
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    optimizers = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}
    def hook(q: torch.Tensor) -> None:
        optimizers[q].step()
        optimizers[q].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    placeholder, batch = torch.optim.SGD(model.parameters(), lr=0.0), torch.randn(16, 128)
    _quietly(lambda: preflight.estimate(model, placeholder, batch, step=sum_step))
    if any(len(o.state) for o in optimizers.values()) or any(p.grad is not None for p in model.parameters()):
        return CHANGED, "the user's per-parameter optimizers or gradients kept something of the trace"
    error, _ = _error_against_measure(model, placeholder, batch, sum_step)  # measure's real steps do step them
    if abs(error) <= 0.01:
        return CORRECT, f"error {error:+.3%} against the measured peak; the user's optimizers untouched"
    return UNCLEAR, f"error {error:+.2%}"


def leak_constant_hold() -> Result:
    from preflight._steps import run_steps
    from preflight._verify import StepPeakMeter, compare

    model, opt = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64)), None
    opt = torch.optim.AdamW(model.parameters())
    kept: list[torch.Tensor] = []

    def step(m: nn.Module, b: Any) -> torch.Tensor:
        out = m(b)
        kept[:] = [out]  # the last output stays alive until the next step, as a loop's variable does
        return out.sum()

    meter = StepPeakMeter(torch.device("cpu"))
    for _ in range(4):
        batch = torch.randn(32, 64)
        meter.start([list(model.parameters()), [p.grad for p in model.parameters() if p.grad is not None],
                     [list(s.values()) for s in opt.state.values()], batch, kept])
        _quietly(lambda: run_steps(model, opt, batch, step=step, precision=None, device_type="cpu", steps=1))
        meter.stop()
    result = compare(None, meter.step_peaks, method="cpu-profiler", step_retained=meter.step_retained)
    leaks = [w for w in result.warnings if "step after step" in w]
    return (UNCLEAR, f"false leak warning: {leaks[0]}") if leaks else \
        (CORRECT, f"no leak warning; still held per step: {meter.step_retained}")


def cli_huge_batch() -> Result:
    code = ("import resource, subprocess, sys; d = subprocess.run([sys.executable, '-m', 'preflight', 'estimate', "
            f"'--hf-config', {tiny_config(_tmp())!r}, '--batch', '100000000', '--seq', '8', '--no-suggest'], "
            "capture_output=True); print(d.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    rc, rss_kb = (int(x) for x in done.stdout.split())
    if rc < 0:
        return CRASH, f"killed by signal {-rc}"
    if rc == 0 and rss_kb < 1_000_000:
        return CORRECT, f"exit 0, host memory {rss_kb / 1024:.0f} MiB for a planned batch of 100,000,000"
    return UNCLEAR, f"exit {rc}, {rss_kb / 1024:.0f} MiB"


def no_grad_message() -> Result:
    def under_no_grad(m: nn.Module, b: Any) -> torch.Tensor:
        with torch.no_grad():
            return m(b).sum()

    return raises(lambda: preflight.estimate(*linear(), torch.randn(4, 8), step=under_no_grad), ValueError,
                  "records no gradient", "no_grad")


def anomaly_detection() -> Result:
    with torch.autograd.detect_anomaly():
        est = _quietly(lambda: preflight.estimate(*linear(), torch.randn(4, 8), step=sum_step))
    return (UNCLEAR, "a lower bound under anomaly detection") if est.coverage.lower_bound else \
        (CORRECT, "traced as without anomaly detection")


def nested_batch() -> Result:
    batch = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=torch.jagged)
    try:
        est = _quietly(lambda: preflight.estimate(*linear(), batch, step=lambda m, b: m(b).values().sum()))
    except Exception as err:  # noqa: BLE001
        return UNCLEAR, f"{type(err).__name__}: {err}"
    return (CORRECT, f"a labelled lower bound: {est.coverage.reason[:100]}") if est.coverage.lower_bound else \
        (CORRECT, _describe(est))


def collate_combined() -> Result:
    data = [torch.ones(n) for n in (3, 9, 4, 7)]

    def collate(samples: list) -> torch.Tensor:
        if sum(len(x) for x in samples) > 15:
            raise ValueError("batch too long for my buffer")
        return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)

    loader = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=collate)
    return raises(lambda: preflight.worst_case_batch(loader), ValueError, "too long", "dataset indices 1, 3")


def shadowing_folder() -> Result:
    folder = tempfile.mkdtemp(prefix="preflight-faults-shadow-")
    os.makedirs(os.path.join(folder, "preflight"))
    done = subprocess.run([sys.executable, "-m", "preflight", "--help"], capture_output=True, text=True, cwd=folder,
                          timeout=120)
    ok = done.returncode == 2 and "Traceback" not in done.stderr and "rename the clone" in done.stderr
    return (CLEAR if ok else UNCLEAR), f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1][:150]}"


def ctrl_c_during_imports() -> Result:
    child = subprocess.Popen([sys.executable, "-m", "preflight", "estimate", "--hf-config", tiny_config(_tmp()),
                              "--batch", "1", "--seq", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    if child.returncode == 130 and "Traceback" not in err:
        return CLEAR, f"exit 130: {err.strip().splitlines()[-1]}"
    return UNCLEAR, f"exit {child.returncode}: {err.strip().splitlines()[-1:]}"


def daemonized_grandchild() -> Result:
    pid_file = os.path.join(_tmp(), "daemon.pid")
    script = os.path.join(_tmp(), "daemonizes.py")
    with open(script, "w") as f:
        f.write(f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                f"        open({pid_file!r}, 'w').write(str(os.getpid()))\n        time.sleep(120)\n    os._exit(0)\n"
                "time.sleep(0.5)\n")
    subprocess.run([sys.executable, "-m", "preflight", "check", "--", sys.executable, script], capture_output=True,
                   timeout=120)
    pid = int(open(pid_file).read())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return CORRECT, "the daemonized grandchild was stopped when the script exited"
    os.kill(pid, signal.SIGKILL)
    return CHANGED, "a daemonized grandchild outlived preflight check"


def library_import_noise() -> Result:
    done = subprocess.run([sys.executable, "-m", "preflight", "estimate", "--hf-config", tiny_config(_tmp()),
                           "--batch", "1", "--seq", "8", "--lora-r", "4", "--optimizer", "adamw8bit", "--no-suggest"],
                          capture_output=True, text=True, timeout=300)
    noise = [x for x in done.stderr.splitlines() if "gemm_4bit" in x or "Setting accelerator" in x]
    return (UNCLEAR, noise[0]) if noise else (CORRECT, f"exit {done.returncode}, no import-time library noise")


def launcher_traceback() -> Result:
    launcher = os.path.join(_tmp(), "launcher.py")
    with open(launcher, "w") as f:
        f.write("import subprocess, sys\nrc = subprocess.call([sys.executable] + sys.argv[1:])\nif rc:\n"
                "    for _ in range(40):\n        sys.stderr.write('  File \"launcher.py\", line 1\\n')\n"
                "    sys.stderr.write(f'ChildFailedError: rank 0 exited with {rc}\\n')\n    sys.exit(1)\n")
    script = os.path.join(_tmp(), "over.py")
    with open(script, "w") as f:
        f.write("import torch, preflight\nm = torch.nn.Linear(8, 1)\npreflight.check(m, torch.optim.SGD("
                "m.parameters(), lr=0.1), torch.randn(4, 8), preflight.Run(target=preflight.Target(budget='100B')), "
                "step=lambda m, b: m(b).sum(), suggest=False)\n")
    done = subprocess.run([sys.executable, "-m", "preflight", "check", "--", sys.executable, launcher, script],
                          capture_output=True, text=True, timeout=300)
    if done.returncode == 3 and 'File "launcher.py"' not in done.stderr:
        return CORRECT, "exit 3; " + next(x for x in done.stderr.splitlines() if "more line(s)" in x)[:120]
    return UNCLEAR, f"exit {done.returncode}, {done.stderr.count('launcher.py')} traceback lines shown"


ISSUE_24: list[Probe] = [
    Probe("real tensors the step writes (counter, globals, loss-side buffers)", T1, real_tensors_written),
    Probe("global optimizer (SWA) and module hooks", T1, global_hooks),
    Probe("another thread's random draws during the trace", T1, other_threads_draws),
    Probe("flags, environment and an outer dispatch mode", T1, flags_and_modes),
    Probe("a library layer failing only on fake tensors", T2, library_fails_on_fakes),
    Probe("LBFGS (step needs a closure)", T2, lbfgs),
    Probe("a loop holding its last output: no false leak", T2, leak_constant_hold),
    Probe("orthogonal parametrization (matrix_exp)", T3, orthogonal),
    Probe("optimizer in backward (post-accumulate-grad hooks)", T3, optimizer_in_backward),
    Probe("CLI --batch 100000000", T4, cli_huge_batch),
    Probe("config field of the wrong type", T4, lambda: est_cli(config={"hidden_size": "big"}, needle="hidden_size")),
    Probe("config heads not dividing the hidden size", T4, lambda: est_cli(config={"num_attention_heads": 5},
                                                                          needle="attention heads")),
    Probe("--budget 80 (no unit)", T4, lambda: est_cli("--budget", "80", needle="80GB")),
    Probe("a step under no_grad", T4, no_grad_message),
    Probe("anomaly detection on", T4, anomaly_detection),
    Probe("a jagged nested-tensor batch", T4, nested_batch),
    Probe("collate_fn failing on the combined worst case", T4, collate_combined),
    Probe("python -m preflight beside a folder named preflight", T4, shadowing_folder),
    Probe("Ctrl-C during the command's imports", T4, ctrl_c_during_imports),
    Probe("a daemonized grandchild of the checked script", T1, daemonized_grandchild),
    Probe("bitsandbytes' import-time log lines", T5, library_import_noise),
    Probe("a launcher's traceback after the verdict", T5, launcher_traceback),
]
PROBES.extend(ISSUE_24)


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
