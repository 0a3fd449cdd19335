"""The multi-process measurements' handling of frees the profiler loses on gloo's worker threads."""

from __future__ import annotations

from preflight._measure import placed_peaks

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
