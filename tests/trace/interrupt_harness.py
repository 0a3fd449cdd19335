"""Interrupt `preflight.estimate` of a small GPT-2 with SIGINT at many moments; print one JSON line per attempt.

Run as a script by ``test_interrupts.py`` (a crash of this process is one of the outcomes counted). Each attempt
sends one SIGINT from a timer thread at a delay spread over the length of an uninterrupted estimate and records:

- ``interrupt``: `KeyboardInterrupt` out of `estimate` (the clean outcome);
- ``completed``: `estimate` returned the uninterrupted peak and the signal was sent after it had returned;
- ``swallowed``: the signal was sent before `estimate` returned, and it returned anyway;
- ``unclear``: it returned while the timer thread was between its two clock reads around ``os.kill`` (the thread
  can wait for the GIL there), so when the signal was sent is not known;
- ``wrong``: `estimate` returned another peak;

and whether the model is as before (the same parameter objects, no fakes) and the SIGINT handler is Python's own
again. A process killed by SIGABRT prints no summary line.

Usage: python interrupt_harness.py ATTEMPTS [--lightning]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
from torch._subclasses.fake_tensor import FakeTensor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for conftest's model builders

from conftest import make_gpt2  # noqa: E402

import preflight  # noqa: E402


def _state(model: torch.nn.Module) -> list:
    return [(name, id(t)) for name, t in (*model.named_parameters(), *model.named_buffers())]


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 1000, (2, 128), generator=gen),
            "labels": torch.randint(0, 1000, (2, 128), generator=gen)}


def main() -> None:
    attempts = int(sys.argv[1])
    import transformers

    transformers.logging.set_verbosity_error()
    if "--lightning" in sys.argv:
        return lightning(attempts)
    model = make_gpt2(n_layer=4)  # ~1-2 s per estimate on one core
    opt = torch.optim.AdamW(model.parameters())
    batch = _batch()
    before = _state(model)
    preflight.estimate(model, opt, batch)  # warm up: the first trace imports and compiles more
    start = time.perf_counter()
    baseline = preflight.estimate(model, opt, batch).peak_bytes
    seconds = time.perf_counter() - start
    print(json.dumps({"baseline": baseline, "seconds": seconds}), flush=True)
    for i in range(attempts):
        delay = seconds * 1.1 * (i + 0.5) / attempts  # spread over the whole estimate and a little after
        sent: list[float] = []  # the clock just before and just after os.kill
        timer = threading.Timer(delay, lambda: (sent.append(time.perf_counter()), os.kill(os.getpid(), signal.SIGINT),
                                                sent.append(time.perf_counter())))
        returned = peak = None
        outcome = None
        try:
            timer.start()
            peak = preflight.estimate(model, opt, batch).peak_bytes
            returned = time.perf_counter()
            timer.join()
            time.sleep(0.2)  # a signal sent after the return surfaces here
        except KeyboardInterrupt:
            outcome = "interrupt" if returned is None else None
        timer.join()
        if outcome is None:
            if peak != baseline:
                outcome = "wrong"
            elif sent and sent[-1] < returned:
                outcome = "swallowed"
            elif sent and sent[0] < returned:
                outcome = "unclear"
            else:
                outcome = "completed"
        restored = _state(model) == before and not any(
            isinstance(t, FakeTensor) for t in (*model.parameters(), *model.buffers()))
        handler = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        print(json.dumps({"delay": round(delay, 3), "outcome": outcome, "peak": peak, "restored": restored,
                          "handler_restored": handler}), flush=True)
    print(json.dumps({"after": preflight.estimate(model, opt, batch).peak_bytes}), flush=True)


def lightning(attempts: int) -> None:
    """The same through `PreflightCallback` in ``trainer.fit``: Lightning turns a `KeyboardInterrupt` into a graceful
    shutdown and ``sys.exit(1)`` (counted ``interrupt``); the timer starts when the callback's prediction does."""
    import lightning.pytorch as pl

    from preflight.integrations.lightning import PreflightCallback

    model = make_gpt2(n_layer=4)
    data = [{k: v[0] for k, v in _batch().items()}] * 2

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    module = Module()
    before = _state(module)
    timing: dict[str, float] = {}

    class Timer(pl.Callback):  # listed before PreflightCallback: its on_train_start runs first
        def __init__(self, delay: float | None) -> None:
            self.delay = delay

        def on_train_start(self, trainer, pl_module) -> None:
            timing["start"] = time.perf_counter()
            if self.delay is not None:
                timing["timer"] = threading.Timer(self.delay, lambda: (
                    timing.__setitem__("sending", time.perf_counter()), os.kill(os.getpid(), signal.SIGINT),
                    timing.__setitem__("sent", time.perf_counter())))
                timing["timer"].start()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            timing.setdefault("predicted", time.perf_counter())

    def fit(delay: float | None) -> tuple[int, int | None]:
        timing.clear()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning leaves SIG_IGN after an interrupt
        callback = PreflightCallback(verify_steps=0, check_eval=False)
        trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[Timer(delay), callback])
        loader = torch.utils.data.DataLoader(data, batch_size=2)
        try:
            trainer.fit(module, loader)
            status = 0
            if "timer" in timing:
                timing["timer"].join()
            time.sleep(0.2)  # a signal sent after fit returned surfaces here
        except SystemExit as exit_:  # Lightning's answer to a KeyboardInterrupt
            status = exit_.code
        except KeyboardInterrupt:
            status = "late"
        if "timer" in timing:
            timing["timer"].join()
        report = callback.report
        return status, None if report is None else report.predicted_peak_bytes

    _, baseline = fit(None)
    seconds = timing["predicted"] - timing["start"]
    print(json.dumps({"baseline": baseline, "seconds": seconds}), flush=True)
    for i in range(attempts):
        delay = seconds * 1.1 * (i + 0.5) / attempts
        status, peak = fit(delay)
        if status == 1:
            outcome = "interrupt"
        elif peak != baseline:
            outcome = "wrong"
        elif timing["sent"] < timing.get("predicted", float("inf")):
            outcome = "swallowed"
        elif timing["sending"] < timing.get("predicted", float("inf")):
            outcome = "unclear"
        else:
            outcome = "completed"
        restored = _state(module) == before and not any(
            isinstance(t, FakeTensor) for t in (*module.parameters(), *module.buffers()))
        print(json.dumps({"delay": round(delay, 3), "outcome": outcome, "peak": peak, "restored": restored,
                          "handler_restored": True}), flush=True)
    print(json.dumps({"after": fit(None)[1]}), flush=True)


if __name__ == "__main__":
    main()
