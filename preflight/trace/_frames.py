"""Name the line of the user's code that is running: where a trace stopped, or where it had to assume a value.

A failing operator alone (``aten._local_scalar_dense.default``) does not say which ``.item()`` of which model
asked for it. The innermost frame outside torch, preflight and the import machinery does: the model's own
line, e.g. ``modeling_wav2vec2.py:691 in forward``.
"""

from __future__ import annotations

import os
import sys
import types

import torch

__all__ = ["failure_site", "user_frame"]

_SKIPPED_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, sys.modules["preflight"])
)


def _is_user(filename: str) -> bool:
    if filename.startswith("<frozen") or "importlib" in filename:
        return False
    return not os.path.abspath(filename).startswith(_SKIPPED_DIRS)


def _describe(filename: str, lineno: int, function: str) -> str:
    name = os.path.basename(filename)
    if name == "__init__.py":  # a package's own module: name the package
        name = os.path.join(os.path.basename(os.path.dirname(filename)), name)
    return f"{name}:{lineno} in {function}"


def user_frame(frame: types.FrameType | None = None) -> str | None:
    """The innermost user frame of the current stack (or from ``frame`` outwards), as ``file.py:line in func``."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if _is_user(code.co_filename):
            return _describe(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


def failure_site(err: BaseException) -> str:
    """Where ``err`` was raised, for an error raised in Python rather than by an operator: the raising line, and
    the innermost user line that led to it when they differ, e.g. ``"RuntimeError at module.py:950 in _apply,
    called from modeling_switch_transformers.py:98 in forward"``."""
    tb = err.__traceback__
    raised = user = None
    while tb is not None:
        code = tb.tb_frame.f_code
        raised = _describe(code.co_filename, tb.tb_lineno, code.co_name)
        if _is_user(code.co_filename):
            user = raised
        tb = tb.tb_next
    site = f"{type(err).__name__} at {raised}"
    return site if user is None or user == raised else f"{site}, called from {user}"
