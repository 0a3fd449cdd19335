"""The worst-case batch: found by scanning the dataset, collated by the loader's own collate_fn, no trace left."""

from __future__ import annotations

import random
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from preflight._batches import _scan_order, sample_size, scan, worst_case_batch


class Tokens(Dataset):
    """Token lists of varying length; the longest is the last sample. ``delay`` slows __getitem__ down."""

    def __init__(self, n: int = 40, longest: int = 90, delay: float = 0.0) -> None:
        self.n, self.longest, self.delay = n, longest, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.delay:
            time.sleep(self.delay)
        length = self.longest if i == self.n - 1 else 8 + (i * 5) % 40
        return {"input_ids": list(range(length))}


def pad(samples: list[dict]) -> dict:
    n = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), n, dtype=torch.long)
    for j, s in enumerate(samples):
        ids[j, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def test_longest_sample_last_is_found_and_collated_by_the_loaders_collate_fn():
    loader = DataLoader(Tokens(), batch_size=4, shuffle=True, collate_fn=pad)
    batch, info = worst_case_batch(loader)
    assert info.method == "scanned" and info.samples_scanned == info.dataset_size == 40
    assert info.shape == {"input_ids": [4, 90], "attention_mask": [4, 90]}
    assert batch["input_ids"].shape == (4, 90)
    assert info.largest_sample_size == 90


def test_loader_sampler_and_rng_streams_are_untouched():
    gen = torch.Generator().manual_seed(7)
    loader = DataLoader(Tokens(), batch_size=4, shuffle=True, collate_fn=pad, generator=gen)
    torch.manual_seed(3)
    random.seed(3)
    states = (torch.get_rng_state(), random.getstate(), gen.get_state())

    class Noisy(Tokens):  # a dataset that draws random numbers in __getitem__ (augmentation)
        def __getitem__(self, i):
            torch.rand(1)
            random.random()
            return super().__getitem__(i)

    noisy = DataLoader(Noisy(), batch_size=4, shuffle=True, collate_fn=pad, generator=gen)
    worst_case_batch(noisy)
    worst_case_batch(loader)
    assert torch.equal(states[0], torch.get_rng_state())
    assert states[1] == random.getstate()
    assert torch.equal(states[2], gen.get_state())


def test_time_limit_samples_a_deterministic_random_subset():
    loader = DataLoader(Tokens(n=400, delay=0.002), batch_size=2, collate_fn=pad)
    state = random.getstate()
    first = scan(loader, time_limit=0.05)
    assert first.method == "sampled"
    assert 0 < first.scanned < 400
    # The order comes from a private Random(0), not the global stream: a uniform subset, the same in every run.
    order = list(_scan_order(400, random.Random(0)))
    assert sorted(order) == list(range(400))
    assert {i for _, i in first.ranked} == set(order[: first.scanned])
    assert random.getstate() == state
    batch, info = worst_case_batch(loader, time_limit=0.05)
    assert info.method == "sampled" and "time limit" in info.to_dict()["note"]


def test_iterable_dataset_uses_its_first_samples():
    class Stream(IterableDataset):
        def __iter__(self):
            for i in range(10):
                yield {"input_ids": list(range(5 + i))}

    batch, info = worst_case_batch(DataLoader(Stream(), batch_size=3, collate_fn=pad))
    assert info.method == "first-batch" and info.dataset_size is None
    assert info.shape["input_ids"] == [3, 7]


def test_one_shot_iterable_dataset_is_refused():
    class OneShot(IterableDataset):
        def __init__(self):
            self.it = iter(range(10))

        def __iter__(self):
            return self

        def __next__(self):
            return torch.tensor([next(self.it)])

    with pytest.raises(ValueError, match="its own iterator"):
        worst_case_batch(DataLoader(OneShot(), batch_size=2))


def test_dataset_of_whole_batches():
    class Batches(Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.zeros(2, 10 * (i + 1))

    batch, info = worst_case_batch(DataLoader(Batches(), batch_size=None))
    assert batch.shape == (2, 30) and info.batch_size == 1


def test_make_batch_cycles_the_largest_samples():
    samples = scan(DataLoader(Tokens(n=5), batch_size=2, collate_fn=pad))
    assert samples.batch(7)["input_ids"].shape == (7, 90)


def test_sample_size():
    assert sample_size({"input_ids": [1, 2, 3], "labels": [1, 2, 3]}) == 6
    assert sample_size((torch.zeros(3, 4), torch.tensor(1))) == 13
    assert sample_size("abcd") == 4


class Flaky(Tokens):
    """Raises on some indices, as a corrupt record would."""

    def __init__(self, bad: set[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.bad = bad

    def __getitem__(self, i: int) -> dict:
        if i in self.bad:
            raise KeyError(f"record {i} is corrupt")
        return super().__getitem__(i)


def test_a_sample_that_raises_is_reported_and_the_rest_still_decide():
    loader = DataLoader(Flaky({3, 17}), batch_size=4, collate_fn=pad)
    batch, info = worst_case_batch(loader)
    assert info.shape == {"input_ids": [4, 90], "attention_mask": [4, 90]}  # the longest (index 39) still found
    assert info.method == "scanned" and info.samples_scanned == 40
    assert info.failed_samples == 2
    assert sorted(info.failures) == [(3, "KeyError: 'record 3 is corrupt'"), (17, "KeyError: 'record 17 is corrupt'")]
    assert "2 sample(s) raised when read: #" in info.note and "#17 (KeyError: 'record 17 is corrupt')" in info.note


def test_a_sample_that_raises_stops_the_scan_when_asked_to_fail_fast():
    from preflight import PreflightError

    loader = DataLoader(Flaky({17}), batch_size=4, collate_fn=pad)
    with pytest.raises(PreflightError, match=r"reading sample 17 of the training dataset raised KeyError: 'record 17 "
                                             r"is corrupt'\. Training would stop there too") as err:
        scan(loader, on_error="raise")
    assert isinstance(err.value.__cause__, KeyError)
    with pytest.raises(ValueError, match="`on_error` should be either of"):
        scan(loader, on_error="ignore")


def test_a_dataset_whose_every_sample_raises_says_so():
    loader = DataLoader(Flaky(set(range(5)), n=5), batch_size=2, collate_fn=pad)
    with pytest.raises(ValueError, match=r"Every sample of the training dataset read so far \(5\) raised, e.g. sample"):
        scan(loader)


def test_the_time_limit_holds_for_the_whole_scan_and_says_how_far_it_got():
    # A fake clock: each sample read takes one "second"; the limit is 10. The scan stops itself (ranking included,
    # no full sort after the deadline), says it was cut short, and how many samples it looked at.
    now = [0.0]

    class Slow(Tokens):
        def __getitem__(self, i):
            now[0] += 1.0
            return super().__getitem__(i)

    loader = DataLoader(Slow(n=10_000_000), batch_size=4, collate_fn=pad)
    samples = scan(loader, time_limit=10, clock=lambda: now[0])
    assert samples.method == "sampled" and samples.scanned == 10 and samples.seconds == 10.0
    assert len(samples.ranked) == 10 and samples.ranked[0][0] == max(s for s, _ in samples.ranked)
    batch, info = samples.worst_case()
    assert info.samples_scanned == 10 and info.dataset_size == 10_000_000
    assert "of 10 randomly sampled samples out of 10000000 (time limit reached)" in info.note


def test_ranking_orders_by_size_then_index():
    class Sized(Dataset):
        def __init__(self, lengths):
            self.lengths = lengths

        def __len__(self):
            return len(self.lengths)

        def __getitem__(self, i):
            return {"input_ids": [1] * self.lengths[i]}

    lengths = [5, 9, 9, 1, 7, 9, 2] * 30
    samples = scan(DataLoader(Sized(lengths), batch_size=3, collate_fn=pad))
    expected = sorted(((n, i) for i, n in enumerate(lengths)), key=lambda p: (-p[0], p[1]))
    assert list(samples.ranked) == expected


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0, -2.0, True])
def test_a_scan_time_limit_is_a_positive_finite_number(value):
    # Issue 24, item 10: nan switched the scan's time bound off without a word.
    from preflight._batches import check_scan_seconds, scan

    with pytest.raises(ValueError, match=r"`scan_seconds` should be a positive, finite number of seconds"):
        check_scan_seconds(value)
    loader = torch.utils.data.DataLoader([torch.zeros(3)] * 4, batch_size=2)
    with pytest.raises(ValueError, match=r"`time_limit` should be a positive, finite number of seconds"):
        scan(loader, time_limit=value)


def test_a_collate_fn_failing_on_the_combined_samples_names_them():
    """The worst case combines samples the loader's first batch may never have: the error says which."""
    data = [torch.ones(n) for n in (3, 9, 4, 7)]

    def collate(samples):
        if sum(len(s) for s in samples) > 15:
            raise ValueError("batch too long for my buffer")
        return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)

    loader = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=collate)
    with pytest.raises(ValueError, match="too long") as caught:
        worst_case_batch(loader)
    note = "\n".join(caught.value.__notes__)
    assert "dataset indices 1, 3" in note and "2 largest samples" in note
