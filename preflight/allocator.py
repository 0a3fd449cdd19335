"""Replay storage allocations and frees through a model of PyTorch's CUDA caching allocator, without a GPU.

A trace of live tensor storages gives ``torch.cuda.max_memory_allocated()`` only up to rounding; what
decides whether a run fits is ``torch.cuda.max_memory_reserved()``: the segments the allocator holds
from the driver, including cached free space it cannot reuse. `simulate` reproduces the placement rules
of ``DeviceCachingAllocator`` in c10/cuda/CUDACachingAllocator.cpp, with the options parsed by
c10/core/AllocatorConfig.{h,cpp} (PyTorch 2.x; constants as in torch 2.13's c10/core/AllocatorConfig.h).

Simulated (names are the C++ functions):
    - round_size: requests round up to 512 B, or to ``roundup_power2_divisions`` steps between powers of two.
    - get_pool / get_allocation_size: requests <= 1 MiB use the small pool, packed in 2 MiB segments;
      larger ones get a 20 MiB segment below 10 MiB, else a segment of their size rounded up to 2 MiB.
    - get_free_block: best fit among cached free blocks of the pool, ordered by (size, address); blocks
      >= ``max_split_size`` serve only requests >= ``max_split_size`` less than ``max_non_split_rounding``
      (20 MiB by default) smaller than the block.
    - should_split: the small pool splits off a remainder >= 512 B, the large pool one > 1 MiB (and only
      for requests below ``max_split_size``); an unsplit remainder stays in the block and counts as allocated.
    - free_block / try_merge_blocks: a freed block merges with free neighbours of its segment.
    - expandable segments: one segment per pool that grows by mapping 2 MiB (small) or 20 MiB (large)
      pages at its end, best fit preferring blocks that do not border unmapped space.
    - out of memory (``capacity_bytes``): when a new segment would not fit, free the smallest cached oversize
      block (release_available_cached_blocks, only with ``max_split_size_mb``), else every cached unsplit
      segment, or unmap every free page of expandable segments (release_cached_blocks), and retry once.

Not simulated:
    - Multiple streams, record_stream and the deferred frees of cross-stream blocks: one stream, frees are
      immediate. CUDA graph private pools, IPC sharing, the cudaMallocAsync backend.
    - ``garbage_collection_threshold``: PyTorch acts on it only after
      ``torch.cuda.set_per_process_memory_fraction`` and once reserved memory exceeds that fraction of the
      limit, freeing old cached blocks; so it can only matter near the limit. It is checked, then ignored.
    - Per-size-interval ``roundup_power2_divisions`` lists and ``large_segment_size_mb``: rejected.
    - Explicit ``torch.cuda.empty_cache()`` calls inside the events (they are not in the event stream); a caller
      that knows where they are (between training steps) passes them as ``empty_cache_after``, and they release
      what release_cached_blocks releases.
    - Addresses come from the driver; here segments are laid out one after another, which only decides
      ties between cached blocks of equal size.
    - Memory outside this allocator: the CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["AllocatorConfig", "AllocatorResult", "simulate"]

_MiB = 1 << 20
# Constants from c10/core/AllocatorConfig.h and c10/cuda/CUDACachingAllocator.cpp (C++ names in comments).
_MIN_BLOCK_SIZE = 512  # kMinBlockSize: every request is rounded up to a multiple of this
_SMALL_SIZE = _MiB  # kSmallSize: largest request of the small pool; large-pool remainders must exceed it
_SMALL_BUFFER = 2 * _MiB  # kSmallBuffer: small-pool segment, and its page with expandable segments
_LARGE_BUFFER = 20 * _MiB  # kLargeBuffer / large_segment_size(): segment for 1-10 MiB requests, large page
_MIN_LARGE_ALLOC = 10 * _MiB  # kMinLargeAlloc: from here on a request gets a segment of its own size
_ROUND_LARGE = 2 * _MiB  # kRoundLarge: ... rounded up to this
_MIN_OPTION_MB = _LARGE_BUFFER // _MiB  # AllocatorConfig.cpp: least max_split_size_mb, max_non_split_rounding_mb
_UNLIMITED = sys.maxsize  # max_split_size when unset (SIZE_MAX in C++)
_VIRTUAL_SPAN = _LARGE_BUFFER << 20  # address space of an expandable segment: a multiple of both page sizes
_ADDR = operator.attrgetter("addr")

_SIMULATED_KEYS = (
    "expandable_segments", "garbage_collection_threshold", "max_non_split_rounding_mb",
    "max_split_size_mb", "roundup_power2_divisions",
)
# Options that do not move device bytes of the native allocator: accepted and ignored.
_IGNORED_KEYS = (
    "graph_capture_record_stream_reuse", "per_process_memory_fraction", "pinned_free_catch_all",
    "pinned_num_register_threads", "pinned_reserve_segment_size_mb", "pinned_use_background_threads",
    "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc", "throw_on_cudamalloc_oom",
)


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """The options of ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` that decide where bytes go.

    Attributes:
        max_split_size_mb: cached blocks of this many MiB or more are never split and serve only requests of
            at least this size (and less than ``max_non_split_rounding_mb`` smaller than the block).
            None = unlimited, PyTorch's default. PyTorch requires >= 20.
        roundup_power2_divisions: round each request up to one of this many equal steps between the powers of
            two around it (a power of two). 0 or None = off: plain 512-byte rounding.
        expandable_segments: one segment per pool that grows page by page instead of one cudaMalloc per segment.
        garbage_collection_threshold: checked (0 < t < 1) but not simulated; see the module docstring: it only
            acts near a memory-fraction limit.
        max_non_split_rounding_mb: how many MiB an unsplittable cached block may exceed an oversize request by
            and still serve it. None = 20, PyTorch's default (kLargeBuffer). PyTorch requires >= 20.

    Example:
        >>> AllocatorConfig.from_env("expandable_segments:True,max_split_size_mb:128") == AllocatorConfig(
        ...     max_split_size_mb=128, expandable_segments=True)
        True
    """

    max_split_size_mb: int | None = None  # None: every block may be split, as in PyTorch
    roundup_power2_divisions: int | None = None  # None: 512-byte rounding only, as in PyTorch
    expandable_segments: bool = False  # PyTorch's default: one cudaMalloc per segment
    garbage_collection_threshold: float | None = None  # PyTorch's default: off
    max_non_split_rounding_mb: int | None = None  # None: 20 MiB, PyTorch's default

    def __post_init__(self) -> None:
        for name in ("max_split_size_mb", "max_non_split_rounding_mb"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < _MIN_OPTION_MB):
                raise ValueError(f"{name} must be a whole number of MiB >= {_MIN_OPTION_MB} "
                                 f"(PyTorch rejects smaller values), or None for the default; got {value!r}.")
        divisions = self.roundup_power2_divisions
        if divisions is not None and (type(divisions) is not int or divisions < 0 or divisions & (divisions - 1)):
            raise ValueError("roundup_power2_divisions must be a power of two (1, 2, 4, 8, 16, ...), or 0 or None "
                             f"to turn it off; got {divisions!r}.")
        if type(self.expandable_segments) is not bool:
            raise ValueError(f"expandable_segments must be True or False; got {self.expandable_segments!r}.")
        threshold = self.garbage_collection_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or not 0.0 < threshold < 1.0):
            raise ValueError("garbage_collection_threshold must be a number strictly between 0.0 and 1.0, or None; "
                             f"got {threshold!r}.")

    @classmethod
    def from_env(cls, value: str) -> AllocatorConfig:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` value.

        ``value`` is comma-separated ``key:value`` pairs, e.g. ``"expandable_segments:True,max_split_size_mb:128"``;
        spaces are ignored and a repeated key keeps its last value, as in PyTorch. Options that do not move
        device bytes (``backend:native``, ``release_lock_on_cudamalloc``, the ``pinned_*`` host options, ...) are
        accepted and ignored.

        Raises:
            ValueError: an unknown key (the known ones are listed), a malformed value, or an option that
                changes placement in a way this module does not simulate.
        """
        if not isinstance(value, str):
            raise TypeError(f"from_env takes the setting's text, e.g. os.environ['PYTORCH_CUDA_ALLOC_CONF']; "
                            f"got {type(value).__name__}.")
        fields: dict[str, Any] = {}
        text = "".join(value.split())
        if "[" in text:
            raise ValueError(f"Per-size lists such as roundup_power2_divisions:[256:1,>:4] are not simulated; got "
                             f"{value!r}. Give roundup_power2_divisions a single power of two.")
        for item in filter(None, text.split(",")):
            key, colon, raw = item.partition(":")
            if not colon or not raw:
                raise ValueError(f"Expected key:value in the allocator settings, got {item!r} in {value!r}.")
            if key in _IGNORED_KEYS or (key == "backend" and raw == "native"):
                continue
            if key == "backend" or key == "large_segment_size_mb":
                raise ValueError(f"{key}:{raw} changes the allocator in a way preflight does not simulate. "
                                 f"Remove it to simulate the native allocator with its default segment sizes.")
            if key not in _SIMULATED_KEYS:
                known = ", ".join(_SIMULATED_KEYS + _IGNORED_KEYS + ("backend",))
                raise ValueError(f"Unknown allocator option {key!r} in {value!r}. Known options: {known}.")
            try:
                if key == "expandable_segments":
                    if raw not in ("True", "False"):  # PyTorch's ConfigTokenizer accepts exactly these
                        raise ValueError
                    fields[key] = raw == "True"
                elif key == "garbage_collection_threshold":
                    fields[key] = float(raw)
                else:
                    fields[key] = int(raw)
            except ValueError:
                expected = "True or False" if key == "expandable_segments" else "a number"
                raise ValueError(f"Allocator option {key} expects {expected}, got {raw!r}.") from None
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class AllocatorResult:
    """What the simulated allocator reports after the replay.

    Attributes:
        peak_allocated_bytes: the most bytes in blocks handed out at once, as ``torch.cuda.max_memory_allocated()``:
            requests after round_size, plus any unsplit remainder left in their block.
        peak_reserved_bytes: the most bytes held from the driver at once, as ``torch.cuda.max_memory_reserved()``.
        num_segments: segments held when reserved bytes first reached their peak (with expandable segments:
            contiguous mapped ranges, as ``torch.cuda.memory_snapshot()`` lists them).
        num_segments_peak: the most segments held at once.
        fragmentation: ``1 - allocated / reserved`` at that same moment; 0.0 when nothing was reserved.
        final_reserved_bytes: bytes reserved after the last event, or when the replay stopped at an OOM.
        oom: a request did not fit in ``capacity_bytes`` even after freeing cached memory; the replay stopped.
        oom_event_index: the position of that request in ``events``; None without an OOM.
        oom_op: that event's ``op`` attribute when it has one (preflight's `Event`); None otherwise.
        reserved_after: reserved bytes after each event index of ``simulate``'s ``report_after`` (before an
            ``empty_cache`` there), in that order.
        peak_reserved_between: the reserved peak within each span of events those indices close (the first from
            the start), in the same order.
        peak_allocated_between: the allocated peak within each such span, counted from the bytes allocated when
            the span began, as ``torch.cuda.reset_peak_memory_stats()`` at its start and
            ``max_memory_allocated()`` at its end read it.
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    num_segments: int
    num_segments_peak: int
    fragmentation: float
    final_reserved_bytes: int
    oom: bool = False
    oom_event_index: int | None = None
    oom_op: int | None = None
    reserved_after: tuple[int, ...] = ()
    peak_reserved_between: tuple[int, ...] = ()
    peak_allocated_between: tuple[int, ...] = ()


def simulate(
    events: Iterable[Any], config: AllocatorConfig | None = None, *, capacity_bytes: int | None = None,
    empty_cache_after: Iterable[int] = (), report_after: Iterable[int] = (),
) -> AllocatorResult:
    """Replay ``events`` through the caching-allocator model and return its peak statistics.

    Args:
        events: in order, objects with ``uid`` and ``nbytes`` (such as preflight's `Event`) or ``(uid, nbytes)``
            tuples. ``nbytes > 0`` allocates a storage with that uid; ``nbytes < 0`` frees the storage with that
            uid (the magnitude is not used); ``nbytes == 0`` is skipped, as PyTorch allocates nothing for it.
        config: allocator options; the default is PyTorch's default allocator.
        capacity_bytes: bytes the allocator may reserve (device memory less the CUDA context and other
            processes). None = unlimited. When a new segment would exceed it, cached memory is freed and the
            request retried as PyTorch does; if it still does not fit, the replay stops and ``oom`` is set.
        empty_cache_after: event indices after which ``torch.cuda.empty_cache()`` runs (every cached unsplit
            segment released; with expandable segments, every free page unmapped).
        report_after: event indices after which the reserved bytes are read (``reserved_after``; the peak of each
            span they close in ``peak_reserved_between``): the end of each training step, say.

    Returns:
        An `AllocatorResult`.

    Raises:
        ValueError: an event is malformed, frees a uid that is not allocated, or allocates a live uid again.

    Example:
        >>> r = simulate([(1, 5 << 20), (2, 100), (1, -(5 << 20))])
        >>> r.peak_allocated_bytes, r.peak_reserved_bytes  # 5 MiB + 512 B; a 20 MiB and a 2 MiB segment
        (5243392, 23068672)
    """
    if config is None:
        config = AllocatorConfig()
    elif not isinstance(config, AllocatorConfig):
        raise TypeError(f"config must be an AllocatorConfig, got {type(config).__name__}. "
                        "Use AllocatorConfig.from_env(...) to read an environment string.")
    if capacity_bytes is not None and (type(capacity_bytes) is not int or capacity_bytes <= 0):
        raise ValueError(f"capacity_bytes must be a positive int or None, got {capacity_bytes!r}.")
    sim = _Allocator(config, capacity_bytes)
    live = sim.live
    emptied, reported = set(empty_cache_after), set(report_after)
    reserved_after: list[int] = []
    peaks: list[int] = []
    allocated_peaks: list[int] = []
    span_peak = span_allocated = 0
    for index, event in enumerate(events):
        try:
            uid, nbytes = event if type(event) is tuple else (event.uid, event.nbytes)
        except (AttributeError, ValueError):
            raise ValueError(f"Event {index} is {event!r}; expected a (uid, nbytes) tuple or an object "
                             "with .uid and .nbytes.") from None
        if nbytes > 0:
            if uid in live:
                raise ValueError(f"Event {index} allocates uid {uid}, which is still allocated. "
                                 "Free a storage before its uid is used again.")
            if not sim.malloc(uid, nbytes):
                return sim.result(oom_event_index=index, oom_op=getattr(event, "op", None))
        elif nbytes < 0:
            if uid not in live:
                raise ValueError(f"Event {index} frees uid {uid}, which is not allocated. Every free needs an "
                                 "earlier allocation in the same events; storages alive before the trace must "
                                 "be listed as allocations first.")
            sim.free(uid)
        if reported or emptied:
            span_peak = max(span_peak, sim.reserved)
            span_allocated = max(span_allocated, sim.allocated)
            if index in reported:
                reserved_after.append(sim.reserved)
                peaks.append(span_peak)
                allocated_peaks.append(span_allocated)
                span_peak, span_allocated = 0, sim.allocated
            if index in emptied:
                sim._release_cached_blocks()
    return dataclasses.replace(sim.result(), reserved_after=tuple(reserved_after),
                               peak_reserved_between=tuple(peaks), peak_allocated_between=tuple(allocated_peaks))


class _Block:
    """A range of a segment, free or allocated; ``prev``/``next`` link the ranges of one segment by address."""

    __slots__ = ("size", "addr", "pool", "prev", "next", "allocated", "mapped")

    def __init__(self, size: int, addr: int, pool: _Pool, mapped: bool = True) -> None:
        self.size = size
        self.addr = addr
        self.pool = pool
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.mapped = mapped  # False only for the unmapped address space of an expandable segment


class _Pool:
    """Cached free blocks of one pool as a sorted list of (size, address): bisect gives the best fit."""

    __slots__ = ("small", "page", "keys", "unmapped")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.page = _SMALL_BUFFER if small else _LARGE_BUFFER  # expandable-segment page size
        self.keys: list[tuple[int, int]] = []
        self.unmapped: list[_Block] = []  # expandable segments only, sorted by address


def _round_size(size: int, divisions: int) -> int:
    """round_size(), with one division count for every size interval."""
    if size < _MIN_BLOCK_SIZE:
        return _MIN_BLOCK_SIZE
    if divisions > 1 and size > _MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(size, divisions)
    return -(-size // _MIN_BLOCK_SIZE) * _MIN_BLOCK_SIZE


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """roundup_power2_next_division(); the source's example: 1200 with 4 divisions lies in [1024, 2048),
    whose steps are 1024, 1280, 1536 and 1792, so it rounds up to 1280."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    return -(-size // step) * step


def _allocation_size(size: int) -> int:
    """get_allocation_size(): the segment cudaMalloc'd for a request no cached block can serve."""
    if size <= _SMALL_SIZE:
        return _SMALL_BUFFER
    if size < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return -(-size // _ROUND_LARGE) * _ROUND_LARGE


def _link_after(block: _Block, new: _Block) -> None:
    new.prev, new.next = block, block.next
    if block.next is not None:
        block.next.prev = new
    block.next = new


def _link_before(block: _Block, new: _Block) -> None:
    new.prev, new.next = block.prev, block
    if block.prev is not None:
        block.prev.next = new
    block.prev = new


class _Allocator:
    """DeviceCachingAllocator for one device and one stream, with its statistics."""

    def __init__(self, config: AllocatorConfig, capacity: int | None) -> None:
        self.expandable = config.expandable_segments
        self.divisions = config.roundup_power2_divisions or 0
        mb = config.max_split_size_mb
        self.max_split = _UNLIMITED if mb is None else mb * _MiB
        mb = config.max_non_split_rounding_mb
        self.max_rounding = _LARGE_BUFFER if mb is None else mb * _MiB
        self.capacity = capacity
        self.small, self.large = _Pool(True), _Pool(False)
        self.free_blocks: dict[int, _Block] = {}  # cached (free, mapped) blocks by address
        self.live: dict[int, _Block] = {}  # allocated blocks by uid
        self.next_addr = 0  # bump pointer for segment addresses, kept a multiple of both page sizes
        self.allocated = self.reserved = self.segments = 0
        self.peak_allocated = self.peak_reserved = self.peak_segments = 0
        self.allocated_at_peak = self.segments_at_peak = 0
        self.peak_pending = False  # reserved just peaked; record allocated once the request holds its block

    def result(self, oom_event_index: int | None = None, oom_op: int | None = None) -> AllocatorResult:
        self._record_peak()
        reserved = self.peak_reserved
        return AllocatorResult(
            peak_allocated_bytes=self.peak_allocated,
            peak_reserved_bytes=reserved,
            num_segments=self.segments_at_peak,
            num_segments_peak=self.peak_segments,
            fragmentation=1.0 - self.allocated_at_peak / reserved if reserved else 0.0,
            final_reserved_bytes=self.reserved,
            oom=oom_event_index is not None,
            oom_event_index=oom_event_index,
            oom_op=oom_op,
        )

    # malloc() and free() of DeviceCachingAllocator.
    def malloc(self, uid: int, nbytes: int) -> bool:
        size = _round_size(nbytes, self.divisions)
        pool = self.small if size <= _SMALL_SIZE else self.large
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_block(pool, size)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, size)
            if block is None:
                return False
        if self._should_split(block, size):
            rest = _Block(block.size - size, block.addr + size, pool)
            _link_after(block, rest)
            block.size = size
            self._insert(rest)
        block.allocated = True
        self.live[uid] = block
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        self._record_peak()
        return True

    def free(self, uid: int) -> None:
        block = self.live.pop(uid)
        block.allocated = False
        self.allocated -= block.size
        self._absorb(block, block.prev)
        self._absorb(block, block.next)
        self._insert(block)

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.small or self.expandable:
            return remaining >= _MIN_BLOCK_SIZE
        return size < self.max_split and remaining > _SMALL_SIZE

    # Statistics.
    def _grow(self, nbytes: int, segments: int) -> None:
        self.reserved += nbytes
        self.segments += segments
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
            self.peak_pending = True
        if self.segments > self.peak_segments:
            self.peak_segments = self.segments

    def _record_peak(self) -> None:
        if self.peak_pending:
            self.allocated_at_peak, self.segments_at_peak = self.allocated, self.segments
            self.peak_pending = False

    # The cached free blocks.
    def _insert(self, block: _Block) -> None:
        bisect.insort(block.pool.keys, (block.size, block.addr))
        self.free_blocks[block.addr] = block

    def _remove(self, block: _Block) -> None:
        keys = block.pool.keys
        del keys[bisect.bisect_left(keys, (block.size, block.addr))]
        del self.free_blocks[block.addr]

    def _absorb(self, dst: _Block, src: _Block | None) -> None:
        """try_merge_blocks(): ``dst`` (in no list) takes over its free neighbour ``src`` of the same mapping."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._remove(src)
        else:
            src.pool.unmapped.remove(src)
        if src is dst.prev:
            dst.addr, dst.prev = src.addr, src.prev
            if src.prev is not None:
                src.prev.next = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size

    def _expandable_size(self, block: _Block) -> int:
        after = block.next
        return block.size + (after.size if after is not None and not after.mapped else 0)

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        keys = pool.keys
        i = bisect.bisect_left(keys, (size,))  # the smallest block >= size; ties go to the lowest address
        if i == len(keys):
            return None
        if self.expandable:  # a block bordering unmapped space counts as all it could grow to
            blocks, grow = self.free_blocks, self._expandable_size
            while i + 1 < len(keys) and grow(blocks[keys[i + 1][1]]) < grow(blocks[keys[i][1]]):
                i += 1
        found, addr = keys[i]
        if size < self.max_split <= found:  # no oversize block for a request below max_split_size
            return None
        if size >= self.max_split and found >= size + self.max_rounding:
            return None
        del keys[i]
        return self.free_blocks.pop(addr)

    # New segments and giving them back.
    def _alloc_block(self, pool: _Pool, size: int) -> _Block | None:
        if self.expandable:
            return self._alloc_expandable(pool, size)
        nbytes = _allocation_size(size)
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return None  # cudaMalloc fails
        block = _Block(nbytes, self.next_addr, pool)
        self.next_addr += -(-nbytes // _LARGE_BUFFER) * _LARGE_BUFFER
        self._grow(nbytes, 1)
        return block

    def _release_block(self, block: _Block) -> None:
        self._remove(block)
        self._grow(-block.size, -1)

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """Free the smallest cached oversize block that covers the request, else the largest ones until they do."""
        if self.max_split == _UNLIMITED or self.expandable:
            return False
        keys, key = pool.keys, max(size, self.max_split)
        i = bisect.bisect_left(keys, (key,))
        if i < len(keys):
            self._release_block(self.free_blocks[keys[i][1]])
            return True
        released = 0
        for j in range(i - 1, -1, -1):
            if released >= key or keys[j][0] < self.max_split:
                break
            released += keys[j][0]
            self._release_block(self.free_blocks[keys[j][1]])
        return released >= key

    def _release_cached_blocks(self) -> None:
        """Free every cached segment that is not split, or every free page of expandable segments."""
        for pool in (self.large, self.small):
            for block in [self.free_blocks[addr] for _, addr in pool.keys]:
                if self.expandable:
                    self._unmap_block(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)

    # Expandable segments.
    def _alloc_expandable(self, pool: _Pool, size: int) -> _Block | None:
        """try_allocate_expandable_block(): map pages after the lowest free space that can grow to ``size``."""
        block = self._find_expandable_block(pool, size)
        if not block.mapped and not self._map_block(block, min(block.size, size)):
            return None
        while block.size < size:
            after = block.next
            if not self._map_block(after, min(size - block.size, after.size)):
                return None
            block = after  # it has taken over ``block``
        self._remove(block)
        return block

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        for unmapped in pool.unmapped:
            start = unmapped.prev if unmapped.prev is not None and not unmapped.prev.allocated else unmapped
            room, block = 0, start
            while room < size and block is not None and not block.allocated:
                room += block.size
                block = block.next
            if room >= size:
                return start
        segment = _Block(_VIRTUAL_SPAN, self.next_addr, pool, mapped=False)
        self.next_addr += _VIRTUAL_SPAN
        pool.unmapped.append(segment)  # the highest address so far: the list stays sorted
        return segment

    def _map_block(self, block: _Block, size: int) -> bool:
        pool = block.pool
        nbytes = -(-size // pool.page) * pool.page  # unmapped blocks start and end on page boundaries
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return False  # cuMemCreate fails; the pages of this call are given back
        pool.unmapped.remove(block)
        block.mapped = True
        if nbytes < block.size:
            rest = _Block(block.size - nbytes, block.addr + nbytes, pool, mapped=False)
            _link_after(block, rest)
            bisect.insort(pool.unmapped, rest, key=_ADDR)
            block.size = nbytes
        before, after = block.prev, block.next
        # a new mapped range, unless it extends or joins neighbouring ones
        self._grow(nbytes, 1 - (before is not None and before.mapped) - (after is not None and after.mapped))
        self._absorb(block, before)
        self._absorb(block, after)
        self._insert(block)
        return True

    def _unmap_block(self, block: _Block) -> None:
        """unmap_block(): give back the whole pages inside a cached block of an expandable segment."""
        page = block.pool.page
        begin, end = -(-block.addr // page) * page, (block.addr + block.size) // page * page
        if begin >= end:
            return
        self._remove(block)
        if begin > block.addr:
            _link_before(block, head := _Block(begin - block.addr, block.addr, block.pool))
            self._insert(head)
        if end < block.addr + block.size:
            _link_after(block, tail := _Block(block.addr + block.size - end, end, block.pool))
            self._insert(tail)
        block.addr, block.size, block.mapped = begin, end - begin, False
        before, after = block.prev, block.next
        self._grow(begin - end, (before is not None and before.mapped) + (after is not None and after.mapped) - 1)
        self._absorb(block, before)
        self._absorb(block, after)
        bisect.insort(block.pool.unmapped, block, key=_ADDR)
