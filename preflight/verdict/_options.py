"""`Options`: what preflight does with a prediction (headroom, overflow policy, verification, outputs), checked at
construction. How the run trains is the `preflight.Run`, not an option."""

from __future__ import annotations

import dataclasses
import os


from preflight._budget import DEFAULT_HEADROOM, check_headroom

__all__ = ["ON_OVERFLOW_CHOICES", "Options"]


ON_OVERFLOW_CHOICES = ("raise", "warn")


@dataclasses.dataclass(frozen=True)
class Options:
    """The callbacks' common options, checked at construction (see ``preflight.integrations``).

    How the run trains (precision, loop, target and its budget, parallel plan) is the `preflight.Run`; these say
    what preflight does with its prediction.

    Attributes:
        headroom: fraction of the budget kept free (see `preflight._budget.DEFAULT_HEADROOM` for why 0.10).
        on_overflow: ``"raise"`` or ``"warn"`` when the prediction exceeds the usable budget. ``"raise"`` (fail
            fast) also stops the run before step one when a dataset sample raises as the scan reads it; ``"warn"``
            leaves that sample out and names it (`scan_on_error`).
        verify_steps: optimizer steps measured at the start of training to check the prediction; 0 disables.
        report_path: where to write the JSON report (rank zero), or None.
        plot_path: where to write a PNG of the predicted timeline and breakdown (needs matplotlib), or None.
        check_eval: also predict the evaluation step when there is an eval dataloader.
        suggest: when the run does not fit, rank what to change with `preflight.advice.advise` (rank zero; it
            traces each option, about ten more traces).
    """

    headroom: float = DEFAULT_HEADROOM
    on_overflow: str = "raise"
    verify_steps: int = 3
    report_path: str | os.PathLike | None = None
    plot_path: str | os.PathLike | None = None
    check_eval: bool = True
    suggest: bool = True

    def __post_init__(self) -> None:
        check_headroom(self.headroom)
        if self.on_overflow not in ON_OVERFLOW_CHOICES:
            raise ValueError(f"`on_overflow` should be either of {ON_OVERFLOW_CHOICES}, got {self.on_overflow!r}.")
        if isinstance(self.verify_steps, bool) or not isinstance(self.verify_steps, int) or self.verify_steps < 0:
            raise ValueError(f"`verify_steps` should be a non-negative integer (0 disables), "
                             f"got {self.verify_steps!r}.")
        for name in ("report_path", "plot_path"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"`{name}` should be a file path or None, got {value!r}.")
        for name in ("check_eval", "suggest"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` should be True or False, got {getattr(self, name)!r}.")

    @property
    def scan_on_error(self) -> str:
        """What the dataset scan does with a sample that raises when read: stop the run before step one (the user
        asked to fail fast: ``on_overflow="raise"``), or leave it out and say so."""
        return "raise" if self.on_overflow == "raise" else "skip"
