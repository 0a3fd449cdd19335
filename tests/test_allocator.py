"""Hand-worked sequences for each rule of the caching-allocator model (c10/cuda/CUDACachingAllocator.cpp).

Every expected number is worked out in the comment above it. MiB = 2**20 bytes.
"""

from __future__ import annotations

import pytest

from preflight._result import Event
from preflight.allocator import AllocatorConfig, AllocatorResult, simulate

MiB = 1 << 20


def alloc_free(*sizes: int) -> list[tuple[int, int]]:
    """Allocate and at once free one storage per size, in order."""
    events = []
    for uid, size in enumerate(sizes):
        events += [(uid, size), (uid, -size)]
    return events


def test_requests_round_up_to_512_bytes():
    result = simulate([(1, 1), (2, 513), (3, 1024), (4, 0)])
    # 1 -> 512, 513 -> 1024, 1024 -> 1024, 0 bytes allocates nothing: 512 + 1024 + 1024 = 2560
    assert result.peak_allocated_bytes == 2560
    # all <= 1 MiB: one small-pool segment of 2 MiB
    assert result.peak_reserved_bytes == 2 * MiB
    assert result.num_segments == 1
    # reserved peaks with the first request, when 512 B of the 2 MiB were allocated
    assert result.fragmentation == 1 - 512 / (2 * MiB)


def test_small_requests_share_one_2mib_segment():
    result = simulate([(1, 100_000), (2, 200_000)])
    # 100_000 -> 196 * 512 = 100_352; 200_000 -> 391 * 512 = 200_192; both fit the first 2 MiB segment
    assert result.peak_allocated_bytes == 100_352 + 200_192
    assert result.peak_reserved_bytes == 2 * MiB
    assert result.num_segments_peak == 1


def test_small_pool_splits_off_a_512_byte_remainder():
    result = simulate([(1, MiB), (2, MiB - 512), (3, 1)])
    # 1 MiB + (1 MiB - 512) leaves 512 B of the 2 MiB segment: split off (>= 512) and taken by the 512 B request
    assert result.peak_allocated_bytes == 2 * MiB
    assert result.peak_reserved_bytes == 2 * MiB
    assert result.num_segments_peak == 1


@pytest.mark.parametrize(
    ("nbytes", "reserved"),
    [
        (MiB, 2 * MiB),  # exactly kSmallSize: still the small pool, a 2 MiB segment
        (MiB + 1, 20 * MiB),  # rounds to 1 MiB + 512 > kSmallSize: large pool, a kLargeBuffer segment
    ],
)
def test_small_pool_ends_at_1mib(nbytes, reserved):
    assert simulate([(1, nbytes)]).peak_reserved_bytes == reserved


def test_mid_size_requests_share_a_20mib_segment():
    result = simulate([(1, 5 * MiB), (2, 5 * MiB)])
    # 5 MiB < kMinLargeAlloc (10 MiB): a 20 MiB segment, split 5 + 15; the second 5 MiB comes from the 15
    assert result.peak_allocated_bytes == 10 * MiB
    assert result.peak_reserved_bytes == 20 * MiB
    assert result.num_segments == 1
    # at the reserved peak (the first request) 5 of 20 MiB were allocated
    assert result.fragmentation == 0.75


@pytest.mark.parametrize(
    ("nbytes", "allocated", "reserved"),
    [
        (30 * MiB, 30 * MiB, 30 * MiB),  # >= 10 MiB: a segment of its own, already a multiple of 2 MiB
        (31 * MiB, 32 * MiB, 32 * MiB),  # segment 32 MiB; the 1 MiB left is not > 1 MiB, so it stays in the block
        (10 * MiB, 10 * MiB, 10 * MiB),  # exactly kMinLargeAlloc: its own 10 MiB segment
        (10 * MiB - 512, 10 * MiB - 512, 20 * MiB),  # below 10 MiB: a 20 MiB segment, 10 MiB + 512 B split off
    ],
)
def test_large_requests_get_segments_rounded_to_2mib(nbytes, allocated, reserved):
    result = simulate([(1, nbytes)])
    assert (result.peak_allocated_bytes, result.peak_reserved_bytes) == (allocated, reserved)


def test_best_fit_picks_the_smallest_cached_block():
    # cached: a 12 MiB and a 16 MiB segment. 11 MiB takes the 12 (1 MiB left: not split, allocated 12 MiB);
    # 15 MiB then takes the 16 (1 MiB left). No new segment: 12 + 16 = 28 MiB reserved.
    # (Had 11 MiB taken the 16, the 15 MiB request would have needed a third segment: 44 MiB.)
    result = simulate(alloc_free(12 * MiB, 16 * MiB) + [(10, 11 * MiB), (11, 15 * MiB)])
    assert result.peak_reserved_bytes == 28 * MiB
    assert result.final_reserved_bytes == 28 * MiB
    assert result.peak_allocated_bytes == 28 * MiB  # 12 + 16, the whole unsplit blocks
    assert result.num_segments_peak == 2


@pytest.mark.parametrize(
    ("request_bytes", "peak_allocated"),
    [
        (11 * MiB, 17 * MiB),  # 12 - 11 = 1 MiB left: not > 1 MiB, not split: 12 + 5 = 17 MiB allocated
        (11 * MiB - 512, 16 * MiB - 512),  # 1 MiB + 512 left: split: (11 MiB - 512) + 5 MiB
    ],
)
def test_large_pool_splits_only_a_remainder_above_1mib(request_bytes, peak_allocated):
    # a cached 12 MiB segment serves the request; the 5 MiB request after it needs a new 20 MiB segment
    result = simulate([(1, 12 * MiB), (1, -12 * MiB), (2, request_bytes), (3, 5 * MiB)])
    assert result.peak_allocated_bytes == peak_allocated
    assert result.peak_reserved_bytes == 32 * MiB  # 12 + 20


@pytest.mark.parametrize(
    ("freed", "reserved"),
    [
        ((1, 2), 20 * MiB),  # neighbours: 6 + 6 merge into a free 12 MiB block; 11 MiB fits there
        ((1, 3), 32 * MiB),  # not neighbours: free 6 and 6 + 2 = 8 MiB; 11 MiB needs its own 12 MiB segment
    ],
)
def test_freed_neighbours_merge(freed, reserved):
    # three 6 MiB requests split one 20 MiB segment: [6][6][6][2 free]
    events = [(1, 6 * MiB), (2, 6 * MiB), (3, 6 * MiB)] + [(uid, -6 * MiB) for uid in freed] + [(4, 11 * MiB)]
    assert simulate(events).peak_reserved_bytes == reserved


def test_max_split_size_mb_stops_splitting_big_blocks():
    events = alloc_free(40 * MiB) + [(10, 30 * MiB), (11, 5 * MiB)]
    # Default: 30 MiB splits the cached 40 (10 left), and 5 MiB comes out of those 10. Reserved 40 MiB;
    # allocated at most 40 (the first request) against 30 + 5 = 35 later.
    default = simulate(events)
    assert (default.peak_reserved_bytes, default.peak_allocated_bytes) == (40 * MiB, 40 * MiB)
    # max_split_size 20 MiB: 30 MiB may take the 40 (40 < 30 + 20) but not split it: 40 MiB allocated.
    # 5 MiB then needs a new 20 MiB segment: reserved 60, allocated 40 + 5 = 45 MiB.
    capped = simulate(events, AllocatorConfig(max_split_size_mb=20))
    assert (capped.peak_reserved_bytes, capped.peak_allocated_bytes) == (60 * MiB, 45 * MiB)
    assert capped.num_segments_peak == 2


@pytest.mark.parametrize(
    ("request_bytes", "rounding_mb", "reserved"),
    [
        (19 * MiB, None, 60 * MiB),  # 19 < max_split 20 <= 40: no oversize block; new 20 MiB segment
        (20 * MiB, None, 60 * MiB),  # 40 >= 20 + 20 (max_non_split_rounding): too big to waste; new segment
        (21 * MiB, None, 40 * MiB),  # 40 < 21 + 20: reused whole
        (20 * MiB, 30, 40 * MiB),  # 40 < 20 + 30: reused whole
    ],
)
def test_oversize_blocks_serve_only_close_requests(request_bytes, rounding_mb, reserved):
    config = AllocatorConfig(max_split_size_mb=20, max_non_split_rounding_mb=rounding_mb)
    result = simulate(alloc_free(40 * MiB) + [(10, request_bytes)], config)
    assert result.peak_reserved_bytes == reserved


@pytest.mark.parametrize(
    ("divisions", "nbytes", "allocated"),
    [
        # the source's example (roundup_power2_next_division), in MiB: 1200 lies in [1024, 2048), whose
        # quarters are 1024, 1280, 1536, 1792: 1280 MiB
        (4, 1200 * MiB, 1280 * MiB),
        (8, 1100 * MiB, 1152 * MiB),  # eighths of [1024, 2048) MiB step by 128: 1152
        (4, 1024 * MiB, 1024 * MiB),  # a power of two stays
        (2, 614_400, 786_432),  # 600 KiB in [512, 1024) KiB, halves step by 256 KiB: 768 KiB
        (4, 1200, 1536),  # 1200 B is not > 512 * 4: plain 512-byte rounding, 3 * 512
        (None, 1200 * MiB, 1200 * MiB),  # off
    ],
)
def test_roundup_power2_divisions(divisions, nbytes, allocated):
    result = simulate([(1, nbytes)], AllocatorConfig(roundup_power2_divisions=divisions))
    assert result.peak_allocated_bytes == allocated


def test_expandable_segments_reserve_less_on_growing_requests():
    events = alloc_free(12 * MiB, 14 * MiB, 16 * MiB, 18 * MiB)
    # Default: each request is larger than every cached segment: 12 + 14 + 16 + 18 = 60 MiB in 4 segments.
    default = simulate(events)
    assert (default.peak_reserved_bytes, default.num_segments, default.peak_allocated_bytes) == (
        60 * MiB, 4, 18 * MiB)
    # Expandable: one 20 MiB page is mapped for 12 MiB; each free merges it back to a free 20 MiB block that
    # serves the next request: 20 MiB in one mapped range.
    expandable = simulate(events, AllocatorConfig(expandable_segments=True))
    assert (expandable.peak_reserved_bytes, expandable.num_segments, expandable.peak_allocated_bytes) == (
        20 * MiB, 1, 18 * MiB)
    assert expandable.fragmentation == 1 - 12 / 20  # the peak is reached by the first request


def test_expandable_segments_grow_by_whole_pages():
    config = AllocatorConfig(expandable_segments=True)
    # 12 MiB maps one 20 MiB page (8 MiB free at its end); 14 MiB uses those 8 and maps 6 more,
    # rounded up to another 20 MiB page: 40 MiB reserved in one contiguous segment, 26 MiB allocated.
    result = simulate([(1, 12 * MiB), (2, 14 * MiB)], config)
    assert (result.peak_reserved_bytes, result.peak_allocated_bytes, result.num_segments) == (40 * MiB, 26 * MiB, 1)
    # small requests map 2 MiB pages
    assert simulate([(1, 100)], config).peak_reserved_bytes == 2 * MiB


def test_expandable_best_fit_skips_the_block_before_unmapped_space():
    # [A 12][B 6][2 free | unmapped ...] in one 20 MiB page; freeing A leaves a free 12 MiB block at the start.
    # 2 MiB: the smallest fit is the 2 MiB block, but it borders unmapped space (it could grow), so best fit
    # takes the 12 MiB block: [C 2][10 free][B 6][2 free | unmapped].
    # 12 MiB then fits nowhere: it uses the last 2 MiB and maps 10 more, one 20 MiB page: 40 MiB reserved.
    events = [(1, 12 * MiB), (2, 6 * MiB), (1, -12 * MiB), (3, 2 * MiB), (4, 12 * MiB)]
    result = simulate(events, AllocatorConfig(expandable_segments=True))
    assert result.peak_reserved_bytes == 40 * MiB
    assert result.peak_allocated_bytes == 20 * MiB  # B 6 + C 2 + 12
    assert result.num_segments == 1


def test_oom_recovery_frees_cached_segments():
    events = alloc_free(12 * MiB, 14 * MiB) + [(10, 30 * MiB)]
    # 12 + 14 = 26 MiB cached; 30 MiB more would make 56 > 40: both unsplit segments are freed, then 30 fits.
    result = simulate(events, capacity_bytes=40 * MiB)
    assert not result.oom
    assert result.final_reserved_bytes == result.peak_reserved_bytes == 30 * MiB
    assert result.num_segments == 1  # at the 30 MiB peak
    assert result.num_segments_peak == 2  # the two cached segments before
    # without a capacity nothing is freed: 12 + 14 + 30
    assert simulate(events).peak_reserved_bytes == 56 * MiB


def test_oom_reports_the_event():
    events = [Event(1, 12 * MiB, 0, "fwd"), Event(2, 14 * MiB, 1, "fwd"), Event(2, -14 * MiB, 2, "fwd"),
              Event(3, 30 * MiB, 3, "bwd"), Event(4, MiB, 4, "bwd")]
    # freeing the cached 14 MiB leaves 12 live; 12 + 30 = 42 > 40: out of memory at the fourth event
    result = simulate(events, capacity_bytes=40 * MiB)
    assert (result.oom, result.oom_event_index, result.oom_op) == (True, 3, 3)
    assert result.final_reserved_bytes == 12 * MiB
    assert result.peak_reserved_bytes == 26 * MiB


@pytest.mark.parametrize(("capacity_mib", "oom"), [(45, True), (46, False)])
def test_oom_recovery_keeps_split_segments(capacity_mib, oom):
    # A 5 MiB live in a split 20 MiB segment; a cached 12 MiB segment. 25 MiB needs a 26 MiB segment:
    # 20 + 12 + 26 = 58 > capacity; the 12 MiB segment is freed, the split one stays: 20 + 26 = 46 MiB.
    events = [(1, 5 * MiB), (2, 12 * MiB), (2, -12 * MiB), (3, 25 * MiB)]
    result = simulate(events, capacity_bytes=capacity_mib * MiB)
    assert result.oom is oom
    assert result.final_reserved_bytes == (20 * MiB if oom else 46 * MiB)


def test_oom_with_max_split_size_frees_one_oversize_block_first():
    # cached: a 40 MiB (oversize) and a 2 MiB small-pool segment, 42 MiB. 5 MiB may not use the oversize
    # block and needs 20 MiB: 62 > 61. The smallest oversize block >= max(5, 20) MiB, the 40, is freed and the
    # retry fits; the small segment stays: 2 + 20 = 22 MiB.
    events = [(1, 40 * MiB), (2, 1000), (1, -1), (2, -1), (3, 5 * MiB)]
    result = simulate(events, AllocatorConfig(max_split_size_mb=20), capacity_bytes=61 * MiB)
    assert not result.oom
    assert result.final_reserved_bytes == 22 * MiB
    assert result.peak_reserved_bytes == 42 * MiB


def test_expandable_oom_recovery_unmaps_free_pages():
    # 20 MiB pages: A 20 fills page 0, B 20 page 1, C 10 half of page 2: [A][B][C 10][10 free | unmapped],
    # 60 MiB mapped. Freeing A leaves page 0 whole and free. D 25 MiB fits no free block; it would use the
    # last 10 MiB and map one more page: 80 > 60. Recovery unmaps page 0 (40 MiB left; the free 10 MiB at the
    # end is no whole page), then the retry maps the page after C: 60 MiB, now one range from 20 to 80 MiB.
    config = AllocatorConfig(expandable_segments=True)
    events = [(1, 20 * MiB), (2, 20 * MiB), (3, 10 * MiB), (1, -1), (4, 25 * MiB)]
    result = simulate(events, config, capacity_bytes=60 * MiB)
    assert (result.oom, result.final_reserved_bytes, result.peak_reserved_bytes) == (False, 60 * MiB, 60 * MiB)
    assert result.peak_allocated_bytes == 55 * MiB  # B 20 + C 10 + D 25
    # without a capacity page 0 stays mapped: 80 MiB
    assert simulate(events, config).peak_reserved_bytes == 80 * MiB


def test_events_can_be_objects_or_tuples_and_free_by_uid():
    events = [Event(7, 5 * MiB, -1, "before"), (8, 100), Event(7, -1, 0, "step1/forward"), (9, 5 * MiB)]
    result = simulate(events)
    # the free of uid 7 ignores its magnitude; 9 reuses the 20 MiB segment. Peak: 5 MiB + 512 B.
    assert result.peak_allocated_bytes == 5 * MiB + 512
    assert result.peak_reserved_bytes == 22 * MiB


def test_no_events():
    assert simulate([]) == AllocatorResult(0, 0, 0, 0, 0.0, 0)


def test_a_long_trace_reuses_one_segment():
    # 20_000 allocate/free pairs of 5 MiB: the first makes a 20 MiB segment, every later one reuses it
    result = simulate(alloc_free(*[5 * MiB] * 20_000))
    assert (result.peak_reserved_bytes, result.num_segments_peak, result.final_reserved_bytes) == (
        20 * MiB, 1, 20 * MiB)


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([(1, -5)], "frees uid 1, which is not allocated"),
        ([(1, 5), (1, 5)], "allocates uid 1, which is still allocated"),
        ([(1, 2, 3)], "expected a (uid, nbytes) tuple"),
        ([object()], "expected a (uid, nbytes) tuple"),
    ],
)
def test_bad_events_are_rejected(events, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        simulate(events)


def test_bad_simulate_arguments():
    with pytest.raises(ValueError, match="capacity_bytes must be a positive int or None, got 0"):
        simulate([], capacity_bytes=0)
    with pytest.raises(TypeError, match="AllocatorConfig.from_env"):
        simulate([], "expandable_segments:True")


def test_from_env_parses_the_simulated_options():
    config = AllocatorConfig.from_env(
        "expandable_segments:True, max_split_size_mb:128,roundup_power2_divisions:4,"
        "garbage_collection_threshold:0.6,max_non_split_rounding_mb:64")
    assert config == AllocatorConfig(max_split_size_mb=128, roundup_power2_divisions=4, expandable_segments=True,
                                     garbage_collection_threshold=0.6, max_non_split_rounding_mb=64)
    assert AllocatorConfig.from_env("") == AllocatorConfig()
    # options that do not move device bytes are accepted and ignored
    assert AllocatorConfig.from_env(
        "backend:native,release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True") == AllocatorConfig()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("max_split_sizemb:128", "Unknown allocator option 'max_split_sizemb'.*Known options: expandable_segments"),
        ("expandable_segments:true", "expandable_segments expects True or False, got 'true'"),
        ("max_split_size_mb:big", "max_split_size_mb expects a number, got 'big'"),
        ("max_split_size_mb", "Expected key:value"),
        ("max_split_size_mb:10", "max_split_size_mb must be a whole number of MiB >= 20.*got 10"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions must be a power of two.*got 3"),
        ("roundup_power2_divisions:[256:1,>:4]", "Per-size lists"),
        ("garbage_collection_threshold:1.5", "strictly between 0.0 and 1.0.*got 1.5"),
        ("backend:cudaMallocAsync", "does not simulate"),
        ("large_segment_size_mb:64", "does not simulate"),
    ],
)
def test_from_env_errors(value, message):
    with pytest.raises(ValueError, match=message):
        AllocatorConfig.from_env(value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_split_size_mb": 5}, "max_split_size_mb must be a whole number of MiB >= 20.*got 5"),
        ({"max_non_split_rounding_mb": 19}, "max_non_split_rounding_mb must be.*got 19"),
        ({"roundup_power2_divisions": -2}, "power of two.*got -2"),
        ({"expandable_segments": "True"}, "expandable_segments must be True or False; got 'True'"),
        ({"garbage_collection_threshold": 0.0}, "strictly between 0.0 and 1.0.*got 0.0"),
    ],
)
def test_config_checks_values_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AllocatorConfig(**kwargs)


def test_allocated_peak_between_reports_starts_from_what_is_allocated_when_the_span_begins():
    # As reset_peak_memory_stats() then max_memory_allocated() read it: the second span begins with 1 MiB
    # allocated and frees it at once, so its peak is that 1 MiB, not the 512 B allocated afterwards.
    MiB = 2**20
    events = [(1, MiB), (2, 3 * MiB), (2, -3 * MiB), (1, -MiB), (3, 512)]
    r = simulate(events, report_after=[2, 4])
    assert r.peak_allocated_between == (4 * MiB, MiB)
