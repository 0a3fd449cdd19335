"""`max_batch_size` against real measured steps, the batch-size model, and `split_global_batch`."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import VOCAB, make_gpt2 as tiny_gpt2
from torch import nn

import preflight
from preflight._autotune import (
    BatchSizeResult,
    GlobalBatchPlan,
    max_batch_size,
    split_global_batch,
)

SEQ = 32


def make_gpt2() -> nn.Module:
    return tiny_gpt2(n_embd=64, n_positions=128)


def make_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def lm_batch(b: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (b, SEQ), generator=torch.Generator().manual_seed(b))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


@functools.lru_cache(maxsize=None)
def measured(make_model, make_batch, b: int, step=None, accumulate=1) -> int:
    """The real peak of two training steps at batch ``b`` on a fresh model and optimizer (memoised)."""
    model = make_model()
    return preflight.measure(model, torch.optim.AdamW(model.parameters()), make_batch(b), step=step,
                             run=preflight.Run(loop=preflight.Loop(accumulate=accumulate))).peak_bytes


@pytest.fixture(scope="module")
def gpt2():
    model = make_gpt2()
    return model, torch.optim.AdamW(model.parameters())


@pytest.mark.slow
def test_returns_the_true_maximum_measured(gpt2):
    model, opt = gpt2
    fits, over = measured(make_gpt2, lm_batch, 5), measured(make_gpt2, lm_batch, 6)
    budget = (fits + over) // 2  # between the measured peaks of batch 5 and 6
    result = max_batch_size(model, opt, lm_batch, run=preflight.Run(target=preflight.Target(budget=budget)))
    assert isinstance(result, BatchSizeResult) and int(result) == result.batch_size == 5
    assert result.traces <= 4
    assert measured(make_gpt2, lm_batch, result.batch_size) <= budget < measured(make_gpt2, lm_batch, 6)
    assert result.predicted_peak_bytes <= result.usable_bytes == budget
    assert result.predicted_peak_bytes == pytest.approx(fits, rel=1e-3)
    # The fitted model reproduces a fresh trace at another size to the byte.
    assert result.peak_model(9) == preflight.estimate(model, opt, lm_batch(9)).peak_bytes


@pytest.mark.slow
def test_multiple_of_and_budget_string_on_llama():
    model = make_llama()
    opt = torch.optim.AdamW(model.parameters())
    four, eight = measured(make_llama, lm_batch, 4), measured(make_llama, lm_batch, 8)
    budget = (four + measured(make_llama, lm_batch, 5)) // 2  # 4 fits, 5 does not
    messages: list[str] = []
    result = max_batch_size(model, opt, lm_batch, run=preflight.Run(target=preflight.Target(budget=f"{budget}B")), multiple_of=4, progress=messages.append)
    assert result.batch_size == 4 and result.batch_size % 4 == 0
    assert four <= budget < eight  # the next multiple does not fit when measured
    assert result.traces <= 4 and any("tracing batch size" in m for m in messages)


@pytest.mark.slow
def test_batch_one_and_nothing_fits(gpt2):
    model, opt = gpt2
    one, two = measured(make_gpt2, lm_batch, 1), measured(make_gpt2, lm_batch, 2)
    result = max_batch_size(model, opt, lm_batch, run=preflight.Run(target=preflight.Target(budget=(one + two) // 2)))
    assert result.batch_size == 1 and result.traces == 3  # batch 1 is traced itself, never extrapolated
    assert result.predicted_peak_bytes == pytest.approx(one, rel=1e-3)

    nothing = max_batch_size(model, opt, lm_batch, run=preflight.Run(target=preflight.Target(budget=one // 2)))
    assert nothing.batch_size == 0 and int(nothing) == 0
    assert nothing.predicted_peak_bytes > one // 2
    assert any("nothing fits" in n for n in nothing.notes)


@pytest.mark.slow
def test_headroom_and_max_batch(gpt2):
    model, opt = gpt2
    result = max_batch_size(model, opt, lm_batch, run=preflight.Run(target=preflight.Target(budget="1GiB")), max_batch=7)
    assert result.batch_size == 7
    tight = max_batch_size(model, opt, lm_batch, run=preflight.Run(target=preflight.Target(budget=result.predicted_peak_bytes)), headroom=0.5)
    assert tight.usable_bytes == result.predicted_peak_bytes // 2
    assert tight.predicted_peak_bytes <= tight.usable_bytes and tight.batch_size < 7


class ParityNet(nn.Module):
    """Runs an extra in-place operator at odd batch sizes: traces at batch 2 and 3 do not line up, while the peak
    still grows with the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 1024), nn.Linear(1024, 10)  # ~8 KiB per sample: budgets far from peaks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if x.shape[0] % 2:
            h.mul_(1.0)  # allocates nothing, shifts every later operator index
        return self.b(torch.relu(h))


def parity_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 64), torch.randint(0, 10, (b,))


def parity_step(model: nn.Module, batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_falls_back_to_a_trace_search_when_traces_do_not_line_up():
    torch.manual_seed(0)
    model = ParityNet()
    opt = torch.optim.AdamW(model.parameters())
    peaks = {b: measured(ParityNet, parity_batch, b, parity_step) for b in (40, 41)}
    budget = (peaks[40] + peaks[41]) // 2
    result = max_batch_size(model, opt, parity_batch, run=preflight.Run(target=preflight.Target(budget=budget)), step=parity_step, max_batch=200)
    assert result.peak_model is None and any("not used" in n for n in result.notes)
    assert result.batch_size == 40
    assert measured(ParityNet, parity_batch, 40, parity_step) <= budget < peaks[41]


@pytest.mark.slow
def test_gradient_accumulation_is_traced_as_a_micro_step(gpt2):
    model, opt = gpt2
    accumulated = max_batch_size(model, opt, lm_batch, run=preflight.Run(loop=preflight.Loop(accumulate=2), target=preflight.Target(budget="1GiB")), max_batch=3)
    assert accumulated.batch_size == 3 and accumulated.traces == 1  # a small max_batch is traced directly
    plain = preflight.estimate(model, opt, lm_batch(3)).peak_bytes
    real = measured(make_gpt2, lm_batch, 3, accumulate=2)
    assert accumulated.predicted_peak_bytes > plain  # the accumulated gradients are alive in the next forward
    assert accumulated.predicted_peak_bytes == pytest.approx(real, rel=0.01)


def test_bad_options_say_what_is_wrong(gpt2):
    model, opt = gpt2
    with pytest.raises(ValueError, match="multiple_of.*0"):
        max_batch_size(model, opt, lm_batch, run=preflight.Run(target=preflight.Target(budget="1GiB")), multiple_of=0)
    with pytest.raises(ValueError, match=r"`max_batch` \(4\) is smaller than `multiple_of` \(8\)"):
        max_batch_size(model, opt, lm_batch, run=preflight.Run(target=preflight.Target(budget="1GiB")), max_batch=4, multiple_of=8)
    with pytest.raises(ValueError, match="headroom.*1.5"):
        max_batch_size(model, opt, lm_batch, run=preflight.Run(target=preflight.Target(budget="1GiB")), headroom=1.5)
    with pytest.raises(ValueError, match="Cannot read 'lots'"):
        max_batch_size(model, opt, lm_batch, run=preflight.Run(target=preflight.Target(budget="lots")))
    with pytest.raises(ValueError, match="ignore its argument"):
        max_batch_size(model, opt, lambda b: lm_batch(4), run=preflight.Run(target=preflight.Target(budget="1GiB")))


@pytest.mark.parametrize(
    "global_batch, micro, expected",
    [
        (64, 24, (16, 4, 64, True)),  # a divisor close to the micro-batch keeps the global batch exactly
        (64, 64, (64, 1, 64, True)),
        (8, 100, (8, 1, 8, True)),
        (12, 5, (4, 3, 12, True)),
        (97, 30, (24, 4, 96, False)),  # prime: fewest steps, closest global batch
        (10, 4, (2, 5, 10, True)),  # 2 >= 0.5 * 4: exact beats 3 steps of 4
        (11, 4, (4, 3, 12, False)),  # prime: 3 x 3 = 9 or 4 x 3 = 12; 12 is closer
        (7, 2, (1, 7, 7, True)),
        (1, 1, (1, 1, 1, True)),
    ],
)
def test_split_global_batch(global_batch, micro, expected):
    plan = split_global_batch(global_batch, micro)
    assert isinstance(plan, GlobalBatchPlan)
    assert (plan.micro_batch_size, plan.accumulation_steps, plan.global_batch_size, plan.exact) == expected
    assert plan.micro_batch_size <= micro and plan.requested_global_batch_size == global_batch
    assert plan.micro_batch_size * plan.accumulation_steps == plan.global_batch_size
    assert plan.note


def test_split_global_batch_rejects_nothing_fits():
    with pytest.raises(ValueError, match="micro_batch.*got 0.*nothing fits"):
        split_global_batch(32, 0)
    with pytest.raises(ValueError, match="min_fraction"):
        split_global_batch(32, 4, min_fraction=0)


@pytest.mark.slow
def test_under_a_plan_the_largest_rank_decides(gpt2):
    """With a data-parallel plan the search traces each size per rank: the answer fits one GPU on every rank, and
    the next size does not."""
    from preflight.parallel import fsdp_plan

    model, opt = gpt2
    plan = fsdp_plan("fsdp2", world_size=4)

    def per_rank(b: int) -> int:
        return preflight.estimate(model, opt, lm_batch(b), run=preflight.Run(parallel=preflight.ParallelPlan(4, "fsdp2"))).peak_bytes

    budget = (per_rank(5) + per_rank(6)) // 2
    result = preflight.max_batch_size(model, opt, lm_batch, run=preflight.Run(target=preflight.Target(budget=budget), parallel=plan), max_batch=16)
    assert result.batch_size == 5 and result.predicted_peak_bytes == per_rank(5) <= budget
    assert any("per rank under the plan" in n for n in result.notes)
    # One device needs more than a rank of the sharded run: the unsharded search picks a smaller batch.
    assert preflight.max_batch_size(model, opt, lm_batch, run=preflight.Run(target=preflight.Target(budget=budget)), max_batch=16).batch_size < 5
