"""A fake process group of any world size in this one process, as torchtitan's memory estimator uses one.

``torch.testing._internal.distributed.fake_pg.FakeStore`` with ``init_process_group("fake", ...)`` gives a default
group whose collectives return at once without touching data: FSDP2 runs its real program (sharding,
all-gathers, reduce-scatters) with every tensor shape of the rank it stands for, which on fake tensors is all a
memory trace needs.

Inside a real job (the callbacks run in one) the process already has its default group, and torch keeps one per
process. The fake world is then made beside it: c10d's Python registry (``distributed_c10d._world``, which torch
marks as its extension point for overriding that state, and the module-level maps its properties read) is set
aside for the duration of the trace and put back afterwards, and the fake groups are registered under names the
job's groups cannot have and unregistered one by one, so the job's groups, their names in the C++ registry and
the process's global rank are as they were.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ProcessGroupInUseError", "fake_world", "jobs_world"]

# c10d's module-level state behind `_World`'s properties (torch 2.4 to 2.13 keep the same names).
_REGISTRY = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag")
# Default groups are named by a counter from 0; the fake ones count from here, far from any job's.
_NAME_BASE = 7_000_000_000


class ProcessGroupInUseError(RuntimeError):
    """A fake process group cannot be made in this process (no distributed support, or c10d's registry is not
    the one this version of preflight knows how to set aside)."""


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, replicate: int | None = None, *,
               mesh: tuple[tuple[int, ...], tuple[str, ...]] | None = None) -> Iterator[Any]:
    """Initialise a fake default process group of ``world_size`` ranks as ``rank``, yield a CPU device mesh over it,
    and take it down on exit; a process group the job already has is set aside meanwhile and put back as it was
    (module docstring).

    ``replicate``: None gives a 1-D mesh; an int gives HSDP's 2-D mesh ``(replicate, world_size // replicate)`` with
    dims named ``("replicate", "shard")``, as ``init_device_mesh`` lays it out: ranks ``k * shard .. (k + 1) * shard -
    1`` form the ``k``-th shard group (one node's ranks), and ranks of equal index in the shard groups a replicate
    group. Its sub-groups are fake groups too, made and taken down with the default one. ``mesh``: ``(shape,
    dim names)`` of any other mesh (tensor parallelism's ``("dp", "tp")``), laid out the same way, row-major;
    it replaces ``replicate``.

    Raises:
        ProcessGroupInUseError: torch has no distributed support, or a process group is initialised and c10d's
            registry does not have the layout this module sets aside; the job's group is then not touched.
    """
    if mesh is not None and math.prod(mesh[0]) != world_size:
        raise ValueError(f"the mesh {mesh[0]} should hold the world size {world_size}.")
    if replicate is not None and (replicate < 1 or world_size % replicate):
        raise ValueError(f"`replicate` should divide the world size {world_size}, got {replicate!r}.")
    if not dist.is_available():
        raise ProcessGroupInUseError("torch.distributed is not available in this build of torch")
    # Imported here: importing preflight stays cheap, and works on builds of torch without distributed support.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch.distributed import distributed_c10d as c10d

    beside = dist.is_initialized()
    # init_process_group also sets two module globals and wraps sys.excepthook (to prefix "[rankN]:" to uncaught
    # errors); none of it is undone by destroy_process_group, so all three are put back here.
    hook = sys.excepthook
    backend, method = getattr(c10d, "_backend", None), getattr(c10d, "_default_pg_init_method", None)
    try:
        with _set_aside() if beside else contextlib.nullcontext():
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
            try:
                if mesh is not None:
                    yield init_device_mesh("cpu", mesh[0], mesh_dim_names=mesh[1])
                elif replicate is None:
                    yield init_device_mesh("cpu", (world_size,))
                else:
                    yield init_device_mesh("cpu", (replicate, world_size // replicate),
                                           mesh_dim_names=("replicate", "shard"))
            finally:
                if not beside:  # beside a job, `_set_aside` unregisters the fake groups one by one: destroying the
                    dist.destroy_process_group()  # default group would clear the job's names from the C++ registry
    finally:
        sys.excepthook = hook
        for name, value in (("_backend", backend), ("_default_pg_init_method", method)):
            if hasattr(c10d, name):
                setattr(c10d, name, value)


@contextlib.contextmanager
def _set_aside() -> Iterator[None]:
    """Run the body with an empty c10d registry; restore the job's afterwards and unregister what the body made."""
    from torch.distributed import distributed_c10d as c10d

    missing = [name for name in (*_REGISTRY, "_group_count", "_world", "_World", "_unregister_process_group")
               if not hasattr(c10d, name)]
    if missing:
        raise ProcessGroupInUseError(
            f"a process group ({dist.get_backend()}, world size {dist.get_world_size()}) is already initialised in "
            f"this process, and this torch's c10d registry lacks {', '.join(missing)}, so a fake one for the trace "
            "cannot be made beside it")
    saved = {name: getattr(c10d, name) for name in (*_REGISTRY, "_group_count", "_world")}
    global_rank = dist.get_rank()
    for name in _REGISTRY:
        setattr(c10d, name, {})
    c10d._group_count = _NAME_BASE
    c10d._world = c10d._World()
    _SET_ASIDE.append((saved, global_rank))
    try:
        yield
    finally:
        _SET_ASIDE.pop()
        made = dict(c10d._world.pg_names)
        for name, value in saved.items():
            setattr(c10d, name, value)
        for group, name in made.items():
            with contextlib.suppress(Exception):  # already unregistered, or a build without the registry
                c10d._unregister_process_group(name)
            with contextlib.suppress(Exception):
                group.shutdown()
        if hasattr(torch._C._distributed_c10d, "_set_global_rank"):  # init_process_group set the fake rank there
            torch._C._distributed_c10d._set_global_rank(global_rank)


# The job's registry and global rank while `_set_aside` holds them, innermost last (`jobs_world`).
_SET_ASIDE: list[tuple[dict[str, Any], int]] = []


@contextlib.contextmanager
def jobs_world() -> Iterator[None]:
    """Inside a `fake_world` made beside a job, run the block with the job's c10d registry and global rank back, so
    its collectives go over the job's own groups (a pipeline's ranks exchanging shapes between the turns of a trace
    that needs its fake groups alive throughout); the fake world is put back afterwards. Elsewhere: the block as
    it is."""
    if not _SET_ASIDE:
        yield
        return
    from torch.distributed import distributed_c10d as c10d

    saved, global_rank = _SET_ASIDE[0]  # the job's own: the outermost set aside
    fake = {name: getattr(c10d, name) for name in saved}
    fake_rank = dist.get_rank()
    for name, value in saved.items():
        setattr(c10d, name, value)
    if hasattr(torch._C._distributed_c10d, "_set_global_rank"):
        torch._C._distributed_c10d._set_global_rank(global_rank)
    try:
        yield
    finally:
        saved["_group_count"] = c10d._group_count  # groups the block made keep their names taken
        for name, value in fake.items():
            setattr(c10d, name, value)
        if hasattr(torch._C._distributed_c10d, "_set_global_rank"):
            torch._C._distributed_c10d._set_global_rank(fake_rank)
