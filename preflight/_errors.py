"""Exceptions raised by preflight."""

from __future__ import annotations

__all__ = ["PreflightError", "StepWouldFailError"]


class PreflightError(RuntimeError):
    """The run is predicted not to fit, or preflight was asked to stop it.

    Raised before any optimizer step, so nothing of the user's state has changed. ``report`` holds the
    prediction (a dict as written to the JSON report) when there is one.
    """

    def __init__(self, message: str, report: dict | None = None) -> None:
        super().__init__(message)
        self.report = report


class StepWouldFailError(RuntimeError):
    """The training step would raise at its first step (a dtype or device mismatch, an index out of range), so
    there is no peak to predict.

    The message holds the real kernel's error, the operator, the user's line and the tensors involved, and how to
    fix it; ``__cause__`` is the error the real run raises (e.g. ``IndexError('index out of range in self')``).
    Raised by `preflight.estimate` and the checks built on it, before any number is reported.
    """
