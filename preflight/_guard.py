"""Leave the process as preflight found it: random streams, warning filters, logging configuration.

Every public entry point (`preflight.estimate`, `preflight.check`, `preflight.advise`, `preflight.max_batch_size`,
the callbacks' hooks, the accelerate helper, the CLI) runs inside `untouched`. What preflight does there can change
process-wide state as a side effect of something else:

- importing a library for the first time: ``rich.console`` consumes Python's ``random`` stream on import (the first
  printed report), ``bitsandbytes`` adds a ``warnings`` filter (the 8-bit optimizer suggestion);
- running the user's own code on fake tensors: a model may call ``warnings.filterwarnings``, ``torch.manual_seed``
  or set a logger's level from its forward;
- preflight's own quietening of torch's loggers during a trace (`preflight._quiet.handled_fake_tensor_errors`).

`untouched` keeps the random streams as they would be without preflight (`preflight.trace.isolated_rng`: Python's
``random`` and numpy's global ``RandomState`` routed per thread, so other threads' draws are not rewound; torch's
CPU generator and, where CUDA is initialised, every CUDA device's generator through `CudaRng`, replaceable for
tests, restored), and on exit puts back torch's grad mode and default dtype, ``warnings.filters``, and for the root
logger and every logger that existed before: its level, handlers, filters, ``propagate`` and ``disabled``, plus
``logging.disable``'s level. Each distinct warning raised in the window is shown once (`_each_warning_once`): the
per-rank traces of one estimate would otherwise repeat it once per rank. It guards preflight's work only: the
callbacks wrap their own hooks, never the user's training step that runs between them. The per-step verification
hooks that open and close a measured window are not wrapped (the guard's own snapshot would be an allocation inside
the window); the work they finish with (`preflight.verdict.VerifySession.finish`: traces, the printed report) is.

Known limitations: loggers first created inside the window (by a library's import) keep the configuration their
library gave them; "once" warning registries are not restored (a warning preflight triggered may not repeat).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from preflight.trace._process import CudaRng, isolated_rng

__all__ = ["CudaRng", "untouched"]


CUDA = CudaRng()  # the seam through which `untouched` reaches the CUDA generators


@contextlib.contextmanager
def untouched() -> Iterator[None]:
    """Run the body, then put back the process-wide state listed in the module docstring. Usable as a decorator
    (``@untouched()``); nesting is harmless.

    Example:
        >>> with untouched():  # doctest: +SKIP
        ...     import rich.console  # consumes random's stream; restored on exit
    """
    saved_grad, saved_dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    saved_filters = list(warnings.filters)
    saved_logging = _logging_state()
    try:
        # preflight's work is a training run's, whatever mode the caller is in: tensors made under inference mode
        # could never require grad.
        with isolated_rng(cuda=CUDA), torch.inference_mode(False), _each_warning_once():
            yield
    finally:
        torch.set_grad_enabled(saved_grad)
        torch.set_default_dtype(saved_dtype)
        if warnings.filters != saved_filters:
            warnings.filters[:] = saved_filters
            mutated = getattr(warnings, "_filters_mutated", None)  # what catch_warnings calls on exit (3.8-3.13)
            if mutated is not None:
                mutated()  # drop the decisions cached under the filters preflight's window had
        _restore_logging(saved_logging)


@contextlib.contextmanager
def _each_warning_once() -> Iterator[None]:
    """While open, each distinct warning (category, text, file, line) is shown once, as it is raised, as Python's
    "default" action shows a warning once per location. Without it, a warning the traced code raises on every rank's
    trace (or every candidate set-up's) prints once per trace: each ``catch_warnings`` exit inside the window
    (preflight's own, a library's) invalidates the registries that keep a shown warning from repeating. Filters
    apply as before (an ``"error"`` filter raises, ``"ignore"`` drops); a ``catch_warnings(record=True)`` opened
    inside records every warning as it would."""
    seen: set[tuple[type[Warning], str, str, int]] = set()
    previous = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        key = (category, str(message), filename, lineno)
        if key not in seen:
            seen.add(key)
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:  # not if something in the window put its own in place and kept it
            warnings.showwarning = previous


def _logging_state() -> tuple[int, dict[str, tuple[logging.Logger, tuple[Any, ...]]]]:
    loggers = {name: logger for name, logger in logging.Logger.manager.loggerDict.items()
               if isinstance(logger, logging.Logger)}
    loggers[""] = logging.root
    return logging.root.manager.disable, {name: (logger, _logger_state(logger)) for name, logger in loggers.items()}


def _logger_state(logger: logging.Logger) -> tuple[Any, ...]:
    return logger.level, list(logger.handlers), list(logger.filters), logger.propagate, logger.disabled


def _restore_logging(saved: tuple[int, dict[str, tuple[logging.Logger, tuple[Any, ...]]]]) -> None:
    disable, loggers = saved
    if logging.root.manager.disable != disable:
        logging.disable(disable)
    changed = False
    for logger, state in loggers.values():
        if _logger_state(logger) != state:
            level, handlers, filters, propagate, disabled = state
            logger.level = level  # not setLevel: that would clear every logger's cache each time
            logger.handlers[:] = handlers
            logger.filters[:] = filters
            logger.propagate, logger.disabled = propagate, disabled
            changed = True
    if changed:
        logging.Logger.manager._clear_cache()  # the effective levels loggers cached under the changed ones
