"""Memory techniques users switch on in their own step, traced from the code that runs: each predicted peak
against the measured one on CPU (issue 25 §3)."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import preflight

VOCAB, D = 4096, 128


class Blocks(nn.Module):
    """A small decoder-like stack whose loss the step computes (so the head and the loss are the step's own)."""

    def __init__(self, n: int = 6, every: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
                                    for _ in range(n))
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.every = every  # checkpoint every k-th block (0: none)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for i, block in enumerate(self.blocks):
            if self.every and i % self.every == 0:
                h = h + checkpoint(block, h, use_reentrant=False)
            else:
                h = h + block(h)
        return h


def _full_ce(model: Blocks, ids: torch.Tensor) -> torch.Tensor:
    logits = model.head(model.hidden(ids))
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _chunked_ce(model: Blocks, ids: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    # As LitGPT's chunked_cross_entropy: the head and the loss per chunk of positions, each chunk's logits
    # recomputed in backward (checkpointed), so the full [batch, seq, vocab] logits never exist at once.
    h = model.hidden(ids)

    def piece(h_chunk: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model.head(h_chunk).flatten(0, 1), target.flatten(), reduction="sum")

    total = sum(checkpoint(piece, hc, tc, use_reentrant=False)
                for hc, tc in zip(h.split(chunk, dim=1), ids.split(chunk, dim=1)))
    return total / ids.numel()


def _both(model: nn.Module, step, ids: torch.Tensor) -> tuple[int, int]:
    optimizer = torch.optim.AdamW(model.parameters())
    est = preflight.estimate(model, optimizer, ids, step=step)
    assert not est.coverage.lower_bound, est.coverage
    return est.peak_bytes, preflight.measure(model, optimizer, ids, step=step).peak_bytes


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 128), generator=torch.Generator().manual_seed(0))


def test_chunked_cross_entropy_is_traced_and_lowers_the_peak():
    torch.manual_seed(0)
    model = Blocks()
    full_est, full_measured = _both(model, _full_ce, _ids())
    chunked_est, chunked_measured = _both(model, _chunked_ce, _ids())
    assert (chunked_est, full_est) == (chunked_measured, full_measured)  # to the byte on CPU
    # The full logits (4 x 128 x 4096 fp32 = 8 MiB, with their gradient and softmax) are gone from the peak.
    assert chunked_est < full_est - 8 * 2**20


@pytest.mark.slow
def test_checkpointing_every_kth_block():
    peaks = {}
    for every in (0, 1, 2, 3):
        torch.manual_seed(0)
        estimated, measured = _both(Blocks(n=6, every=every), _full_ce, _ids())
        assert estimated == measured, every  # to the byte on CPU
        peaks[every] = estimated
    assert peaks[1] < peaks[2] < peaks[3] < peaks[0]  # the more blocks recompute, the lower the peak
