"""Steps over a sequence of batch shapes (`preflight.estimate_steps`): each step's traced peak against the real step
on CPU, and the allocator's reserved memory over the sequence against the same allocator model replaying the real
steps' own allocation events."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import preflight
from preflight import Run, Target
from preflight._epoch import _step_ends
from preflight._measure import step_events
from preflight._steps import run_steps
from preflight.allocator import simulate

SIZES = [64, 512, 96, 1024, 32, 768, 1024, 256]  # rows per batch: an epoch of varying lengths


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))


def _step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def test_each_step_of_a_varying_sequence_is_predicted_to_the_byte_on_cpu():
    model = _model()
    batches = [torch.randn(b, 512) for b in SIZES]
    series = preflight.estimate_steps(model, torch.optim.AdamW(model.parameters()), batches, step=_step)
    assert series.reserved_after_step is None  # a CPU target has no caching allocator
    assert series.estimate.steps == len(SIZES) and series.estimate.peak_bytes == max(series.step_peak_bytes)
    from preflight._measure import cpu_profiled_peak

    real = _model()
    optimizer = torch.optim.AdamW(real.parameters())
    before = sum(p.untyped_storage().nbytes() for p in real.parameters())
    peaks = []
    for i, batch in enumerate(batches, 1):  # one profiled real step at a time, the state carried over
        alive = before + sum(v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values())
        peak, _ = cpu_profiled_peak(lambda: run_steps(real, optimizer, batch.clone(), step=_step, precision=None,
                                                      device_type="cpu", steps=1))
        peaks.append(alive + peak)
    # the trace holds the next batch while the previous one is released (a loader's batch is fetched first)
    assert [abs(p - m) <= 4 * max(SIZES) * 512 for p, m in zip(series.step_peak_bytes, peaks)] == [True] * len(SIZES)
    assert series.step_peak_bytes.index(max(series.step_peak_bytes)) == peaks.index(max(peaks))


@pytest.mark.parametrize("empty_cache", [False, True])
def test_reserved_memory_over_the_sequence_matches_the_allocator_replay_of_the_real_steps(empty_cache):
    # The allocator model replays the traced events and the real steps' own events alike: the same reserved bytes
    # after every step, with and without empty_cache() between steps.
    model = _model()
    batches = [torch.randn(b, 512) for b in SIZES]
    series = preflight.estimate_steps(model, torch.optim.AdamW(model.parameters()), batches, step=_step)
    traced = series.estimate.events
    ends = _step_ends(traced, len(SIZES))
    predicted = simulate(traced, report_after=ends, empty_cache_after=ends if empty_cache else ())

    real_model = _model()
    real, real_ends = step_events(real_model, torch.optim.AdamW(real_model.parameters()), batches, step=_step)
    replayed = simulate(real, report_after=real_ends, empty_cache_after=real_ends if empty_cache else ())
    assert predicted.reserved_after == replayed.reserved_after
    assert predicted.peak_reserved_bytes == replayed.peak_reserved_bytes
    # varying shapes grow the reserve beyond the first step's; empty_cache() gives some of it back between steps
    assert predicted.peak_reserved_bytes > predicted.reserved_after[0]
    if empty_cache:
        assert min(predicted.reserved_after[1:]) < predicted.peak_reserved_bytes


def test_a_cuda_target_says_when_the_reserve_stopped_growing():
    model = _model()
    batches = [torch.randn(b, 512) for b in SIZES]
    run = Run(target=Target(gpu="A100-80GB"))
    series = preflight.estimate_steps(model, torch.optim.AdamW(model.parameters()), batches, run, step=_step)
    assert len(series.reserved_after_step) == len(SIZES)
    assert series.peak_reserved_bytes == max(series.reserved_after_step)
    grew = series.stopped_growing_at
    assert series.reserved_after_step[grew - 1] == series.peak_reserved_bytes
    assert all(r < series.peak_reserved_bytes for r in series.reserved_after_step[:grew - 1])
    one_shape = preflight.estimate_steps(model, torch.optim.AdamW(model.parameters()), batches[:1] * 2, run,
                                         step=_step)
    assert series.peak_reserved_bytes >= one_shape.peak_reserved_bytes
    assert "last grew in step" in str(series) and series.to_dict()["stopped_growing_at"] == grew
    assert series.estimate.device_total_bytes > series.peak_reserved_bytes  # the context on top


def test_steps_need_batches_and_one_device():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="at least one step"):
        preflight.estimate_steps(model, optimizer, [], step=_step)
    with pytest.raises(ValueError, match="one device"):
        preflight.estimate_steps(model, optimizer, [torch.randn(2, 512)],
                                 Run(parallel=preflight.ParallelPlan(2, "ddp")), step=_step)


def test_sample_batches_draws_without_touching_the_loader_or_the_rng():
    data = [torch.full((n,), n) for n in range(1, 41)]
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True,
                                         collate_fn=lambda xs: nn.utils.rnn.pad_sequence(xs, batch_first=True))
    state = torch.get_rng_state()
    batches = preflight.sample_batches(loader, 6)
    assert torch.equal(state, torch.get_rng_state())
    assert [b.shape[0] for b in batches] == [4] * 6 and len({b.shape[1] for b in batches}) > 1
    assert [b.shape for b in preflight.sample_batches(loader, 6)] == [b.shape for b in batches]  # seeded


def test_the_callbacks_prediction_takes_the_reserve_of_sampled_steps_when_asked():
    # `Loop(sampled_steps=n)`: the verdict's device total includes what n steps over batches drawn from the dataset
    # reserve beyond the worst-case step alone (here 6 MiB more: an epoch of varying sizes fragments the cache).
    from preflight.verdict import Options, predict

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    batches = [torch.randn(b, 512) for b in SIZES]
    worst = torch.randn(max(SIZES), 512)
    target = Target(gpu="A100-80GB")
    plain = predict(model, optimizer, worst, Run(target=target), options=Options(suggest=False), step=_step,
                    sample_batches=lambda n: batches[:n])
    sampled = predict(model, optimizer, worst, Run(target=target, loop=preflight.Loop(sampled_steps=len(SIZES))),
                      options=Options(suggest=False), step=_step, sample_batches=lambda n: batches[:n])
    series = preflight.estimate_steps(model, optimizer, batches, Run(target=target), step=_step)
    grown = series.peak_reserved_bytes - plain.predicted_reserved_bytes
    assert grown > 0
    assert sampled.predicted_device_total_bytes == plain.predicted_device_total_bytes + grown
    assert any(f"over {len(SIZES)} steps of batches drawn from the dataset" in n for n in sampled.coverage["notes"])
    with pytest.raises(ValueError, match="sampled_steps"):
        preflight.Loop(sampled_steps=-1)


def test_a_language_model_over_token_batches_of_varying_lengths_is_traced():
    # Each step's batch is twinned while the trace runs, with the value shadows its token ids need (the embedding's
    # index check reads them): made outside the trace's modes.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import lm_batch, make_llama

    model = make_llama()
    series = preflight.estimate_steps(model, torch.optim.AdamW(model.parameters()),
                                      [lm_batch(2, 16), lm_batch(2, 96), lm_batch(2, 32)])
    assert series.estimate.coverage.traced and not series.estimate.coverage.lower_bound
    assert len(series.step_peak_bytes) == 3 and series.estimate.steps == 3
    assert series.step_peak_bytes[1] >= series.step_peak_bytes[2]  # 96 tokens hold at least what 32 do


@pytest.mark.slow
def test_the_whole_run_example_runs():
    from conftest import example_output

    stdout = example_output("whole_run.py", timeout=900)
    assert "the save peaks at" in stdout and "8 steps over batches of varying shapes" in stdout
    assert "last grew in step" in stdout
    loading = {p: int(stdout.split(f"loading ({p}): ")[1].split(" B")[0].replace(",", "")) for p in ("device", "meta")}
    assert loading["device"] > 4 * loading["meta"]  # the whole model on each of 8 ranks, or its eighth
