"""How much memory a run may use: the budget, and the share of it kept free."""

from __future__ import annotations

import torch

from preflight._device import device_capacity
from preflight._gpus import get_gpu
from preflight._units import parse_bytes

__all__ = ["DEFAULT_HEADROOM", "check_budget", "check_headroom", "resolve_budget", "usable_bytes"]

# Kept free by default: the allocator's fragmentation (reserved above allocated is typically 5-10% on
# transformer training), the CUDA context and library workspaces, which peak_bytes does not count.
DEFAULT_HEADROOM = 0.10


def resolve_budget(budget: int | float | str | None, *, device: torch.device | str | None = None,
                   gpu: str | None = None) -> int | None:
    """The budget in bytes: ``budget`` if given ("24GiB", "80GB", an int), else ``gpu``'s memory from the
    catalog, else the CUDA device's capacity, else None (a CPU run has no budget unless one is given).

    Raises:
        ValueError: an unreadable size, a budget of 0 bytes or an unknown GPU name (the message lists the accepted
            forms).
    """
    if budget is not None:
        return check_budget(budget)
    if gpu is not None:
        return get_gpu(gpu).memory_bytes
    if device is not None:
        return device_capacity(torch.device(device))
    return None


def usable_bytes(budget: int, headroom: float) -> int:
    """The part of ``budget`` a prediction may fill: ``budget * (1 - headroom)``."""
    check_headroom(headroom)
    return int(budget * (1.0 - headroom))


def check_budget(budget: int | float | str) -> int:
    """``budget`` in bytes (`preflight._units.parse_bytes`), named in the error; 0 bytes is refused: nothing trains
    in it, and a verdict against it says nothing."""
    nbytes = parse_bytes(budget, name="budget")
    if nbytes == 0:
        raise ValueError(f"`budget` should be more than 0 bytes, got {budget!r}. Pass the memory the run may use, "
                         "e.g. 24GiB or 80GB, or leave it out to use the GPU's capacity.")
    return nbytes


def check_headroom(headroom: float) -> None:
    if not isinstance(headroom, (int, float)) or isinstance(headroom, bool) or not 0.0 <= headroom < 1.0:
        raise ValueError(f"`headroom` should be a fraction in [0, 1), got {headroom!r}.")
