"""A fake process group of any world size in this one process, as torchtitan's memory estimator uses one.

``torch.testing._internal.distributed.fake_pg.FakeStore`` with ``init_process_group("fake", ...)`` gives a default
group whose collectives return at once without touching data: FSDP2 runs its real program (sharding,
all-gathers, reduce-scatters) with every tensor shape of the rank it stands for, which on fake tensors is all a
memory trace needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["ProcessGroupInUseError", "fake_world"]


class ProcessGroupInUseError(RuntimeError):
    """A process group is already initialised in this process (a real distributed job): it is left alone."""


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[Any]:
    """Initialise a fake default process group of ``world_size`` ranks as ``rank``, yield a 1-D CPU device mesh over
    it, and destroy the group on exit.

    Raises:
        ProcessGroupInUseError: a process group is already initialised; it is not touched. torch has one default
            group per process, and a second fake one cannot be made beside it.
    """
    if not dist.is_available():
        raise ProcessGroupInUseError("torch.distributed is not available in this build of torch")
    if dist.is_initialized():
        raise ProcessGroupInUseError(
            f"a process group ({dist.get_backend()}, world size {dist.get_world_size()}) is already initialised in "
            "this process; a fake one for the trace cannot be made beside it")
    # Imported here: importing preflight stays cheap, and works on builds of torch without distributed support.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
