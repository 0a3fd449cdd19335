"""The CPU measurement's reading of the profiler: frees of blocks from before the measured window, and the
multi-process measurements' handling of frees the profiler loses on gloo's worker threads."""

from __future__ import annotations

import pytest
import torch

from preflight._device import live_storages
from preflight._measure import cpu_profiled_peak, frees_placed, placed_peaks, session_peak

A, B, C, D = 0x1000, 0x2000, 0x3000, 0x4000


def test_a_lost_free_is_placed_at_the_end_of_its_call():
    # B (20 B) is allocated in the first call (times 0-10) and its free is lost; nothing holds it at the end.
    # C (30 B) comes in the second call: with B still counted the curve reaches 60, with B's free at the end of
    # its call 40 (A and C), and without B at all 40 too.
    events = [(0, 10, A), (1, 20, B), (12, 30, C), (13, -30, C)]
    assert placed_peaks(events, [(0, 10), (11, 20)], alive={A}) == (60, 40, 40)
    # A block a live tensor holds at the end is not lost, whatever the calls.
    assert placed_peaks(events, [(0, 10), (11, 20)], alive={A, B}) == (60, 60, 60)


def test_a_reuse_proves_a_lost_free_and_the_call_end_can_come_before_it():
    # B's address is allocated again at time 30 with no free recorded in between: its first block's free was lost.
    # The repaired figure frees it just before the reuse, so it is alive with D (allocated at 20): 70. Placed at the
    # end of its call (time 5) it is gone before D: 50, as without it.
    events = [(0, 20, B), (20, 50, D), (25, -50, D), (30, 20, B)]
    assert placed_peaks(events, [(0, 5)], alive={B}) == (70, 50, 50)
    # Allocated outside any call: the free stays just before the reuse.
    assert placed_peaks(events, [], alive={B}) == (70, 70, 50)


def test_a_verified_step_puts_back_the_frees_gloo_threads_made_of_what_collectives_allocated():
    # The callbacks' meter: A (10 B) and B (20 B) are allocated by collective operators (indices 0 and 1) in the
    # forward, which ends at time 10; C (30 B, not a collective's) lives in the backward. Nothing holds A or B at the
    # end and no free was recorded: gloo's worker thread dropped them, at the latest as the forward ended.
    events = [(0, 10, A), (1, 20, B), (12, 30, C), (13, -30, C)]
    placed = frees_placed(events, handed={0, 1}, ends=[10], alive=lambda: {C})
    assert session_peak(placed) == (30, 0)
    # Without the phase's end, the free cannot be placed before the step ends: both stay counted.
    assert session_peak(frees_placed(events, handed={0, 1}, ends=[], alive=lambda: set())) == (60, 30)
    # A block no collective allocated (DDP's buckets, held by C++ alone) stays counted, held or not.
    assert session_peak(frees_placed(events, handed={0}, ends=[10], alive=lambda: set())) == (50, 20)
    # A block a live tensor holds is not lost; nor is any when the scan of live tensors failed.
    assert session_peak(frees_placed(events, handed={0, 1}, ends=[10], alive=lambda: {B})) == (50, 20)
    assert session_peak(frees_placed(events, handed={0, 1}, ends=[10], alive=lambda: None)) == (60, 30)


def test_a_reuse_proves_a_lost_free_in_a_verified_step_whoever_allocated_the_block():
    # B's address is allocated again at time 30 with no free in between: freed just before, with D alive (70);
    # allocated by a collective in a phase that ended at 5, freed there (50).
    events = [(0, 20, B), (20, 50, D), (25, -50, D), (30, 20, B)]
    never = lambda: pytest.fail("no block is left to ask about")  # noqa: E731
    assert session_peak(frees_placed(events, handed=set(), ends=[5], alive=never)) == (70, 20)
    assert session_peak(frees_placed(events, handed={0}, ends=[5], alive=never)) == (50, 20)


def _collective_allocations(rank, world, port, queue):
    """One rank: a functional all-reduce (its output allocated inside the operator) beside a plain clone, in one
    profile; which allocations `_walked_profile` reads as a collective's."""
    import torch.distributed._functional_collectives as funcol
    from conftest import gloo_rank
    from torch.profiler import ProfilerActivity, profile

    from preflight._measure import _walked_profile

    with gloo_rank(rank, world, port):
        x = torch.ones(1000)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            plain = x.clone()
            reduced = funcol.all_reduce(x * 2, "sum", list(range(world))).wait()
        allocations, _, handed = _walked_profile(prof)
        # (the functional collective's bookkeeping allocates a few bytes too)
        sizes = {"handed": sorted(allocations[i][1] for i in handed if allocations[i][1] >= 1000),
                 "all": sorted(n for _, n, _ in allocations if n >= 1000)}
        queue.put((rank, (sizes, float(reduced[0]), float(plain[0]))))


def test_the_blocks_a_collective_operator_allocates_are_told_apart():
    from conftest import spawned

    for rank, (sizes, reduced, plain) in spawned(_collective_allocations, 2).items():
        # x * 2 and the clone are the caller's; the all-reduce's output is the operator's.
        assert (reduced, plain) == (4.0, 1.0), rank
        assert sizes == {"handed": [4000], "all": [4000, 4000, 4000]}, (rank, sizes)


def test_a_free_of_a_block_from_before_counts_only_if_the_baseline_holds_it():
    # The profiler sized the free of the block at A from a stale record (300 B; the block is 4 B): a block that
    # lived at A earlier was allocated while profiling and freed while not, and its entry stayed.
    events = [(100, B), (-300, A), (100, C)]
    assert session_peak(events) == (100, -100)  # the recorded size: the window reads 100 B low
    assert session_peak(events, resident={}) == (200, 200)  # not in the baseline: its free does not count
    assert session_peak(events, resident={A: 4}) == (196, 196)  # in the baseline: its own size
    # A block allocated and freed in the window counts as recorded either way.
    assert session_peak([(50, A), (-50, A), (20, B)], resident={A: 4}) == (50, 20)


def test_measuring_ignores_frees_of_blocks_outside_its_baseline():
    """A real profiler: a block allocated in an earlier profiled session is freed in the measured one."""
    held = {}
    cpu_profiled_peak(lambda: held.update(old=torch.ones(1 << 18)))  # 1 MiB, its size recorded by that session

    def window() -> None:
        del held["old"]  # freed first: without a baseline the curve starts 1 MiB down
        held["new"] = torch.ones(1 << 17)  # 512 KiB

    peak, _ = cpu_profiled_peak(window, resident={})
    assert peak == (1 << 17) * 4
    # A resident block's free is recorded where a profiled session allocated it (the previous step's window, in a
    # trainer): it counts, at the block's own size.
    cpu_profiled_peak(lambda: held.update(old=torch.ones(1 << 18)))
    resident = live_storages([held["old"]], torch.device("cpu"))
    held.pop("new")
    peak, _ = cpu_profiled_peak(window, resident=resident)  # the baseline holds it: its free counts
    assert peak == 0 and sum(resident.values()) == (1 << 18) * 4


def _handed_back(rank, world, port, queue):
    """One rank: 40 synchronous all-gathers inside `collective_calls`, each followed at once by a look at how many
    references the tensors handed to gloo still have (1: only ours, the worker has let go), in one profile."""
    from conftest import gloo_rank
    from torch.profiler import ProfilerActivity, profile

    import torch.distributed as dist
    from preflight._measure import collective_calls

    with gloo_rank(rank, world, port):
        original = dist.all_gather_into_tensor
        counts = []
        with collective_calls("## "), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(40):
                out, local = torch.empty(2 * 4096), torch.full((4096,), float(rank))
                dist.all_gather_into_tensor(out, local)
                counts.append((out._use_count(), local._use_count()))
                assert out[4096:].eq(1).all() and out[:4096].eq(0).all()
        ranges = sum(e.name == "## all_gather_into_tensor" for e in prof.events())
        queue.put((rank, (set(counts), ranges, dist.all_gather_into_tensor is original)))


@pytest.mark.slow
def test_collective_calls_return_after_gloo_has_let_go_of_the_tensors_and_name_each_call():
    # A free gloo's worker thread makes is lost to the profiler (the CPU measurements of multi-process runs); inside
    # collective_calls a synchronous collective returns only once the worker released what it was handed, so the
    # caller's own del frees the block on its thread.
    from conftest import spawned

    for rank, (counts, ranges, restored) in spawned(_handed_back, 2).items():
        assert (counts, ranges, restored) == ({(1, 1)}, 40, True), rank


def _functional_handed_back(rank, world, port, queue):
    """One rank: 40 functional all-gathers (as DTensor issues them), each input dropped as soon as it is issued (as
    a column-parallel layer's local output is), inside `collective_calls`, in one profile."""
    import torch.distributed._functional_collectives as funcol
    from conftest import gloo_rank
    from torch.profiler import ProfilerActivity, profile

    from preflight._measure import _profiled_allocations, collective_calls

    with gloo_rank(rank, world, port):
        group, results = list(range(world)), []
        with collective_calls("## "), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            for _ in range(40):
                local = torch.full((64, 64), float(rank))
                gathered = funcol.all_gather_tensor(local, 0, group)
                del local
                results.append(all(bool(gathered[64 * r:64 * (r + 1)].eq(r).all()) for r in range(world)))
                del gathered
        ranges = sum(e.name == "## all_gather_into_tensor" for e in prof.events())
        sizes = [nbytes for _, nbytes, _ in _profiled_allocations(prof)[0]]
        queue.put((rank, (set(results), ranges, sizes.count(64 * 64 * 4), sizes.count(-64 * 64 * 4))))


@pytest.mark.slow
def test_functional_collectives_inside_collective_calls_free_on_the_callers_thread():
    # DTensor's redistributions issue functional collectives, which return before gloo has run them: an input the
    # caller drops at once was freed on gloo's thread, lost to the profiler (a tensor-parallel Llama's 8 MiB logits
    # shard read as alive through the loss, now and then, on a loaded machine). Inside collective_calls each is
    # waited for as issued, named, and returns once gloo has let go: every input is freed in view.
    from conftest import spawned

    for rank, (results, ranges, allocated, freed) in spawned(_functional_handed_back, 2).items():
        assert (results, ranges, freed) == ({True}, 40, allocated) and allocated >= 40, (rank, allocated, freed)
