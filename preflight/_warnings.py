"""Warnings that point at the user's line: the first frame outside preflight, its integrations and the standard
library's wrappers (``contextlib``, ``functools``), so that a warning raised deep in preflight is shown where the
user called it, never at ``contextlib.py`` or ``sys:1``."""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_SKIPPED = (_HERE + os.sep, os.path.join(os.path.dirname(_HERE), "integrations") + os.sep,
            os.path.dirname(os.path.abspath(warnings.__file__)) + os.sep + "contextlib.py",
            os.path.dirname(os.path.abspath(warnings.__file__)) + os.sep + "functools.py")


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the innermost frame outside preflight."""
    frame = sys._getframe(1)
    level = 2  # stacklevel 1 is this function; 2 its caller, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIPPED):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 1)
