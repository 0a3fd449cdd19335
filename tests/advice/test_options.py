"""`advise`: each suggestion's predicted peak against a real measurement of the changed set-up, its ranking, and
the user's model left exactly as it was."""

from __future__ import annotations

import collections
import functools
import warnings

import pytest
import torch
from conftest import VOCAB, make_gpt2 as tiny_gpt2, only_options
from torch import nn
from torch.utils.checkpoint import checkpoint

import preflight
import preflight.advice._options as advise_module
from preflight.advice import Suggestion, advise, batch_size_of, resize_batch

BATCH = 8


def make_gpt2() -> nn.Module:
    return tiny_gpt2(n_embd=64, n_positions=128)


def lm_batch(b: int, seq: int = 32) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (b, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class BlockMLP(nn.Module):
    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(32, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return BlockMLP()


def mlp_step(model: nn.Module, batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


MLP_BATCH = (torch.randn(512, 32, generator=torch.Generator().manual_seed(0)), torch.randint(0, 10, (512,)))


def measure_fresh(make_model, batch, *, step=None, prepare=lambda model: None, accumulate=1) -> int:
    model = make_model()
    prepare(model)
    return preflight.measure(model, torch.optim.AdamW(model.parameters()), batch, step=step,
                             run=preflight.Run(loop=preflight.Loop(accumulate=accumulate))).peak_bytes


def state_of(model: nn.Module) -> dict:
    """Everything advise must leave alone: weights (bitwise), module attributes, hooks, flags."""
    return {
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "attrs": [(m, dict(vars(m))) for m in model.modules()],
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "training": [m.training for m in model.modules()],
        "checkpointing": [getattr(m, "gradient_checkpointing", None) for m in model.modules()],
        "config": dict(vars(model.config)) if hasattr(model, "config") else None,
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = state_of(model)
    assert before["weights"].keys() == after["weights"].keys()
    assert all(torch.equal(before["weights"][k], after["weights"][k]) for k in before["weights"])
    for (m1, a1), (m2, a2) in zip(before["attrs"], after["attrs"]):
        assert m1 is m2 and a1.keys() == a2.keys(), type(m1).__name__
        assert all(a1[k] is a2[k] for k in a1), [k for k in a1 if a1[k] is not a2[k]]
    for key in ("hooks", "requires_grad", "training", "checkpointing"):
        assert before[key] == after[key], key
    if before["config"] is not None:
        assert before["config"].keys() == after["config"].keys()
        assert all(before["config"][k] is after["config"][k] for k in before["config"])


@functools.lru_cache(maxsize=None)
def gpt2_budget() -> int:
    """Between the measured peaks of micro-batch 4 and 5 as accumulation micro-steps: micro-batch 4 fits."""
    four = measure_fresh(make_gpt2, lm_batch(4), accumulate=2)
    five = measure_fresh(make_gpt2, lm_batch(5), accumulate=2)
    return (four + five) // 2


@pytest.fixture(scope="module")
def gpt2_advice():
    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    batch = lm_batch(BATCH)
    before = state_of(model)
    suggestions = advise(model, opt, batch, run=preflight.Run(target=preflight.Target(budget=gpt2_budget())))
    return model, opt, batch, before, suggestions


def by_change(suggestions: list[Suggestion], key: str) -> Suggestion:
    matches = [s for s in suggestions if key in s.change and len(s.changes) == 1]  # the change alone
    assert len(matches) == 1, [s.change for s in suggestions]
    return matches[0]


@pytest.mark.slow
def test_micro_batch_suggestion_matches_measurement(gpt2_advice):
    *_, suggestions = gpt2_advice
    s = by_change(suggestions, "micro_batch_size")
    assert s.change == {"micro_batch_size": 4, "accumulate_grad_batches": 2}  # global batch 8 kept
    assert s.fits and s.predicted_peak_bytes <= gpt2_budget()
    real = measure_fresh(make_gpt2, resize_batch(lm_batch(BATCH), 4), accumulate=2)
    assert s.predicted_peak_bytes == pytest.approx(real, rel=0.01)


@pytest.mark.slow
def test_hf_checkpointing_suggestion_matches_measurement(gpt2_advice):
    *_, suggestions = gpt2_advice
    s = by_change(suggestions, "gradient_checkpointing")

    def enable(model):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

    real = measure_fresh(make_gpt2, lm_batch(BATCH), prepare=enable)
    assert s.predicted_peak_bytes == pytest.approx(real, rel=0.01)
    assert "recomputes" in s.cost


@pytest.mark.slow
def test_user_model_is_unchanged(gpt2_advice):
    model, opt, _, before, _ = gpt2_advice
    assert_unchanged(model, before)
    assert not model.is_activation_checkpointing
    assert not opt.state  # the optimizer never stepped
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_ranking_and_other_options(gpt2_advice):
    model, opt, batch, _, suggestions = gpt2_advice
    fits = [s.fits for s in suggestions]
    assert fits == sorted(fits, reverse=True)  # those that fit come first
    order = advise_module.COST_ORDER
    ranks = [order.index(_kind(s)) for s in suggestions if s.fits]
    assert ranks == sorted(ranks)  # then the cheapest
    baseline = preflight.estimate(model, opt, batch)
    lowering = [s for s in suggestions if "gradient_checkpointing" not in s.change]  # checkpointing is always shown
    assert all(s.predicted_peak_bytes < baseline.peak_bytes for s in lowering)
    # One device: no sharding to strengthen (a plan over several ranks gets its engine's: see the plan tests below).
    assert not any("sharding" in s.change for s in suggestions)
    # Each suggestion carries the run changed: precision is the run's, a model or optimizer change leaves it as is.
    for s in suggestions:
        assert s.run.precision == s.change.get("precision"), s.change
    for key in ("peft", "optimizer", "precision"):
        assert any(key in s.change for s in suggestions), key


def _kind(s: Suggestion) -> str:
    if "micro_batch_size" in s.change:
        return "micro_batch"
    if "gradient_checkpointing" in s.change:
        return "checkpointing"
    if "optimizer" in s.change:
        return "adamw8bit"
    if "quantize" in s.change:
        return "qlora"
    if "peft" in s.change:
        return "lora"
    if "precision" in s.change:
        return s.change["precision"]
    if "sharding" in s.change:
        return s.change["sharding"]
    if "offload_optimizer" in s.change:
        return "offload"
    return "allocator"


@pytest.mark.slow
def test_generic_checkpointing_wraps_the_repeated_blocks():
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    before = state_of(model)
    base = preflight.estimate(model, opt, MLP_BATCH, step=mlp_step).peak_bytes
    suggestions = advise(model, opt, MLP_BATCH, step=mlp_step, run=preflight.Run(target=preflight.Target(budget=base // 2)))
    assert_unchanged(model, before)
    assert all("forward" not in vars(block) for block in model.blocks)
    s = by_change(suggestions, "gradient_checkpointing")
    assert "4 Block blocks" in s.description

    def wrap(m):
        for block in m.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)

    real = measure_fresh(make_mlp, MLP_BATCH, step=mlp_step, prepare=wrap)
    assert s.predicted_peak_bytes == pytest.approx(real, rel=0.01)
    assert not any("sharding" in x.change for x in suggestions)  # world_size=1
    assert not any("peft" in x.change for x in suggestions)  # not a transformers model


@pytest.mark.slow
def test_a_failing_option_is_left_out_with_a_warning(monkeypatch):
    def broken(setup):
        raise RuntimeError("boom")

    options = {name: option for name, option in advise_module.OPTIONS}
    options["activation checkpointing"] = broken
    options["8-bit AdamW"] = lambda setup: []  # keep the test quick
    monkeypatch.setattr(advise_module, "OPTIONS", tuple(options.items()))
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.warns(RuntimeWarning, match="left out the activation checkpointing option: RuntimeError: boom"):
        suggestions = advise(model, opt, MLP_BATCH, step=mlp_step, run=preflight.Run(target=preflight.Target(budget="1GiB")))
    assert suggestions and all(s.fits for s in suggestions)
    assert not any("micro_batch_size" in s.change for s in suggestions)  # the current batch fits already


def test_bad_options():
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="world_size.*0"):
        advise(model, opt, MLP_BATCH, step=mlp_step, run=preflight.Run(target=preflight.Target(budget="1GiB"), parallel=preflight.ParallelPlan(0, None)))
    with pytest.raises(ValueError, match="headroom"):
        advise(model, opt, MLP_BATCH, step=mlp_step, run=preflight.Run(target=preflight.Target(budget="1GiB")), headroom=-0.1)
    with pytest.raises(ValueError, match="budget"):
        advise(model, opt, MLP_BATCH, step=mlp_step, run=preflight.Run(target=preflight.Target(budget=None)))


def test_resize_batch():
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"ids": torch.arange(6).reshape(3, 2), "pos": torch.arange(2).reshape(1, 2), "n": 3,
             "pair": Pair(torch.ones(3), [torch.zeros(3, 1)])}
    grown = resize_batch(batch, 5)
    assert grown["ids"].tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]
    assert grown["pos"] is batch["pos"] and grown["n"] == 3  # not a batch dimension / not a tensor
    assert isinstance(grown["pair"], Pair) and grown["pair"].y[0].shape == (5, 1)
    small = resize_batch(batch, 2)
    assert small["ids"].tolist() == [[0, 1], [2, 3]]
    assert small["ids"].untyped_storage().nbytes() == 2 * 2 * 8  # a copy, not a view of the whole batch
    assert batch_size_of(small) == 2 and batch_size_of({"n": 3}) is None
    with pytest.raises(ValueError, match="batch_size.*0"):
        resize_batch(batch, 0)
    with pytest.raises(ValueError, match="no tensor"):
        resize_batch({"n": 3}, 2)


@pytest.mark.slow
def test_optimizer_offload_suggestion_matches_planning_it():
    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    batch = lm_batch(1, 8)  # a tiny batch: model states dominate the peak
    base = preflight.estimate(model, opt, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        suggestions = advise(model, opt, batch, run=preflight.Run(target=preflight.Target(budget=int(base.peak_bytes * 0.9))))
    planned = preflight.estimate(model, opt, batch, run=preflight.Run(parallel=preflight.ParallelPlan(1, "zero2", offload_optimizer=True)))
    assert planned.breakdown["optimizer_state"] == 0
    offered = [s for s in suggestions if "offload_optimizer" in s.change]
    # Offered exactly when planning it lowers the peak (DeepSpeed's default reduction buffers count), same figure.
    assert bool(offered) == (planned.peak_bytes < base.peak_bytes)
    if offered:
        assert offered[0].predicted_peak_bytes == planned.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("optim_bits", [32, 8])
def test_a_32bit_bitsandbytes_optimizer_is_offered_its_8bit_state(optim_bits, monkeypatch):
    # issue 10: known by configuration (args.optim_bits), as HF builds it: bnb.optim.AdamW(..., optim_bits=...)
    bnb = pytest.importorskip("bitsandbytes")
    only_options(monkeypatch, "8-bit AdamW", "optimizer implementation")  # the options that change the optimizer
    model = make_gpt2()
    opt = bnb.optim.AdamW(model.parameters(), lr=1e-3, optim_bits=optim_bits, is_paged=True)
    batch = lm_batch(2)
    base = preflight.estimate(model, opt, batch).peak_bytes
    # Over by one byte: single changes fit, so no combination is searched (tests/advice/test_combine.py).
    suggestions = advise(model, opt, batch, run=preflight.Run(target=preflight.Target(budget=base - 1)))
    offered = [s for s in suggestions if s.change.get("optim_bits") == 8 and len(s.changes) == 1]  # alone
    if optim_bits == 8:
        assert not offered and not any("optimizer" in s.change for s in suggestions)
        return
    (s,) = offered
    assert s.change == {"optimizer": "bitsandbytes.optim.AdamW", "optim_bits": 8}
    eight = bnb.optim.AdamW(model.parameters(), lr=1e-3, optim_bits=8, is_paged=True)
    assert s.predicted_peak_bytes == preflight.estimate(model, eight, batch).peak_bytes < base
    assert opt.args.optim_bits == 32  # the user's optimizer is left as it was


@pytest.mark.slow
def test_under_a_plan_every_option_is_predicted_per_rank():
    """Under a data-parallel plan (as the callbacks read it off the trainer), the current peak and every option are
    the plan's per-rank prediction, and the sharding options are the stronger shardings of the same engine."""
    from preflight.parallel import ParallelPlan, deepspeed_plan, fsdp_plan

    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    batch = lm_batch(BATCH)
    plan = ParallelPlan(4, "ddp")
    base = preflight.estimate(model, opt, batch, run=preflight.Run(parallel=preflight.ParallelPlan(4, "ddp")))
    before = state_of(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        suggestions = advise(model, opt, batch, run=preflight.Run(target=preflight.Target(budget=int(base.peak_bytes * 0.8)), parallel=plan))
    assert_unchanged(model, before)
    micro = by_change(suggestions, "micro_batch_size")
    assert micro.predicted_peak_bytes == preflight.estimate(
        model, opt, resize_batch(batch, micro.change["micro_batch_size"]), run=preflight.Run(loop=preflight.Loop(accumulate=2), parallel=preflight.ParallelPlan(4, "ddp"))).peak_bytes
    bf16 = next(s for s in suggestions if s.change == {"precision": "bf16-true"})
    assert bf16.predicted_peak_bytes == preflight.estimate(model, opt, batch, run=preflight.Run(precision="bf16-true", parallel=preflight.ParallelPlan(4, "ddp"))).peak_bytes
    # DDP -> FSDP, each rank traced through FSDP's own program, over the same 4 ranks; no rescaled ZeRO options.
    sharded = {s.change["sharding"]: s for s in suggestions if "sharding" in s.change}
    assert set(sharded) == {"fsdp-grad-op", "fsdp2"}
    assert all(s.change["world_size"] == 4 for s in sharded.values())
    for name, s in sharded.items():
        assert s.predicted_peak_bytes == preflight.estimate(model, opt, batch, run=preflight.Run(parallel=preflight.ParallelPlan(4, name))).peak_bytes < base.peak_bytes
    # A DeepSpeed plan keeps its config, at a higher stage (only the sharding option traced: the others were above).
    config = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 10_000}}
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("ignore")
        only_options(patch, "sharding")
        zero = advise(model, opt, lm_batch(1, 8), run=preflight.Run(target=preflight.Target(budget=1), parallel=deepspeed_plan(config, world_size=4)))
    stage3 = next(s for s in zero if s.change.get("zero_stage") == 3)
    assert stage3.change == {"sharding": "zero3", "world_size": 4, "zero_stage": 3}
    assert stage3.predicted_peak_bytes == preflight.estimate(
        model, opt, lm_batch(1, 8), run=preflight.Run(parallel=preflight.deepspeed_plan({"zero_optimization": {"stage": 3, "reduce_bucket_size": 10_000}}, world_size=4))).peak_bytes
    assert config["zero_optimization"]["stage"] == 1  # the plan's config is left as it was
    with pytest.raises(TypeError, match="ParallelPlan"):
        advise(model, opt, batch, run=preflight.Run(target=preflight.Target(budget="1GiB"), parallel={"world_size": 4}))
    with pytest.raises(TypeError, match="ParallelPlan"):
        preflight.max_batch_size(model, opt, lm_batch, run=preflight.Run(target=preflight.Target(budget="1GiB"), parallel=fsdp_plan))


class _CheckpointedBlocks(nn.Module):
    """`conftest.Stack` with each block under torch.utils.checkpoint in the model's own forward: what advise's
    checkpointing option makes of `Stack`."""

    def __init__(self, stack: nn.Module) -> None:
        super().__init__()
        self.layers, self.head = stack.layers, stack.head

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            x = torch.relu(checkpoint(layer, x, use_reentrant=False))
        return self.head(x).sum()


@pytest.mark.slow
def test_checkpointing_under_a_per_rank_traced_plan_runs_the_traced_copys_blocks(monkeypatch):
    # The per-rank trace copies the model: the checkpointed forward must run the copy's blocks, not the user's
    # (a closure over the user's block ran it outside FSDP's program: 179,752 B predicted here against 192,840 B).
    from conftest import Stack

    from preflight.parallel import ParallelPlan

    torch.manual_seed(0)
    stack = Stack(depth=4, width=64)
    x = torch.randn(8, 64)
    opt = torch.optim.AdamW(stack.parameters())
    plan = ParallelPlan(2, "fsdp2")
    only_options(monkeypatch, "activation checkpointing")
    base = preflight.estimate(stack, opt, x, step=lambda m, b: m(b), run=preflight.Run(parallel=plan))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = advise(stack, opt, x, run=preflight.Run(target=preflight.Target(budget=base.peak_bytes - 1),
                                                        parallel=plan), step=lambda m, b: m(b))
    checkpointed = next(s for s in found if s.change == {"gradient_checkpointing": True})
    expected = preflight.estimate(_CheckpointedBlocks(stack), opt, x, step=lambda m, b: m(b),
                                  run=preflight.Run(parallel=plan))
    assert checkpointed.predicted_peak_bytes == expected.peak_bytes


def test_fsdp2_under_autocast_is_offered_its_parameter_dtype_policy(monkeypatch):
    """An FSDP2 plan under bf16-mixed without a policy casting parameters: FSDP2's bf16 policy is offered with its
    per-rank figure (autocast's cache keeps every gathered parameter's cast through the forward); not offered
    where the plan casts already or the run does not autocast."""
    from conftest import Stack
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from preflight.parallel import FSDP2Plan, ParallelPlan

    torch.manual_seed(0)
    stack = Stack(depth=4, width=64)
    x = torch.randn(8, 64)
    opt = torch.optim.AdamW(stack.parameters())
    step = lambda m, b: m(b)  # noqa: E731
    only_options(monkeypatch, "FSDP2 parameter dtype")
    run = preflight.Run(precision="bf16-mixed", parallel=ParallelPlan(2, "fsdp2"))
    base = preflight.estimate(stack, opt, x, run, step=step)
    assert any("autocast's cache keeps the cast" in n for n in base.coverage.notes)

    def offered(run: preflight.Run) -> list[Suggestion]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return advise(stack, opt, x, run.replace(target=preflight.Target(budget=base.peak_bytes - 1)), step=step)

    found = offered(run)
    assert [s.change for s in found] == [{"fsdp_param_dtype": "bfloat16"}]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    planned = run.replace(parallel=ParallelPlan(2, "fsdp2", fsdp=FSDP2Plan(mp_policy=policy)))
    assert found[0].run.parallel.fsdp.mp_policy == policy
    expected = preflight.estimate(stack, opt, x, planned, step=step)
    assert found[0].predicted_peak_bytes == expected.peak_bytes < base.peak_bytes
    assert not any("autocast's cache" in n for n in expected.coverage.notes)
    assert offered(planned) == [] and offered(run.replace(precision=None)) == []


@pytest.mark.slow
def test_checkpointing_keeps_a_forward_the_block_has_of_its_own(monkeypatch):
    # accelerate's hooks (and other tools) set `module.forward` on the instance: checkpointing runs that forward.
    import functools

    from conftest import Stack

    import preflight.advice._setup as advising

    wrapped = []
    checkpointed = advising._checkpointed
    monkeypatch.setattr(advising, "_checkpointed", lambda forward: wrapped.append(forward) or checkpointed(forward))

    torch.manual_seed(0)
    stack = Stack(depth=4, width=64)
    calls = []

    def hooked(module, x):
        calls.append(module)
        return type(module).forward(module, x)

    stack.layers[1].forward = functools.partial(hooked, stack.layers[1])
    x = torch.randn(8, 64)
    opt = torch.optim.AdamW(stack.parameters())
    base = preflight.estimate(stack, opt, x, step=lambda m, b: m(b))
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = advise(stack, opt, x, run=preflight.Run(target=preflight.Target(budget=base.peak_bytes // 2)), step=lambda m, b: m(b))
    assert any(s.change == {"gradient_checkpointing": True} for s in found) and calls
    # The block's own forward under the checkpoint; the others' class forward (bound to the block when called).
    # Each trial with checkpointing (alone, then in combinations) wraps the same four forwards.
    assert wrapped and len(wrapped) % 4 == 0
    assert [getattr(f, "func", f) for f in wrapped] == [nn.Linear.forward, hooked, nn.Linear.forward,
                                                         nn.Linear.forward] * (len(wrapped) // 4)
    assert isinstance(stack.layers[1].forward, functools.partial)  # put back as it was


@pytest.mark.slow
def test_suggestions_compose_as_changes_of_the_run():
    # Each suggestion is the description changed; applying one to another's run makes both changes.
    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    base = preflight.Run(target=preflight.Target(budget=gpt2_budget()))  # single changes fit: no combinations
    found = advise(model, opt, lm_batch(BATCH), base)
    micro = by_change(found, "micro_batch_size")
    bf16 = next(s for s in found if s.change == {"precision": "bf16-true"})
    assert bf16.run_changes == {"precision": "bf16-true"} and bf16.apply(base) == bf16.run
    assert micro.run_changes == {"loop": {"accumulate": micro.change["accumulate_grad_batches"]}}
    both = micro.apply(bf16.run)
    assert both.precision == "bf16-true" and both.loop.accumulate == micro.change["accumulate_grad_batches"]
    assert bf16.to_dict()["run_changes"] == {"precision": "bf16-true"}
    assert "--precision bf16-true" in " ".join(bf16.to_dict()["cli_flags"])


@pytest.mark.slow
def test_the_optimizer_implementation_is_a_described_change_and_suggested_when_it_lowers_the_peak():
    """torch's default optimizer step on CUDA (foreach) holds a temporary the size of the parameters it updates; the
    fused step does not. `Loop(optimizer_impl=...)` plans it (same figure as an optimizer built with fused=True /
    foreach=False), and advise offers it, as a changed run, where it lowers the peak."""
    from torch import nn

    torch.manual_seed(0)
    # Weights of 16 MiB each: every foreach temporary takes a segment of its own, so the fused step lowers the
    # simulated reserved memory (what the verdict compares), not only the allocated. With 4 MiB weights the
    # temporaries fit in blocks the backward left cached and the device total does not move.
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(2)])
    batch = torch.randn(8, 2048)
    step = lambda m, b: m(b).sum()  # noqa: E731
    opt = torch.optim.AdamW(model.parameters())
    gpu = preflight.Target(gpu="H100-80GB")
    by_run = {impl: preflight.estimate(model, opt, batch, preflight.Run(target=gpu, loop=preflight.Loop(
        optimizer_impl=impl)), step=step).peak_bytes for impl in (None, "foreach", "for-loop", "fused")}
    by_optimizer = {impl: preflight.estimate(model, torch.optim.AdamW(model.parameters(), **kwargs), batch,
                                             preflight.Run(target=gpu), step=step).peak_bytes
                    for impl, kwargs in (("for-loop", {"foreach": False}), ("fused", {"fused": True}))}
    assert by_run["foreach"] == by_run[None] > by_run["for-loop"] == by_optimizer["for-loop"]
    assert by_run["fused"] == by_optimizer["fused"] < by_run[None]
    assert opt.defaults.get("fused") is None and not opt.state  # the user's optimizer is not changed
    # On CPU the measured peak agrees with the plan.
    cpu = preflight.Run(loop=preflight.Loop(optimizer_impl="fused"))
    assert preflight.estimate(model, opt, batch, cpu, step=step).peak_bytes == \
        preflight.measure(model, opt, batch, cpu, step=step).peak_bytes
    # Advice speaks in what the verdict compares: on a simulated GPU the device total (reserved and context too).
    required = {impl: preflight.estimate(model, opt, batch, preflight.Run(target=gpu, loop=preflight.Loop(
        optimizer_impl=impl)), step=step).required_bytes for impl in (None, "fused")}
    suggestions = preflight.advise(model, opt, batch, preflight.Run(target=preflight.Target(
        gpu="H100-80GB", budget=required[None])), step=step, headroom=0.0)
    fused = next(s for s in suggestions if s.change == {"optimizer_impl": "fused"})
    assert fused.predicted_peak_bytes == required["fused"] and fused.fits
    assert fused.run_changes == {"loop": {"optimizer_impl": "fused"}} and "--optimizer-impl" in fused.run.cli_flags()
    with pytest.raises(ValueError, match="optimizer_impl"):
        preflight.Loop(optimizer_impl="fast")


@pytest.mark.slow
def test_qlora_is_offered_with_the_figure_of_the_model_from_pretrained_loads(monkeypatch):
    """QLoRA's figure is the trace of the model a QLoRA recipe loads: from_pretrained in NF4 with double
    quantization (computing in bf16 under bf16-mixed), prepare_model_for_kbit_training, LoRA on every linear layer
    but the head; that model's trace matches its measured peak (tests/trace/test_quantized.py)."""
    import tempfile

    pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from preflight._quantize import bnb_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = lm_batch(4)
    run = preflight.Run(precision="bf16-mixed")
    need = preflight.estimate(model, optimizer, batch, run).required_bytes
    before = state_of(model)
    only_options(monkeypatch, "LoRA", "QLoRA")
    suggestions = advise(model, optimizer, batch, run.replace(target=preflight.Target(budget=need - 1)))
    assert_unchanged(model, before)
    qlora = next(s for s in suggestions if s.changes == ("qlora",))
    assert qlora.change == {"peft": "lora", "r": 16, "target_modules": "all-linear", "quantize": "nf4",
                            "double_quant": True}
    lora = next(s for s in suggestions if s.changes == ("lora",))
    assert suggestions.index(lora) < suggestions.index(qlora) or lora.fits > qlora.fits  # LoRA costs less
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=bnb_config("nf4", compute_dtype=torch.bfloat16, double_quant=True),
            device_map={"": "cpu"}, dtype=torch.bfloat16)
    loaded = peft.prepare_model_for_kbit_training(loaded, use_gradient_checkpointing=False)
    loaded = peft.get_peft_model(loaded, peft.LoraConfig(r=16, target_modules="all-linear"))
    adapters = torch.optim.AdamW([p for p in loaded.parameters() if p.requires_grad], lr=1e-4)
    assert qlora.predicted_peak_bytes == preflight.estimate(loaded, adapters, batch, run).required_bytes
    assert qlora.predicted_peak_bytes < need  # offered because it lowers the peak
    # Counted in weights, not in the packed 4-bit storage's bytes: the user's model plus the adapters.
    n_adapters = sum(p.numel() for p in adapters.param_groups[0]["params"])
    assert f"trains {n_adapters:,} of {sum(p.numel() for p in model.parameters()) + n_adapters:,} parameters" \
        in qlora.description


def test_eight_bit_adamw_is_not_offered_for_dtensor_parameters(monkeypatch):
    """bitsandbytes' optimizers cannot step DTensor parameters (`tests/parallel/test_tensor.py` runs it on gloo):
    under FSDP2 the 8-bit option is left out, under DDP it is offered."""
    pytest.importorskip("bitsandbytes")
    from conftest import only_options

    from preflight.parallel import ParallelPlan

    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    batch = lm_batch(BATCH)
    only_options(monkeypatch, "8-bit AdamW")
    offered = {}
    for sharding in ("ddp", "fsdp2"):
        run = preflight.Run(parallel=ParallelPlan(2, sharding))
        base = preflight.estimate(model, opt, batch, run=run)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = advise(model, opt, batch, run=run.replace(target=preflight.Target(budget=base.peak_bytes // 2)))
        assert not [w for w in caught if "left out" in str(w.message)], [str(w.message) for w in caught]
        offered[sharding] = [s.change.get("optimizer") for s in found if "optimizer" in s.change]
    assert offered == {"ddp": ["bitsandbytes.optim.AdamW8bit"], "fsdp2": []}


def test_the_allocator_option_on_a_run_with_no_other_phase(monkeypatch):
    # With no phase beside training, the figure is the training need with the expandable reserve: max() of one
    # number (it raised "'int' object is not iterable" and advise left the option out with a warning).
    import types

    import preflight.allocator
    from preflight._result import Coverage, Estimate
    from preflight.advice import _options

    base = Estimate(peak_bytes=100, breakdown={"activations": 100}, peak_phase="step2/backward", device="cuda",
                    coverage=Coverage(traced=True), peak_reserved_bytes=1000, device_total_bytes=1500)
    monkeypatch.setattr(preflight.allocator, "simulate", lambda events, config: types.SimpleNamespace(
        peak_reserved_bytes=400))
    setup = types.SimpleNamespace(baseline=base, limit=1200, versus=lambda figure: f"{figure} B",
                                  run=preflight.Run(target=preflight.Target(gpu="H100-80GB")))
    [(kind, suggestion)] = _options._allocator(setup)
    assert kind == "allocator" and suggestion.fits
    assert "900 B" in suggestion.description
