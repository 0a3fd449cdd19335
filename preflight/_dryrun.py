"""The dry-run protocol between ``preflight check -- python train.py`` and the checks inside the user's script.

``preflight check`` runs the user's script with these environment variables; a preflight check inside it (the
callbacks, ``preflight.check``) predicts, writes its report, and ends the process before step one:

=======================  =========================================================================
``PREFLIGHT_DRY_RUN=1``   stop after the prediction: exit 0 if the run fits, 3 if it does not, 5 if the step fails
``PREFLIGHT_REPORT``      where to write the JSON report (the ``check`` command reads it back)
``PREFLIGHT_GPU``         plan for this catalog GPU instead of the local device
``PREFLIGHT_BUDGET``      plan against this many bytes ("80GB", "24GiB") instead of the device's capacity
``PREFLIGHT_WORLD_SIZE``  plan per rank for this many data-parallel ranks
``PREFLIGHT_SHARDING``    ... with this sharding (ddp, zero1, zero2, zero3, fsdp-full, fsdp-grad-op, fsdp2)
``PREFLIGHT_HEADROOM``    keep this fraction of the budget free
``PREFLIGHT_SUGGEST=0``   when it does not fit, skip the ranked suggestions (``check --no-suggest``)
=======================  =========================================================================
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

__all__ = ["EXIT_FITS", "EXIT_DOES_NOT_FIT", "EXIT_NO_VERDICT", "EXIT_STEP_FAILS", "EXIT_USAGE", "DryRunSettings",
           "settings_from_env", "finish", "finish_failed_step"]

EXIT_FITS = 0
EXIT_DOES_NOT_FIT = 3  # not 1: a crash of the script itself exits 1, and must not read as "does not fit"
EXIT_USAGE = 2  # argparse's convention for bad input
# The model could not be traced and its lower bound is under the budget: nothing is known either way, and a job
# script must not read that as "fits".
EXIT_NO_VERDICT = 4
# The training step would raise at step one (`preflight.StepWouldFailError`: a dtype or device mismatch, an index out
# of range): there is no peak to compare, and the real run would crash.
EXIT_STEP_FAILS = 5


@dataclasses.dataclass(frozen=True)
class DryRunSettings:
    """What ``preflight check`` asked of the checks in the script (all None/False when run normally)."""

    dry_run: bool = False
    report_path: str | None = None
    gpu: str | None = None
    budget: str | None = None
    world_size: int | None = None
    sharding: str | None = None
    headroom: float | None = None
    fast: bool | None = None  # `preflight check --full`: False
    suggest: bool = True  # `preflight check --no-suggest`: False

    def run(self) -> Any:
        """What ``preflight check``'s flags say of the run, as a `preflight.Run` whose unset fields are defaults (to
        lay over the script's own with `Run.over`)."""
        from preflight._run import Run, Target
        from preflight.parallel import ParallelPlan

        parallel = None
        if self.world_size:
            parallel = ParallelPlan(self.world_size, self.sharding or ("ddp" if self.world_size > 1 else None),
                                    source="preflight check --world-size")
        return Run(target=Target(gpu=self.gpu, budget=self.budget), parallel=parallel,
                   fast=True if self.fast is None else self.fast)


def settings_from_env(environ: dict[str, str] | None = None) -> DryRunSettings:
    """Read the ``PREFLIGHT_*`` variables.

    Raises:
        ValueError: ``PREFLIGHT_WORLD_SIZE`` is not a positive integer.
    """
    env = os.environ if environ is None else environ
    world = env.get("PREFLIGHT_WORLD_SIZE")
    if world is not None and (not world.isdigit() or int(world) < 1):
        raise ValueError(f"PREFLIGHT_WORLD_SIZE should be a positive integer, got {world!r}.")
    headroom = env.get("PREFLIGHT_HEADROOM")
    try:
        headroom_value = float(headroom) if headroom else None
    except ValueError:
        raise ValueError(f"PREFLIGHT_HEADROOM should be a fraction such as 0.1, got {headroom!r}.") from None
    return DryRunSettings(
        dry_run=env.get("PREFLIGHT_DRY_RUN", "").lower() in ("1", "true", "yes"),
        report_path=env.get("PREFLIGHT_REPORT") or None,
        gpu=env.get("PREFLIGHT_GPU") or None,
        budget=env.get("PREFLIGHT_BUDGET") or None,
        world_size=int(world) if world else None,
        sharding=env.get("PREFLIGHT_SHARDING") or None,
        headroom=headroom_value,
        fast={"0": False, "1": True}.get(env.get("PREFLIGHT_FAST", "")),
        suggest=env.get("PREFLIGHT_SUGGEST", "1") != "0",
    )


def finish(report: dict[str, Any], fits: bool, settings: DryRunSettings | None = None) -> None:
    """End a dry run: write ``report`` where ``PREFLIGHT_REPORT`` says, then exit 0 (fits) or 3 (does not fit).

    Does nothing unless a dry run was requested.
    """
    settings = settings or settings_from_env()
    if not settings.dry_run:
        return
    if settings.report_path:
        with open(settings.report_path, "w") as f:
            json.dump(report, f, indent=2)
    sys.stdout.flush()
    # os._exit would skip the user's atexit handlers and buffered output; SystemExit unwinds normally.
    raise SystemExit(EXIT_FITS if fits else EXIT_DOES_NOT_FIT)


def finish_failed_step(message: str, settings: DryRunSettings | None = None) -> None:
    """End a dry run whose step would fail (`preflight.StepWouldFailError`): write ``{"step_would_fail": message}``
    where ``PREFLIGHT_REPORT`` says, then exit 5. Does nothing unless a dry run was requested."""
    settings = settings or settings_from_env()
    if not settings.dry_run:
        return
    if settings.report_path:
        with open(settings.report_path, "w") as f:
            json.dump({"step_would_fail": message}, f, indent=2)
    print(f"preflight: {message}", file=sys.stderr)
    sys.stdout.flush()
    raise SystemExit(EXIT_STEP_FAILS)
