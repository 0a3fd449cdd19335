"""Packed sequences traced with their real sizes (`preflight.trace._packed`): ``pack_padded_sequence`` into an RNN
and ``pad_packed_sequence`` out of it, against the measured peak; their lengths checked as the real kernel checks
them; their host tensors off a CUDA target's device."""

from __future__ import annotations

import pytest
import torch
from conftest import predicted_and_measured
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from torch._subclasses.fake_tensor import FakeTensorMode

import preflight
from preflight import Run, StepWouldFailError
from preflight.trace._tracker import StorageTracker


class PackedTagger(nn.Module):
    """Embedding, a recurrent stack over the packed batch (padding skipped), the padded output, a per-token head."""

    def __init__(self, kind: type[nn.RNNBase], batch_first: bool = True, enforce_sorted: bool = False,
                 **kwargs) -> None:
        super().__init__()
        self.batch_first, self.enforce_sorted = batch_first, enforce_sorted
        self.embed = nn.Embedding(100, 24)
        self.rnn = kind(24, 40, batch_first=batch_first, **kwargs)
        self.head = nn.Linear(40 * (2 if kwargs.get("bidirectional") else 1), 100)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if not self.batch_first:
            x = x.transpose(0, 1)
        packed = pack_padded_sequence(x, lengths, batch_first=self.batch_first, enforce_sorted=self.enforce_sorted)
        out, _ = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=self.batch_first, total_length=tokens.size(1))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.head(out)


def _step(model: nn.Module, batch) -> torch.Tensor:
    tokens, lengths, labels = batch
    return nn.functional.cross_entropy(model(tokens, lengths).reshape(-1, 100), labels.reshape(-1))


def _batch(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 100, (len(lengths), 30), generator=g), torch.tensor(lengths),
            torch.randint(0, 100, (len(lengths), 30), generator=g))


@pytest.mark.parametrize(("kind", "options", "lengths", "precision"), [
    (nn.LSTM, {"num_layers": 2, "bidirectional": True}, [30, 7, 19, 12], None),
    (nn.GRU, {"batch_first": False, "enforce_sorted": True}, [30, 22, 9, 3], "bf16-mixed"),
    (nn.RNN, {"bidirectional": True}, [5, 30, 17, 30], None),
])
def test_packed_recurrent_layers_are_traced_to_the_measured_peak(kind, options, lengths, precision):
    # Before: `_pack_padded_sequence`'s output size depends on the lengths' values, so the trace stopped there and
    # gave a lower bound (-47% on a bidirectional LSTM tagger).
    batch = _batch(lengths)
    est, measured = predicted_and_measured(lambda: PackedTagger(kind, **options), torch.optim.AdamW, batch,
                                           Run(precision=precision), step=_step)
    assert est.coverage.traced and not est.coverage.lower_bound
    assert est.peak_bytes == measured
    assert torch.equal(batch[1], torch.tensor(lengths))


def test_lengths_the_real_kernel_refuses_stop_the_estimate_with_its_error():
    model = PackedTagger(nn.GRU, enforce_sorted=True)
    batch = _batch([7, 30, 12])  # not in decreasing order
    with pytest.raises(RuntimeError, match="must be sorted in decreasing order") as real:
        _step(model, batch)
    with pytest.raises(StepWouldFailError, match="must be sorted in decreasing order") as err:
        preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, step=_step)
    assert "enforce_sorted=False" in str(err.value) and "lengths" in str(err.value)
    assert type(err.value.__cause__) is type(real.value)


def _pack_and_pad_events(cuda: bool) -> list[int]:
    """The allocations while a fake (30, 4, 8) fp32 input is packed with lengths (30, 19, 12, 7) and padded back."""
    fake_mode = FakeTensorMode()
    tracker = StorageTracker(fake_mode, cuda=cuda)
    with fake_mode:
        padded = torch.empty(30, 4, 8)
    try:
        with fake_mode, tracker:
            packed = pack_padded_sequence(padded, torch.tensor([30, 19, 12, 7]))
            out, lengths = pad_packed_sequence(packed)
            made = [e.nbytes for e in tracker.events if e.nbytes > 0]
            assert lengths.tolist() == [30, 19, 12, 7] and out.shape == (30, 4, 8)
            del packed, out, lengths
    finally:
        tracker.detach()
    return made


def test_a_cuda_target_keeps_the_packed_host_tensors_off_the_device():
    # batch_sizes (one int64 per step) and pad_packed_sequence's lengths (one per sequence) are host tensors in a
    # real CUDA run; on the CPU they are the step's memory. Packed data: 68 rows of 8 fp32; padded: 30 x 4 x 8.
    # (The first 32 B are the lengths made into a tensor, `torch.tensor(...)` in this test: the trace of a CUDA
    # target cannot tell the host tensors the user's code makes from the device's, a known limitation.)
    data, padded, batch_sizes, lengths = 68 * 8 * 4, 30 * 4 * 8 * 4, 30 * 8, 4 * 8
    assert _pack_and_pad_events(cuda=False) == [32, batch_sizes, data, padded, lengths]  # the kernels' order
    assert _pack_and_pad_events(cuda=True) == [32, data, padded]
