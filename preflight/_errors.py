"""Exceptions raised by preflight."""

from __future__ import annotations

__all__ = ["PreflightError"]


class PreflightError(RuntimeError):
    """The run is predicted not to fit, or preflight was asked to stop it.

    Raised before any optimizer step, so nothing of the user's state has changed. ``report`` holds the
    prediction (a dict as written to the JSON report) when there is one.
    """

    def __init__(self, message: str, report: dict | None = None) -> None:
        super().__init__(message)
        self.report = report
