"""`EvalLoop`: what the evaluation loop keeps of each batch, the evaluation section of a `preflight.Run`.

An evaluation step's own peak is traced (`preflight.estimate_eval`). What the loop keeps across batches is not in
one step: the HF Trainer with a ``compute_metrics`` keeps every batch's predictions, labels and losses on the device
(transformers' ``EvalLoopContainer``), concatenated to the earlier batches' by ``nested_concat`` (``torch.cat``, or
a padded copy when lengths differ), until ``eval_accumulation_steps`` batches moves them to the host
(``to_cpu_and_numpy``), or to the end of the evaluation set without it. The run's evaluation peak is then the last
kept batch's: the kept outputs of the earlier batches, the previous batch's own outputs (the loop's variables hold
them until the step returns), the step itself, and the concatenation, which holds the old kept tensor, the new
batch's outputs and the new kept tensor at once. The step's outputs are what it returns, traced; the earlier
batches are assumed to have the traced batch's shapes (the largest: an upper bound where batches vary, since the
concatenation pads every batch to the longest seen).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["EvalLoop"]


@dataclasses.dataclass(frozen=True)
class EvalLoop:
    """What the evaluation loop keeps of each batch: the evaluation section of a `preflight.Run` (module
    docstring). A `Run` without one keeps nothing across batches.

    Attributes:
        kept_batches: how many batches' step outputs (what the evaluation step returns) the loop keeps on the
            device before it moves them off or drops them: the HF Trainer with a ``compute_metrics`` keeps every
            batch of the evaluation set, or ``eval_accumulation_steps`` of them. 1: nothing is kept across batches.
        concatenated: the kept outputs are concatenated batch by batch (transformers' ``nested_concat``, the
            default), each time into a new tensor while the old one is alive; False: kept in a list
            (``eval_do_concat_batches=False``), nothing copied.
        ranks: each batch's outputs are gathered from this many ranks before they are kept (the HF Trainer's
            ``gather_for_metrics`` under several processes): every rank keeps every rank's outputs. The gathered
            copy is counted beside the step's own outputs (an upper bound by one batch's outputs: the loop drops
            its own once gathered).
        moved_off: the loop moves the kept outputs to the host every ``kept_batches`` batches, at least twice
            over the set (``eval_accumulation_steps`` under the set's length). On a CPU target the host is the
            device: the first group moved off stays a NumPy view over its storage until the second group is moved
            (transformers' ``nested_numpify``, then a NumPy concatenation into NumPy's own memory), so it is alive
            while the second group is kept; NumPy's own memory is not torch's and is not counted.
        samples: the samples of the evaluation set this rank's loop keeps outputs for (None: not known), so that a
            different evaluation batch size keeps the number of batches it makes (`at_batch_size`); a loop over a
            single batch says this too, with ``kept_batches=1``.
    """

    kept_batches: int = 1
    concatenated: bool = True
    ranks: int = 1
    moved_off: bool = False
    samples: int | None = None

    def __post_init__(self) -> None:
        kept = self.kept_batches
        if isinstance(kept, bool) or not isinstance(kept, int) or kept < 1:
            raise ValueError(f"`EvalLoop.kept_batches` should be a positive whole number of batches (1: nothing kept "
                             f"across batches), got {kept!r}.")
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"`EvalLoop.ranks` should be a positive whole number of ranks, got {self.ranks!r}.")
        if self.samples is not None and (isinstance(self.samples, bool) or not isinstance(self.samples, int)
                                         or self.samples < 1):
            raise ValueError(f"`EvalLoop.samples` should be a positive whole number of samples or None, got "
                             f"{self.samples!r}.")
        for name in ("concatenated", "moved_off"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`EvalLoop.{name}` should be True or False, got {getattr(self, name)!r}.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def at_batch_size(self, batch_size: int, current: int) -> EvalLoop:
        """The loop with evaluation batches of ``batch_size`` samples instead of ``current``: the same samples in
        ``ceil(samples / batch_size)`` batches, all kept, or at most ``kept_batches`` where the loop moves them off
        every ``kept_batches`` (that number counts batches). Without ``samples``, the samples of the batches kept
        now (``kept_batches * current``, an upper bound when the last batch is short)."""
        samples = self.samples if self.samples is not None else self.kept_batches * current
        batches = -(-samples // batch_size)
        if self.moved_off:
            return dataclasses.replace(self, kept_batches=min(self.kept_batches, batches),
                                       moved_off=batches > self.kept_batches)
        return dataclasses.replace(self, kept_batches=batches)

    def kept_bytes(self, per_batch: int) -> tuple[int, int, int, int]:
        """For a step whose outputs hold ``per_batch`` bytes, around the last kept batch's step: the earlier
        batches' kept outputs, the previous batch's outputs where the loop's variables still hold them apart from
        the kept tensor (freed when the step returns), the gathered copy of this batch's outputs (0 on one rank),
        and the new kept tensor the concatenation makes after the step (0 in a list). Transformers' loop: the first
        batch's outputs are kept as they are (no copy); from the second on each is concatenated into a new tensor."""
        k, kept = self.kept_batches, per_batch * self.ranks
        gathered = kept if self.ranks > 1 else 0
        if k == 1:
            return 0, 0, 0, 0
        if not self.concatenated:
            return (k - 1) * kept, 0, gathered, 0
        previous = kept if k >= 3 else 0  # batch 1's outputs are the kept tensor itself
        return (k - 1) * kept, previous, gathered, k * kept
