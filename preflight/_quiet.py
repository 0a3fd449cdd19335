"""Keep torch's noise about preflight's own work off the user's terminal: the CPU profiler's native log lines while
preflight measures (`StderrFilter`), the fake-tensor tracebacks logged during a trace whose failure preflight
reports itself (`handled_fake_tensor_errors`), and what an optional library logs when preflight, not the user,
imports it (`quiet_import_logs`).

Measuring on CPU runs ``torch.profiler`` with ``profile_memory=True`` (`preflight._verify.StepPeakMeter`,
`preflight._measure.cpu_profiled_peak`). Two pieces of C++ then write to file descriptor 2, below Python's
``sys.stderr``, so neither ``warnings`` filters nor ``contextlib.redirect_stderr`` reach them:

- kineto logs ``USDT: ... SyncActivityProfilerHandler.cpp:52] profiler_start`` (and ``profiler_stop``) at every
  start and stop. ``KINETO_LOG_LEVEL`` (read once, when kineto is first initialised) would hide them, but only
  if set before the process first profiles, and it is the user's environment, not ours to change.
- c10's ``ProfiledCPUMemoryReporter::Delete`` (``c10/core/CPUAllocator.cpp``) logs ``Memory block of unknown
  size was allocated before the profiling started`` when a tensor allocated before the profiler started is freed
  during the measured step (every step frees the previous batch), once per 1000 such frees.
  ``TORCH_CPP_LOG_LEVEL`` hides it only when set before ``import torch``; there is no runtime switch.

So `StderrFilter` points descriptor 2 at a temporary file for the measured window and, when it ends, writes
back everything captured except those lines: Python's own output (warnings, prints, progress bars) is kept, in
order, only delayed to the end of the window. A process that exits inside the window gets its captured output
back from an ``atexit`` handler (tracebacks included); one killed by a signal loses it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import IO

__all__ = ["StderrFilter", "handled_fake_tensor_errors", "quiet_import_logs"]

# The lines dropped: nothing else is.
NOISE = re.compile(rb"^USDT:.*\] profiler_(start|stop)\s*$"
                   rb"|CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the profiling")

_FD = 2
_lock = threading.Lock()
_active: StderrFilter | None = None  # descriptor 2 is process-wide: one filter at a time; nested ones do nothing


class StderrFilter:
    """Capture file descriptor 2 between `open` and `close`, then write it back without `NOISE`.

    Example:
        >>> quiet = StderrFilter().open()
        >>> ...  # start the profiler, run a step, stop it
        >>> quiet.close()

    Known limitations: output written to descriptor 2 inside the window appears when it closes, not as it is
    written; a filter opened while another is open does nothing (the outer one filters).
    """

    def __init__(self) -> None:
        self._saved: int | None = None
        self._capture: IO[bytes] | None = None

    def open(self) -> StderrFilter:
        global _active
        with _lock:
            if _active is not None:
                return self
            _flush_python_stderr()
            try:
                saved = os.dup(_FD)
            except OSError:  # no descriptor 2 (a daemon): nothing reaches a terminal, nothing to filter
                return self
            capture = tempfile.TemporaryFile()
            os.dup2(capture.fileno(), _FD)
            self._saved, self._capture = saved, capture
            _active = self
        atexit.register(self.close)
        return self

    def close(self) -> None:
        """Restore descriptor 2 and write back what was captured, less `NOISE` (idempotent)."""
        global _active
        with _lock:
            if self._saved is None or self._capture is None:
                return
            _flush_python_stderr()
            os.dup2(self._saved, _FD)
            os.close(self._saved)
            capture, self._saved, self._capture = self._capture, None, None
            _active = None
        atexit.unregister(self.close)
        with capture:
            capture.seek(0)
            kept = b"".join(line for line in capture.read().splitlines(keepends=True) if not NOISE.search(line))
        view = memoryview(kept)
        while view:
            view = view[os.write(_FD, view):]

    def __enter__(self) -> StderrFilter:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flush_python_stderr() -> None:
    stream = sys.stderr
    if stream is not None:
        stream.flush()


# torch/_subclasses/fake_tensor.py logs these with log.exception (20 to 34 lines of traceback) and then re-raises the
# same exception: the exception itself reaches preflight, which reports it (a labelled lower bound with the operator
# and the model's line, or the user's own error re-raised).
_FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
_HANDLED = frozenset({"failed while attempting to run meta for %s", "fake tensor raised TypeError"})


def _not_handled(record: logging.LogRecord) -> bool:
    return record.msg not in _HANDLED


@contextlib.contextmanager
def handled_fake_tensor_errors() -> Iterator[None]:
    """Drop the two fake-tensor ERROR records above while a trace runs (they accompany an exception preflight
    handles); every other record, and every record outside the trace, is kept. The logger's filters are as before
    on exit.

    Known limitation: a record of that logger from another thread during the trace is dropped too.
    """
    logger = logging.getLogger(_FAKE_TENSOR_LOGGER)
    logger.addFilter(_not_handled)
    try:
        yield
    finally:
        logger.removeFilter(_not_handled)


@contextlib.contextmanager
def quiet_import_logs(package: str) -> Iterator[None]:
    """Hold back ``package``'s log records below ERROR while preflight imports it for its own use: bitsandbytes
    logs, on a CPU build, that an optional 4-bit kernel package is missing, which says nothing about the run. The
    logger's level is restored afterwards, so the user's own use of the package logs as before."""
    logger = logging.getLogger(package)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
