"""The fake process group beside a job's own (`preflight.parallel._fake_group`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from preflight.parallel import fake_world
from preflight.parallel._fake_group import jobs_world


def test_jobs_world_puts_the_jobs_groups_back_for_a_block_inside_a_fake_world():
    """A pipeline read off a job exchanges shapes over the job's group between turns that need the fake world alive:
    inside `jobs_world` the job's default group, rank and registry are back; after it, the fake world's."""
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with jobs_world():  # no fake world: the block runs as it is
        assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        job, names = dist.group.WORLD, dict(c10d._world.pg_names)
        with fake_world(8, 6, mesh=((2, 4), ("pp", "tp"))) as mesh:
            fake = dist.group.WORLD
            assert fake is not job and dist.get_rank() == 6
            with jobs_world():
                assert dist.group.WORLD is job and (dist.get_rank(), dist.get_world_size()) == (1, 2)
                assert dict(c10d._world.pg_names) == names
                dist.all_reduce(torch.ones(2))  # a collective over the job's group
            assert dist.group.WORLD is fake and (dist.get_rank(), dist.get_world_size()) == (6, 8)
            assert dist.get_process_group_ranks(mesh["tp"].get_group()) == [4, 5, 6, 7]
        assert dist.group.WORLD is job and dist.get_rank() == 1 and dict(c10d._world.pg_names) == names
    finally:
        dist.destroy_process_group()
