"""Ctrl-C during a trace: one clean `KeyboardInterrupt` at a safe point, the model put back, no result returned.

Python raises `KeyboardInterrupt` at whatever bytecode runs when SIGINT arrives. During a trace much of that
Python code is called from C++: the `StorageTracker`'s ``__torch_dispatch__``, the storage-free finalizers and the
weak-dictionary callbacks that fire when a fake tensor dies. An exception there is either swallowed ("Exception
ignored in ...": the trace then misses a free, and returns a peak that is too high) or thrown through C++ that
cannot carry it (``terminate called after throwing an instance of 'pybind11::error_already_set'``: SIGABRT).

`deferred_interrupts` (entered around every trace, main thread only) replaces the SIGINT handler with one that
records the interrupt and returns. The interrupt is raised at the next safe point, Python code that is not
called from a callback: `check` (the tracker calls it before each operator), and the exit of the outermost
region, after the model was restored and the trace's leftovers swept. The user's own handler is put back on
exit, and gets the interrupt: Python's default raises `KeyboardInterrupt` (at the next operator already, see
above), a handler of the user's is called once per press after the trace, and ``SIG_DFL`` re-sends the signal. An interrupted trace never returns a result: if the interrupt was recorded and no
`KeyboardInterrupt` is propagating at the exit (the user's code caught it), one is raised there.

A second Ctrl-C before the first reached a safe point (the user's code ran no tensor operation in between, e.g. a
long pure-Python loop) interrupts at once, as Python normally does: like any interrupt without preflight, it can
land in a callback. Once the user's code has finished or unwound (`finishing`: restoring the model, sweeping),
every Ctrl-C waits for the exit, so the model is always put back.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["check", "deferred_interrupts", "finishing", "requested"]


class _State:
    depth = 0  # nested regions (a trace inside advise inside check)
    installed = False
    previous: Any = None  # the handler to put back
    pending = 0  # interrupts recorded and not yet raised
    raised = False  # a KeyboardInterrupt for the pending interrupt was raised (by `check` or the handler)
    finishing = 0  # the user's code is done: every interrupt waits for the exit
    raises = True  # the handler put back is Python's default (`KeyboardInterrupt`), not one of the user's


_state = _State()


def _record(signum: int, frame: Any) -> None:
    """The SIGINT handler during a trace: record; raise only for a second press no safe point has seen."""
    _state.pending += 1
    if _state.pending >= 2 and _state.raises and not _state.raised and not _state.finishing:
        _state.raised = True
        raise KeyboardInterrupt


def requested() -> bool:
    """An interrupt is waiting for a safe point (cheap: for the tracker's per-operator test)."""
    return bool(_state.pending) and _state.raises and not _state.raised


def check() -> None:
    """A safe point: raise `KeyboardInterrupt` once for an interrupt recorded since the region began (when the
    handler in place before was Python's default; a handler of the user's is called at the region's exit)."""
    if _state.pending and _state.raises and not _state.raised and not _state.finishing:
        _state.raised = True
        raise KeyboardInterrupt


@contextlib.contextmanager
def finishing(begun: bool = True) -> Iterator[Callable[[], None]]:
    """Interrupts wait for the region's exit from when this begins (on entry, or, with ``begun=False``, when the
    yielded ``begin()`` is called: the user's code has finished or is unwinding) to the end of the block."""
    started = False

    def begin() -> None:
        nonlocal started
        if not started:
            started = True
            _state.finishing += 1

    if begun:
        begin()
    try:
        yield begin
    finally:
        if started:
            _state.finishing -= 1


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Defer SIGINT to safe points while the body runs (see the module docstring). Reentrant; a no-op off the main
    thread (signals are handled there) and where the handler is not Python's to change (``SIG_IGN``, or one set
    from C)."""
    outermost = _state.depth == 0
    if outermost:
        _state.pending, _state.raised, _state.finishing = 0, False, 0
        _install()
    _state.depth += 1
    propagating: BaseException | None = None
    try:
        yield
    except BaseException as err:
        propagating = err
        raise
    finally:
        _state.depth -= 1
        if outermost:
            _uninstall()
        _deliver(propagating, outermost)


def _install() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGINT)
    if current is None or current is signal.SIG_IGN:  # set from C, or ignored: not ours to change
        return
    _state.previous = current
    # Python's default, or a handler that does what it does (the ``preflight`` command's, which also remembers the
    # press in case a library swallows the KeyboardInterrupt): interrupt at the next safe point.
    _state.raises = current is signal.default_int_handler or getattr(current, "raises_keyboard_interrupt", False)
    signal.signal(signal.SIGINT, _record)
    _state.installed = True


def _uninstall() -> None:
    if _state.installed:
        signal.signal(signal.SIGINT, _state.previous)
        _state.installed = False


def _deliver(propagating: BaseException | None, outermost: bool) -> None:
    """At a region's exit: hand a recorded interrupt on (raise, or call the user's handler)."""
    if not _state.pending:
        return
    if isinstance(propagating, KeyboardInterrupt):
        if outermost:  # it carries the interrupt out: nothing more to deliver
            _state.pending, _state.raised = 0, False
        return
    if not outermost:
        if _state.raised or _state.finishing:
            return  # the outermost exit delivers it
        _state.raised = True
        raise KeyboardInterrupt from propagating
    previous, presses = _state.previous, _state.pending
    _state.pending, _state.raised, _state.previous, _state.raises = 0, False, None, True
    if previous is signal.default_int_handler or previous is None:
        raise KeyboardInterrupt from propagating
    if getattr(previous, "raises_keyboard_interrupt", False):
        previous(signal.SIGINT, None)  # records the press, raises KeyboardInterrupt
    if previous is signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)  # what the process would have done: end by SIGINT
        return
    for _ in range(presses):
        previous(signal.SIGINT, sys._getframe(1))  # the user's own handler, once per press (it may raise)
