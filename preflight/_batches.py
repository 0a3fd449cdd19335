"""The worst-case batch of a DataLoader, built without iterating the loader.

The first batch is not the peak: with token sequences of varying length, the largest batch is the one that
holds the longest samples. `scan` measures the size of every sample of a map-style dataset (``dataset[i]``, in
a random order, under a time limit), ranks them, and `SampleScan.batch` collates the largest ones with the
loader's own ``collate_fn`` at its batch size, so padding, masks and labels come out as training will see them.

Nothing the training sees changes: the loader is never iterated (its sampler, batch sampler, generator and
workers are untouched), the scan order comes from a private ``random.Random(0)``, and every global RNG stream
(torch, CUDA, Python, numpy) is restored after reading samples, so a dataset that augments at random in
``__getitem__`` leaves no trace either.

The time limit holds for the whole scan: the scan order is drawn lazily (nothing is spent up front on a large
dataset), and ranking (`torch.topk` of the few largest, never a full sort of millions of samples) is reserved for
inside the limit. A sample whose ``dataset[i]`` raises is left out and reported with its index and error (or,
with ``on_error="raise"``, stops the scan with a `preflight.PreflightError` naming it): the worst case is found
among the others, since training will hit that sample too.

Known limitations:
    - Iterable datasets cannot be read out of order: their first ``batch_size`` samples are read from a fresh
      iterator over the dataset (not the loader) and collated; that is not the worst case, and the report says
      ``method="first-batch"``. A dataset that is its own iterator (a one-shot stream) cannot be read without
      consuming it and is refused.
    - A sample's size is the total number of elements of its tensors and arrays, or the length of its lists
      and strings (token ids before collation); a ``collate_fn`` whose output size is not monotone in that
      (e.g. one that crops to a random length) is not modelled.
    - Random augmentation that changes sizes in ``__getitem__`` is measured once per sample.
"""

from __future__ import annotations

import array
import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from preflight._errors import PreflightError
from preflight.trace import isolated_rng

__all__ = ["DEFAULT_TIME_LIMIT", "ON_ERROR_CHOICES", "BatchInfo", "SampleScan", "batch_shape", "check_scan_seconds",
           "failures_text", "loader_batch_size", "sample_size", "scan", "worst_case_batch"]

# Long enough to scan ~10^5-10^6 tokenised samples on one core, short next to any real training run.
DEFAULT_TIME_LIMIT = 10.0
ON_ERROR_CHOICES = ("skip", "raise")
_FAILURES_KEPT = 5  # failing samples named in the report; the rest are counted
# Time reserved per scanned sample for ranking them after the loop (`torch.topk` over int64 keys: ~0.1 us per
# sample measured on one loaded core; 3x that as margin), so that the limit holds for the whole scan.
_RANK_SECONDS_PER_SAMPLE = 3e-7


@dataclasses.dataclass(frozen=True)
class BatchInfo:
    """How the worst-case batch was found (what the report shows).

    Attributes:
        method: ``"scanned"`` (every sample measured), ``"sampled"`` (a random subset, the time limit was
            reached first) or ``"first-batch"`` (an iterable dataset: the first samples, not the worst case).
        batch_size: samples collated into the batch.
        shape: the collated batch's tensor shapes, in the batch's own structure (dict keys kept).
        samples_scanned: samples whose size was measured.
        dataset_size: samples in the dataset (None for an iterable dataset).
        largest_sample_size: size of the largest sample seen (elements, or list length).
        seconds: wall time of the scan and collation.
        failed_samples: samples whose ``dataset[i]`` raised (left out of the worst case; training will hit them).
        failures: the first of those, as ``(index, "ErrorType: message")``.
    """

    method: str
    batch_size: int
    shape: Any
    samples_scanned: int
    dataset_size: int | None
    largest_sample_size: int
    seconds: float
    failed_samples: int = 0
    failures: tuple[tuple[int, str], ...] = ()

    @property
    def note(self) -> str:
        if self.method == "scanned":
            note = f"largest {self.batch_size} of all {self.dataset_size} samples"
        elif self.method == "sampled":
            note = (f"largest {self.batch_size} of {self.samples_scanned} randomly sampled samples out of "
                    f"{self.dataset_size} (time limit reached): the true worst case may be larger")
        else:
            note = "iterable dataset: the first batch, not necessarily the worst case"
        if self.failed_samples:
            note += f"; {failures_text(self.failed_samples, self.failures)}, left out"
        return note

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 3), "note": self.note}


class SampleScan:
    """Samples of a dataset ranked by size, and the loader's way of collating them.

    Made by `scan`. ``batch(b)`` collates the ``b`` largest samples (cycling through them when the dataset has
    fewer than ``b``), which is the worst case at batch size ``b`` for padding and for concatenating collators.
    """

    def __init__(self, dataset: Any, collate_fn: Any, ranked: Sequence[tuple[int, Any]], method: str,
                 scanned: int, dataset_size: int | None, auto_collation: bool, seconds: float, batch_size: int,
                 first_samples: list[Any] | None = None, failed: int = 0,
                 failures: tuple[tuple[int, str], ...] = ()) -> None:
        self.batch_size = batch_size  # the loader's
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.ranked = ranked  # (size, index) by decreasing size; index is None for pre-read samples
        self.method = method
        self.scanned = scanned
        self.dataset_size = dataset_size
        self.auto_collation = auto_collation
        self.seconds = seconds
        self.failed = failed  # samples whose dataset[i] raised
        self.failures = failures  # the first of them: (index, error)
        self._first_samples = first_samples

    @property
    def largest_sample_size(self) -> int:
        return self.ranked[0][0] if self.ranked else 0

    def batch(self, batch_size: int) -> Any:
        """Collate the ``batch_size`` largest samples with the loader's ``collate_fn``."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` should be a positive integer, got {batch_size!r}.")
        if not self.ranked:
            raise ValueError("The dataset is empty: there is no batch to predict with.")
        with isolated_rng():
            if not self.auto_collation:  # the dataset yields whole batches: its largest item is the batch
                return self.collate_fn(self._sample(0))
            picks = [self._sample(i % len(self.ranked)) for i in range(batch_size)]
            try:
                return self.collate_fn(picks)
            except Exception as err:
                indices = [self.ranked[i % len(self.ranked)][1] for i in range(batch_size)]
                shown = ", ".join(map(str, indices[:8]))
                shown += f", ... ({len(indices)} in all)" if len(indices) > 8 else ""
                err.add_note(f"preflight: the loader's collate_fn raised this on the {batch_size} largest samples "
                             f"preflight combined into the worst-case batch (dataset indices {shown}); a shuffled "
                             "epoch can draw them together too. Try collate_fn([dataset[i] for i in those indices]).")
                raise

    def worst_case(self) -> tuple[Any, BatchInfo]:
        """The worst-case batch at the loader's batch size, and how it was found."""
        start = time.perf_counter()
        batch = self.batch(self.batch_size)
        return batch, self.info(batch, self.batch_size, time.perf_counter() - start)

    def info(self, batch: Any, batch_size: int, seconds: float = 0.0) -> BatchInfo:
        return BatchInfo(method=self.method, batch_size=batch_size, shape=batch_shape(batch),
                         samples_scanned=self.scanned, dataset_size=self.dataset_size,
                         largest_sample_size=self.largest_sample_size, seconds=self.seconds + seconds,
                         failed_samples=self.failed, failures=self.failures)

    def _sample(self, rank: int) -> Any:
        index = self.ranked[rank][1]
        if self._first_samples is not None:
            return self._first_samples[rank]
        return self.dataset[index]


def worst_case_batch(dataloader: DataLoader, *, batch_size: int | None = None,
                     time_limit: float = DEFAULT_TIME_LIMIT, on_error: str = "skip") -> tuple[Any, BatchInfo]:
    """The largest batch ``dataloader`` can yield, collated by its own ``collate_fn``; the loader is not iterated.

    Args:
        dataloader: a ``torch.utils.data.DataLoader`` (or a subclass, e.g. accelerate's ``DataLoaderShard``).
        batch_size: samples per batch; default the loader's (``batch_size``, or its batch sampler's).
        time_limit: seconds the scan may take, ranking included; past it, the samples measured so far (a random
            subset) decide, and the info says ``method="sampled"``.
        on_error: a sample whose ``dataset[i]`` raises: ``"skip"`` (left out; the info reports its index and
            error) or ``"raise"`` (a `preflight.PreflightError` naming the index, from the dataset's error).

    Returns:
        ``(batch, info)``: the batch as training would receive it from the loader (before any device transfer),
        and a `BatchInfo`.

    Raises:
        ValueError: an empty dataset (or one whose every sample raised), an unknown batch size, or a one-shot
            iterable dataset.
        PreflightError: ``on_error="raise"`` and a sample raised.

    Example:
        >>> batch, info = worst_case_batch(loader)  # doctest: +SKIP
        >>> info.shape  # doctest: +SKIP
        {'input_ids': [8, 512], 'attention_mask': [8, 512], 'labels': [8, 512]}
    """
    return scan(dataloader, time_limit=time_limit, batch_size=batch_size, on_error=on_error).worst_case()


def loader_batch_size(dataloader: DataLoader) -> int:
    """Samples per batch of ``dataloader`` (1 when the dataset yields whole batches)."""
    if getattr(dataloader, "batch_size", None):
        return int(dataloader.batch_size)
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    size = getattr(batch_sampler, "batch_size", None)
    if size:
        return int(size)
    if batch_sampler is None and hasattr(dataloader, "dataset"):
        return 1  # auto-collation disabled (batch_size=None): each dataset item is a batch
    raise ValueError(
        f"Cannot tell the batch size of {type(dataloader).__name__}: neither it nor its batch sampler has a "
        "`batch_size`. Pass the batch size explicitly."
    )


def _positive_seconds(seconds: Any) -> bool:
    """A time limit: a positive, finite number (nan would switch the bound off without a word)."""
    return (isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds)
            and seconds > 0)


def check_scan_seconds(seconds: Any) -> float:
    """Validate a scan time limit (the adapters' ``scan_seconds`` option) and return it."""
    if not _positive_seconds(seconds):
        raise ValueError(f"`scan_seconds` should be a positive, finite number of seconds, got {seconds!r}.")
    return seconds


def scan(dataloader: DataLoader, *, time_limit: float = DEFAULT_TIME_LIMIT, batch_size: int | None = None,
         on_error: str = "skip", clock: Callable[[], float] = time.perf_counter) -> SampleScan:
    """Measure and rank the samples of ``dataloader``'s dataset (see the module docstring and `worst_case_batch`).
    ``clock``: the time source the limit is measured with."""
    if not _positive_seconds(time_limit):
        raise ValueError(f"`time_limit` should be a positive, finite number of seconds, got {time_limit!r}.")
    if on_error not in ON_ERROR_CHOICES:
        raise ValueError(f"`on_error` should be either of {ON_ERROR_CHOICES}, got {on_error!r}.")
    dataset = getattr(dataloader, "dataset", None)
    collate_fn = getattr(dataloader, "collate_fn", None)
    if dataset is None or collate_fn is None:
        raise ValueError(f"{type(dataloader).__name__} has no `dataset` and `collate_fn`: preflight reads "
                         "batches from a torch.utils.data.DataLoader.")
    auto_collation = getattr(dataloader, "batch_sampler", None) is not None
    if batch_size is None:
        batch_size = loader_batch_size(dataloader)
    start = clock()
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return _first_samples(dataset, collate_fn, batch_size, auto_collation, start, clock)
    n = len(dataset)
    if n == 0:
        raise ValueError("The training dataset is empty: there is no batch to predict with.")
    deadline = start + time_limit
    rng = random.Random(0)  # private: the global `random` stream is the user's
    sizes, indices = array.array("q"), array.array("q")
    failed = 0
    failures: list[tuple[int, str]] = []
    looked = 0
    with isolated_rng():
        for index in _scan_order(n, rng):
            looked += 1
            try:
                sample = dataset[index]
            except Exception as err:  # noqa: BLE001 - the user's data: reported with its index, the rest still counts
                if on_error == "raise":
                    raise PreflightError(
                        f"preflight: reading sample {index} of the training dataset raised {type(err).__name__}: "
                        f"{err}. Training would stop there too. Fix that sample, or pass on_overflow='warn' to "
                        "predict from the other samples and train anyway.") from err
                failed += 1
                if len(failures) < _FAILURES_KEPT:
                    failures.append((index, f"{type(err).__name__}: {err}".splitlines()[0][:300]))
            else:
                sizes.append(sample_size(sample))
                indices.append(index)
            # The ranking after the loop is part of the limit: stop early enough for it.
            if clock() + len(sizes) * _RANK_SECONDS_PER_SAMPLE > deadline:
                break
    if not sizes:
        raise ValueError(f"Every sample of the training dataset read so far ({failed}) raised, e.g. sample "
                         f"{failures[0][0]}: {failures[0][1]}; there is no batch to predict with.")
    method = "scanned" if looked == n else "sampled"
    ranked = _Ranking(sizes, indices, n)
    ranked.top(1)  # the largest sample, for the report; deeper ranks are found when a batch needs them
    return SampleScan(dataset, collate_fn, ranked, method, looked, n, auto_collation, clock() - start, batch_size,
                      failed=failed, failures=tuple(failures))


def failures_text(failed: int, failures: Sequence[tuple[int, str]]) -> str:
    """"2 sample(s) raised when read: #17 (KeyError: 'x'), #40 (...)": for notes and warnings."""
    shown = ", ".join(f"#{i} ({e})" for i, e in failures)
    more = f" and {failed - len(failures)} more" if failed > len(failures) else ""
    return f"{failed} sample(s) raised when read: {shown}{more}"


class _Ranking(Sequence):
    """``(size, index)`` of scanned samples by decreasing size, ties by index: the order `SampleScan` uses. Only the
    top ranks a batch needs are found (`torch.topk`, linear), never a full sort: sorting millions of Python tuples
    took longer than the scan itself."""

    def __init__(self, sizes: array.array, indices: array.array, dataset_size: int) -> None:
        self._sizes = torch.frombuffer(sizes, dtype=torch.int64) if sizes else torch.zeros(0, dtype=torch.int64)
        self._indices = torch.frombuffer(indices, dtype=torch.int64) if indices else torch.zeros(0, dtype=torch.int64)
        self._keep = (sizes, indices)  # the tensors share these buffers
        self._n = dataset_size
        self._top: list[tuple[int, int]] = []
        self._key: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, rank: int) -> tuple[int, int]:  # type: ignore[override]
        if rank < 0:
            rank += len(self)
        if not 0 <= rank < len(self):
            raise IndexError(rank)
        return self.top(rank + 1)[rank]

    def top(self, k: int) -> list[tuple[int, int]]:
        """The ``k`` largest (or all, if fewer)."""
        k = min(k, len(self))
        if k > len(self._top):
            k = min(len(self), max(k, 2 * len(self._top), 64))  # grow geometrically: a batch asks rank by rank
            if self._key is None:
                largest = int(self._sizes.max()) if len(self) else 0
                if (largest + 1) * self._n < 1 << 62:  # one int64 key: size first, then the smaller index
                    self._key = self._sizes * self._n + (self._n - 1 - self._indices)
            if self._key is not None:
                order = torch.topk(self._key, k).indices
            else:  # sizes too large for a combined key: a stable sort by index, then by size
                by_index = torch.argsort(self._indices, stable=True)
                order = by_index[torch.argsort(self._sizes[by_index], descending=True, stable=True)][:k]
            self._top = list(zip(self._sizes[order].tolist(), self._indices[order].tolist()))
        return self._top


def _first_samples(dataset: Any, collate_fn: Any, batch_size: int, auto_collation: bool, start: float,
                   clock: Callable[[], float]) -> SampleScan:
    if iter(dataset) is dataset:
        raise ValueError(
            f"The training dataset ({type(dataset).__name__}) is its own iterator: reading a batch from it would "
            "consume samples that training should see. Make `__iter__` return a fresh iterator, or call "
            "preflight.estimate with a batch of the right shape yourself."
        )
    samples: list[Any] = []
    with isolated_rng():
        iterator = iter(dataset)
        for _ in range(batch_size if auto_collation else 1):
            try:
                samples.append(next(iterator))
            except StopIteration:
                break
        del iterator
    if not samples:
        raise ValueError("The training dataset yielded no samples: there is no batch to predict with.")
    ranked = [(sample_size(s), None) for s in samples]
    return SampleScan(dataset, collate_fn, ranked, "first-batch", len(samples), None, auto_collation,
                      clock() - start, batch_size, first_samples=samples)


def _scan_order(n: int, rng: random.Random) -> Iterator[int]:
    """Every index once, in a uniformly random order (so a scan cut short is a uniform random subset): a
    Fisher-Yates shuffle done lazily, one step per index read, so nothing is spent up front on a large dataset."""
    moved: dict[int, int] = {}  # position -> index now there, for positions a step has swapped
    for i in range(n):
        j = rng.randrange(i, n)
        at_i = moved.pop(i, i)
        if j == i:
            yield at_i
        else:
            yield moved.get(j, j)
            moved[j] = at_i


def sample_size(sample: Any) -> int:
    """Elements in a sample: tensor and array sizes, list and string lengths, summed over its structure."""
    if isinstance(sample, torch.Tensor):
        return sample.numel()
    if isinstance(sample, (str, bytes)):
        return len(sample)
    if isinstance(sample, Mapping):
        return sum(sample_size(v) for v in sample.values())
    if isinstance(sample, (list, tuple)):
        if sample and all(isinstance(v, (int, float, bool)) for v in sample[:8]):
            return len(sample)
        return sum(sample_size(v) for v in sample)
    size = getattr(sample, "size", None)  # numpy arrays, PIL images (width, height)
    if isinstance(size, int):
        return size
    if isinstance(size, tuple) and all(isinstance(v, int) for v in size):
        total = 1
        for v in size:
            total *= v
        return total
    return 1 if isinstance(sample, (int, float, bool)) else 0


def batch_shape(batch: Any) -> Any:
    """The tensor shapes of ``batch`` as lists, in its structure (JSON-ready)."""
    if isinstance(batch, torch.Tensor):
        return list(batch.shape)
    if isinstance(batch, Mapping):
        return {str(k): batch_shape(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [batch_shape(v) for v in batch]
    return type(batch).__name__
