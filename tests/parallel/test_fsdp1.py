"""FSDP1 (``FullyShardedDataParallel``) traced per rank (`preflight.parallel`): the shards FSDP1 itself makes, the
ranks that hold padding, the plan's options, the user's objects untouched, and real 2-process gloo runs measured
against the prediction."""

from __future__ import annotations

import copy
import re
import socket
import types

import pytest
import torch
import torch.distributed as dist
from conftest import Stack, gloo_rank, spy_all_reduce
from torch import nn

import preflight
from preflight.parallel import FSDP1Plan, fake_world, fsdp1_rank_groups

WORLD = 4
WIDTH = 66  # a unit's flat parameter (66 x 66 + 66 = 4422 elements) is padded to 4424: the last rank holds 2 of padding


def _setup(seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    model = Stack(**kwargs)
    return model, torch.optim.AdamW(model.parameters()), torch.randn(8, kwargs.get("width", WIDTH))


def _step(m, b):
    return m(b)


def _real_shards(model: nn.Module, plan: FSDP1Plan, rank: int, x: torch.Tensor) -> tuple[int, int]:
    """What FSDP1 itself gives ``rank`` (real tensors, wrapped in a fake group whose collectives do nothing, one real
    AdamW step): the bytes of its flat shards, and of the optimizer state AdamW then holds."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from preflight.parallel._fsdp1 import wrap_fsdp1

    with fake_world(WORLD, rank, plan.replicate(WORLD)) as mesh:
        wrapped = wrap_fsdp1(copy.deepcopy(model), plan, mesh)
        optimizer = torch.optim.AdamW(wrapped.parameters())
        wrapped(x).backward()
        optimizer.step()
        flat = sum(m._handle.flat_param.numel() * 4 for m in FSDP.fsdp_modules(wrapped) if m._handle is not None)
        state = sum(v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values())
    return flat, state


@pytest.mark.parametrize("strategy", ["fsdp-full", "fsdp-grad-op"])
def test_each_ranks_shards_and_state_are_fsdp1s_own(strategy):
    model, optimizer, x = _setup()
    est = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, strategy)))
    assert est.sharding == strategy and len(est.per_rank_peak_bytes) == WORLD
    assert any(f"{strategy}: each rank's step traced through FullyShardedDataParallel" in n
               for n in est.coverage.notes)
    plan = FSDP1Plan(sharding_strategy="FULL_SHARD" if strategy == "fsdp-full" else "SHARD_GRAD_OP")
    flat, state = _real_shards(model, plan, est.peak_rank, x)
    assert est.breakdown["parameters"] == flat  # the padded flat shards, one per unit
    assert est.breakdown["optimizer_state"] == state  # AdamW's over this rank's views
    assert est.breakdown["communication"] > 0
    single = preflight.estimate(model, optimizer, x, step=_step)
    assert est.peak_bytes < single.peak_bytes


@pytest.mark.slow
def test_the_rank_holding_the_padding_holds_less_state():
    model, optimizer, x = _setup()
    assert fsdp1_rank_groups(model, FSDP1Plan(), WORLD) == [[0, 1, 2], [3]]
    assert fsdp1_rank_groups(model, FSDP1Plan(use_orig_params=False), WORLD) == [[0, 1, 2, 3]]  # flat state
    est = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full")))
    per_rank = est.per_rank_peak_bytes
    assert per_rank[0] == per_rank[1] == per_rank[2] > per_rank[3]
    assert est.peak_rank == 0
    _, state_0 = _real_shards(model, FSDP1Plan(sharding_strategy="FULL_SHARD"), 0, x)
    _, state_3 = _real_shards(model, FSDP1Plan(sharding_strategy="FULL_SHARD"), 3, x)
    assert per_rank[0] - per_rank[3] == state_0 - state_3 > 0  # the state over views rank 3 does not have
    flat = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full", fsdp=FSDP1Plan(use_orig_params=False))))
    assert len(set(flat.per_rank_peak_bytes)) == 1  # state over the padded flat shards: every rank alike


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp-full", "fsdp-grad-op"])
def test_hybrid_ranks_hold_their_nodes_shards_and_all_reduce_them_in_place(strategy, monkeypatch):
    model, optimizer, x = _setup()
    node = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(2, strategy)))
    calls = spy_all_reduce(monkeypatch)  # (elements, group size) of each all_reduce from here on
    plan = FSDP1Plan(ranks_per_node=2)  # 2 nodes of 2 ranks: HYBRID_SHARD / _HYBRID_SHARD_ZERO2
    est = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, strategy, fsdp=plan)))
    hybrid = "HYBRID_SHARD" if strategy == "fsdp-full" else "_HYBRID_SHARD_ZERO2"
    assert any(f"FullyShardedDataParallel({hybrid})" in n and "fake 2-D mesh of 2 x 2 ranks" in n
               for n in est.coverage.notes), est.coverage.notes
    # Each rank holds the flat shards and state of its index in its node, as FSDP1 gives them over the two groups.
    flat, state = _real_shards(model, FSDP1Plan(sharding_strategy=hybrid, ranks_per_node=2), est.peak_rank, x)
    assert (est.breakdown["parameters"], est.breakdown["optimizer_state"]) == (flat, state)
    assert fsdp1_rank_groups(model, plan, WORLD) == [[0, 2], [1, 3]]  # a rank's shard: its index in its node
    # Every unit's gradient shard is all-reduced across the two nodes, in place (a block's 4422 elements / 2; the
    # root's head, 66 + 1 with FSDP1's alignment padding after the weight to 68 + 1, and 1 more to split in two:
    # 70 / 2), so each rank peaks as one node's FSDP does.
    assert set(calls) == {(2211, 2), (35, 2)}
    assert est.per_rank_peak_bytes == node.per_rank_peak_bytes * 2


@pytest.mark.slow
def test_plan_options_are_checked_and_change_the_figure():
    from torch.distributed.fsdp import MixedPrecision

    with pytest.raises(ValueError, match="shards over the ranks of one node: pass `ranks_per_node`"):
        FSDP1Plan(sharding_strategy="HYBRID_SHARD")
    with pytest.raises(ValueError, match="`ranks_per_node` is for hybrid strategies"):
        FSDP1Plan(sharding_strategy="FULL_SHARD", ranks_per_node=2)
    with pytest.raises(TypeError, match="MixedPrecision"):
        FSDP1Plan(mixed_precision="bf16")
    with pytest.raises(ValueError, match="backward_prefetch"):
        FSDP1Plan(backward_prefetch="SOMETIMES")
    model, optimizer, x = _setup()
    with pytest.raises(ValueError, match="pass sharding='fsdp-full' or 'fsdp-grad-op'"):
        preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(2, "fsdp2", fsdp=FSDP1Plan())))
    with pytest.raises(ValueError, match="make them agree"):
        preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(2, "fsdp-full", fsdp=FSDP1Plan(sharding_strategy="SHARD_GRAD_OP"))))
    with pytest.raises(ValueError, match="says how FSDP wraps the model"):
        preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(2, "zero2", fsdp=FSDP1Plan())))
    default = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full")))
    mixed = FSDP1Plan(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    bf16 = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full", fsdp=mixed)))
    no_prefetch = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full", fsdp=FSDP1Plan(backward_prefetch=None))))
    forward = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full", fsdp=FSDP1Plan(forward_prefetch=True))))
    # fp32 shards as FSDP1 lays them out for bf16 compute; the gathered copies are bf16: half the bytes.
    mixed = FSDP1Plan(mixed_precision=mixed.mixed_precision, sharding_strategy="FULL_SHARD")
    assert bf16.breakdown["parameters"] == _real_shards(model, mixed, bf16.peak_rank, x)[0]
    assert bf16.peak_bytes < default.peak_bytes
    # Prefetching gathers the next unit while this one computes: one unit more alive (each matched a real gloo run
    # to the byte on this model, 4 ranks).
    assert no_prefetch.peak_bytes < default.peak_bytes < forward.peak_bytes


def _fsdp1_internals() -> dict[str, object]:
    """What the trace patches in FSDP1's modules, by name: process-wide, so it must be put back."""
    from torch.distributed.fsdp import _flat_param, _runtime_utils

    names = {_flat_param: ("_alloc_storage", "_free_storage", "_same_storage", "_data_ptr_allocated", "dist"),
             _runtime_utils: ("_reduce_grad", "_reduce_grad_no_shard", "_catch_all_reshard", "dist")}
    return {f"{module.__name__}.{name}": getattr(module, name) for module, attrs in names.items() for name in attrs}


def test_the_users_objects_are_untouched_and_no_group_is_left():
    internals = _fsdp1_internals()
    model, optimizer, x = _setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = dict(model.state_dict(keep_vars=True))
    rng = torch.get_rng_state()
    preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-grad-op")))
    assert not dist.is_initialized()
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in model.state_dict(keep_vars=True).items():
        assert value is tensors[name] and torch.equal(value, before[name])
    assert not optimizer.state and all(p.grad is None for p in model.parameters())
    assert type(model.layers[0]) is nn.Linear and not model._forward_pre_hooks  # FSDP1 wrapped a copy
    assert all(value is internals[name] for name, value in _fsdp1_internals().items())
    with pytest.raises(ValueError, match="the user's own error"):  # put back on the way out of a failed trace too
        preflight.estimate(model, optimizer, x, step=_failing_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full")))
    assert all(value is internals[name] for name, value in _fsdp1_internals().items())
    assert not dist.is_initialized()


def _failing_step(m, b):
    if torch.distributed.is_initialized():  # the sharded trace, not the single-device rescale
        raise ValueError("the user's own error")
    return m(b)


def test_the_users_errors_and_wrong_units_are_raised_not_rescaled():
    model, optimizer, x = _setup()
    for sharding in ("fsdp-full", "fsdp2"):
        with pytest.raises(ValueError, match="the user's own error"):
            preflight.estimate(model, optimizer, x, step=_failing_step, run=preflight.Run(parallel=preflight.ParallelPlan(2, sharding)))
    with pytest.raises(ValueError, match="'layer.0', which is not a submodule"):
        preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(2, "fsdp-full", fsdp=FSDP1Plan(units=("layer.0",)))))


def test_what_cannot_be_traced_is_rescaled_and_says_why():
    model, optimizer, x = _setup()
    offloaded = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(2, "fsdp-full", offload_optimizer=True, offload_params=True)))
    assert offloaded.per_rank_peak_bytes is None
    assert any("CPU offload is not traced per rank yet; rescaled as fsdp-full" in n for n in offloaded.coverage.notes)
    stepped = torch.optim.AdamW(model.parameters())
    model(x).sum().backward()
    stepped.step()  # existing state: FSDP1's sharded copy of it is not traced
    model.zero_grad()
    est = preflight.estimate(model, stepped, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(2, "fsdp-full")))
    assert est.per_rank_peak_bytes is None
    assert any("rescaled as fsdp-full" in n and "FullyShardedDataParallel" in n for n in est.coverage.notes)


# ---- real 2-process runs with gloo -----------------------------------------------------------------------------

DEEP, NARROW, ROWS = 8, 128, 2048


def _gloo_worker(rank: int, world_size: int, port: int, strategy: str, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from preflight._device import live_storage_bytes
    from preflight._measure import cpu_profiled_peak
    from preflight._steps import run_steps

    with gloo_rank(rank, world_size, port):
        model, _, _ = _setup(depth=DEEP, width=NARROW)
        batch = torch.randn(ROWS, NARROW, generator=torch.Generator().manual_seed(1))
        # As a user wraps it: each block its own unit by class, the rest in the root, FSDP1's defaults otherwise; a
        # hybrid strategy over 2 "nodes" of consecutive ranks, as a 2-D mesh (FSDP1's intra- and inter-node groups).
        mesh = init_device_mesh("cpu", (2, world_size // 2)) if strategy == "HYBRID_SHARD" else None
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True,
                     sharding_strategy=ShardingStrategy[strategy], device_id=torch.device("cpu"), device_mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters())
        flats = [m._handle.flat_param for m in FSDP.fsdp_modules(model) if m._handle is not None]
        before = live_storage_bytes([flats, batch], torch.device("cpu"))
        dist.barrier()
        peak, _ = cpu_profiled_peak(lambda: run_steps(model, optimizer, batch, step=_step, precision=None,
                                                      device_type="cpu", steps=2), repair_lost_frees=True)
        queue.put((rank, before + peak))


@pytest.mark.slow
@pytest.mark.parametrize("strategy, world", [("FULL_SHARD", 2), ("SHARD_GRAD_OP", 2), ("HYBRID_SHARD", 4)])
def test_real_gloo_fsdp1_per_rank_peak_within_3_percent(strategy, world):
    import torch.multiprocessing as mp

    model, optimizer, _ = _setup(depth=DEEP, width=NARROW)
    batch = torch.randn(ROWS, NARROW, generator=torch.Generator().manual_seed(1))
    units = tuple(f"layers.{i}" for i in range(DEEP)) + ("head",)  # every Linear, as ModuleWrapPolicy({nn.Linear})
    sharding = "fsdp-grad-op" if strategy == "SHARD_GRAD_OP" else "fsdp-full"
    plan = FSDP1Plan(units=units, ranks_per_node=world // 2 if strategy == "HYBRID_SHARD" else None)
    est = preflight.estimate(model, optimizer, batch, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(world, sharding, fsdp=plan)))
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_gloo_worker, args=(world, port, strategy, queue), nprocs=world, start_method="spawn")
    measured = dict(queue.get() for _ in range(world))
    for rank in range(world):
        error = (est.per_rank_peak_bytes[rank] - measured[rank]) / measured[rank]
        assert abs(error) <= 0.03, (rank, est.per_rank_peak_bytes, measured)


def test_beyond_the_trace_cap_the_rank_holding_the_most_bounds_the_others(monkeypatch):
    import preflight._estimate as estimate_module

    model, optimizer, x = _setup()
    every = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full")))
    monkeypatch.setattr(estimate_module, "_MAX_RANK_TRACES", 1)  # the two groups of this model exceed it
    capped = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full")))
    assert capped.peak_bytes == every.peak_bytes == every.per_rank_peak_bytes[0]  # the largest rank, traced
    assert capped.per_rank_peak_bytes == (every.peak_bytes,) * WORLD  # rank 3 holds less: bounded from above
    assert every.per_rank_peak_bytes[3] < capped.per_rank_peak_bytes[3]
    assert any("rank 0 traced (it holds the most); 1 rank(s) cut their shards 1 other ways" in n
               and "upper bound" in n for n in capped.coverage.notes)


# ---- a model FSDP1 already wrapped (Lightning's FSDPStrategy, accelerate's FSDP1 plugin) -------------------------

def _storages(model: nn.Module) -> dict[str, object]:
    """What FSDP1 holds for ``model``: each unit's flat parameter's and padded buffer's storage sizes and training
    state, and every parameter's values and shape (bitwise)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    held = {}
    for i, unit in enumerate(FSDP.fsdp_modules(model)):
        if unit._handle is not None:
            flat = unit._handle.flat_param
            sizes = tuple(getattr(flat, k).untyped_storage().nbytes() if hasattr(flat, k) else None
                          for k in ("_local_shard", "_full_param_padded", "_mp_shard"))  # from FSDP1's lazy init
            held[f"unit {i}"] = (flat.untyped_storage().nbytes(), *sizes, str(unit.training_state), unit._is_root)
    for name, p in model.named_parameters():
        held[name] = (p.detach().clone(), p.shape, p.requires_grad, p.grad)
    return held


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    def equal(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, tuple):
            return isinstance(y, tuple) and len(x) == len(y) and all(equal(u, v) for u, v in zip(x, y))
        return x == y
    return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)


def _wrapped_worker(rank: int, world_size: int, port: int, queue) -> None:
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from preflight._device import live_storage_bytes
    from preflight._measure import cpu_profiled_peak
    from preflight._steps import run_steps
    from preflight.parallel import read_fsdp1

    out = {"rank": rank}
    with gloo_rank(rank, world_size, port):
        model, optimizer, _ = _setup(depth=DEEP, width=NARROW)
        batch = torch.randn(ROWS, NARROW, generator=torch.Generator().manual_seed(1))
        # The prediction before wrapping, in this process (its thread count sets CPU kernels' calibrated scratch).
        out["before"] = preflight.estimate(model, optimizer, batch, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(world_size, "fsdp-full", fsdp=_PLAN))).per_rank_peak_bytes
        # As Lightning's FSDPStrategy wraps it: the root, each block its own unit, use_orig_params=True.
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True,
                     sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"))
        optimizer = torch.optim.AdamW(model.parameters())
        before = _storages(model)
        group = (dist.get_world_size(), dist.get_rank())
        # The module the wrapper holds, as the callbacks see it (Lightning's LightningModule, accelerate's unwrapped
        # model); `test_a_model_fsdp1_wrapped_is_traced_per_rank_as_before_it_was_wrapped` passes the wrapper too.
        est = preflight.estimate(model.module, optimizer, batch, step=_step)
        out["plan"] = read_fsdp1(model.module).plan
        out["wrapped"] = (est.sharding, est.world_size, est.per_rank_peak_bytes)
        out["untouched"] = (_same(before, _storages(model)) and not optimizer.state
                            and (dist.get_world_size(), dist.get_rank()) == group and dist.is_initialized())
        flats = [m._handle.flat_param for m in FSDP.fsdp_modules(model) if m._handle is not None]
        resident = live_storage_bytes([flats, batch], torch.device("cpu"))
        dist.barrier()
        peak, _ = cpu_profiled_peak(lambda: run_steps(model, optimizer, batch, step=_step, precision=None,
                                                      device_type="cpu", steps=2), repair_lost_frees=True)
        out["measured"] = resident + peak
        # Every other option FSDP1 takes, read back off a second wrapping (flat parameters in the optimizer).
        other, other_optimizer, _ = _setup(depth=2, width=NARROW)
        out["other_before"] = preflight.estimate(other, other_optimizer, batch, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(world_size, "fsdp-grad-op", fsdp=_other_plan()))).per_rank_peak_bytes
        other = FSDP(other, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=False,
                     sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, device_id=torch.device("cpu"),
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
                     backward_prefetch=BackwardPrefetch.BACKWARD_POST, forward_prefetch=True, limit_all_gathers=False)
        out["other_plan"] = read_fsdp1(other).plan
        other_optimizer = torch.optim.AdamW(other.parameters())  # over the flat parameters
        before = _storages(other)
        out["other"] = preflight.estimate(other, other_optimizer, batch, step=_step).per_rank_peak_bytes
        out["other_untouched"] = _same(before, _storages(other)) and not other_optimizer.state
        queue.put(out)


_PLAN = FSDP1Plan(units=tuple(f"layers.{i}" for i in range(DEEP)) + ("head",), sharding_strategy="FULL_SHARD")


def _other_plan() -> FSDP1Plan:
    from torch.distributed.fsdp import MixedPrecision

    return FSDP1Plan(units=("layers.0", "layers.1", "head"), sharding_strategy="SHARD_GRAD_OP",
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), use_orig_params=False,
                     backward_prefetch="BACKWARD_POST", forward_prefetch=True, limit_all_gathers=False)


@pytest.mark.slow
def test_a_model_fsdp1_already_wrapped_is_traced_per_rank_from_its_own_plan():
    import torch.multiprocessing as mp

    world = 2
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_wrapped_worker, args=(world, port, queue), nprocs=world, start_method="spawn")
    results = {r["rank"]: r for r in (queue.get() for _ in range(world))}
    # Every option is read back: the Lightning-like wrapping's, and the other one's.
    assert results[0]["plan"] == results[1]["plan"] == _PLAN
    assert results[0]["other_plan"] == results[1]["other_plan"] == _other_plan()
    # Each rank's figure on the wrapped model is the one predicted before wrapping (with flat parameters in the
    # optimizer and every option changed too), and within 3% of the rank's measured peak.
    for rank in range(world):
        result = results[rank]
        before = result["before"]
        assert result["untouched"] and result["other_untouched"]
        assert result["wrapped"] == ("fsdp-full", world, before)
        assert result["other"] == result["other_before"]
        error = (before[rank] - result["measured"]) / result["measured"]
        print(f"rank {rank}: predicted {before[rank]} measured {result['measured']} ({error:+.2%})")
        assert abs(error) <= 0.03, (rank, before, result["measured"])


def _wrapped_in_a_job(rank: int = 3, world: int = WORLD, **options):
    """`_setup`'s model wrapped by FullyShardedDataParallel (each Linear a unit, then the root, as Lightning's
    FSDPStrategy with ``auto_wrap_policy={nn.Linear}`` does) in a fake job of ``world`` ranks."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model, _, x = _setup()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    options = {"use_orig_params": True, "auto_wrap_policy": ModuleWrapPolicy({nn.Linear}), **options}
    model = FSDP(model, device_id=torch.device("cpu"), **options)
    return model, torch.optim.AdamW(model.parameters()), x


_UNITS = ("layers.0", "layers.1", "layers.2", "head")


@pytest.mark.slow
@pytest.mark.parametrize("orig", [True, False])
def test_a_model_fsdp1_wrapped_is_traced_per_rank_as_before_it_was_wrapped(orig):
    model, optimizer, x = _setup()
    plan = FSDP1Plan(units=_UNITS, use_orig_params=orig)
    alone = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full", fsdp=plan)))
    model, optimizer, x = _wrapped_in_a_job(use_orig_params=orig)
    try:
        model(x).backward()  # a trained model: FSDP1's lazy init done, gradients held
        # Lightning's forward redirection leaves the module's own bound `forward` on the instance after a step.
        model.module.forward = model.module.forward
        held = _storages(model)
        est = preflight.estimate(model, optimizer, x, step=_step)
        inner = preflight.estimate(model.module, optimizer, x, step=_step)  # what Lightning's callback sees
        assert _same(held, _storages(model)) and not optimizer.state and dist.get_rank() == 3
    finally:
        dist.destroy_process_group()
    assert est.per_rank_peak_bytes == inner.per_rank_peak_bytes == alone.per_rank_peak_bytes
    assert (est.sharding, est.world_size) == ("fsdp-full", WORLD)
    assert any("already wrapped by FullyShardedDataParallel" in n and "rank 3" in n for n in est.coverage.notes)
    if orig:  # rank 3 holds the padding: less optimizer state over its views
        assert est.step_peaks(3) != est.step_peaks(0)


def test_a_wrapped_fsdp1_models_conflicting_arguments_and_unfollowed_wrappings_are_refused():
    from torch.distributed.fsdp import CPUOffload

    from preflight.parallel import read_fsdp1

    model, optimizer, x = _wrapped_in_a_job(rank=0, world=2)
    try:
        read = read_fsdp1(model)
        assert (read.world_size, read.rank, read.root) == (2, 0, model)
        assert read_fsdp1(model.module).root is model  # the wrapper found around the module it holds
        with pytest.raises(ValueError, match="world_size=4 says otherwise"):
            preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(4, None)))
        with pytest.raises(ValueError, match="sharding='fsdp-grad-op'"):
            preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(2, "fsdp-grad-op")))
    finally:
        dist.destroy_process_group()
    model, optimizer, x = _wrapped_in_a_job(rank=0, world=2, cpu_offload=CPUOffload(offload_params=True))
    try:
        with pytest.raises(ValueError, match="CPUOffload"):
            read_fsdp1(model)
    finally:
        dist.destroy_process_group()
    model, optimizer, x = _wrapped_in_a_job(rank=0, world=2)
    try:
        model.register_comm_hook(None, lambda state, grad: None)
        with pytest.raises(ValueError, match="communication hook"):
            read_fsdp1(model)
    finally:
        dist.destroy_process_group()
    assert read_fsdp1(_setup()[0]) is None


@pytest.mark.slow
def test_a_model_whose_wrapper_is_only_around_it_is_read_through_the_wrapper():
    from preflight.parallel import already_sharded, read_fsdp1

    model, optimizer, x = _setup()
    alone = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full", fsdp=FSDP1Plan(units=()))))
    model, optimizer, x = _wrapped_in_a_job(auto_wrap_policy=None)  # the root alone: no wrapper inside the module
    try:
        assert not any(isinstance(m, type(model)) for m in model.module.modules())
        assert already_sharded(model.module) == "the model is held by a FullyShardedDataParallel wrapper"
        assert read_fsdp1(model.module).plan == FSDP1Plan(units=(), sharding_strategy="FULL_SHARD")
        est = preflight.estimate(model.module, optimizer, x, step=_step)
    finally:
        dist.destroy_process_group()
    assert est.per_rank_peak_bytes == alone.per_rank_peak_bytes


@pytest.mark.slow
def test_the_callbacks_give_a_wrapped_fsdp1_model_a_per_rank_verdict():
    from preflight.verdict import Options, predict
    from preflight.parallel import fsdp_plan

    model, optimizer, x = _setup()
    alone = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full", fsdp=FSDP1Plan(units=_UNITS))))
    model, optimizer, x = _wrapped_in_a_job()
    try:  # the module the wrapper holds and the strategy's own plan, as Lightning's callback passes them
        plan = fsdp_plan("FULL_SHARD", world_size=WORLD, source="Lightning FSDPStrategy")
        reports = [predict(model.module, optimizer, x,
                           preflight.Run(target=preflight.Target(budget=budget), parallel=plan), step=_step,
                           options=Options(suggest=False))
                   for budget in (alone.peak_bytes * 2, alone.peak_bytes // 2)]
    finally:
        dist.destroy_process_group()
    assert [r.fits for r in reports] == [True, False]
    for report in reports:
        assert report.predicted_peak_bytes == alone.peak_bytes and not report.coverage["lower_bound"]
        assert not any(w.startswith("no verdict") for w in report.warnings)


@pytest.mark.slow
def test_a_wrapped_fsdp1_models_evaluation_and_suggestions_are_those_of_the_model_before_wrapping(monkeypatch):
    # Evaluation and the suggestions' options run on the wrapped model's unwrapped meta copy
    # (`preflight.parallel.stand_in`) under the plan read off the wrapping: the figures predicted before wrapping.
    from conftest import only_options
    from preflight.verdict import Options, predict
    from preflight.parallel import ParallelPlan, fsdp_plan

    # Three options whose figures depend on the plan (each traced per rank); test_options.py traces every one.
    only_options(monkeypatch, "activation checkpointing", "bf16 precision", "sharding")

    model, optimizer, x = _setup()
    plan = ParallelPlan(WORLD, "fsdp-full", fsdp=FSDP1Plan(units=_UNITS))
    alone = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=plan))
    options = Options()
    run = preflight.Run(target=preflight.Target(budget=alone.peak_bytes))  # over by the headroom: suggestions
    before = predict(model, optimizer, x, run.replace(parallel=plan), step=_step, options=options, eval_batch=x)
    model, optimizer, x = _wrapped_in_a_job(rank=0)  # rank zero suggests
    try:
        held = _storages(model)
        after = predict(model.module, optimizer, x,
                        run.replace(parallel=fsdp_plan("FULL_SHARD", world_size=WORLD, source="Lightning FSDPStrategy")),
                        step=_step, options=options, eval_batch=x)
        assert _same(held, _storages(model)) and not optimizer.state
    finally:
        dist.destroy_process_group()
    assert after.predicted_peak_bytes == before.predicted_peak_bytes and after.fits is False
    assert after.eval_predicted_peak_bytes == before.eval_predicted_peak_bytes is not None
    assert any(n.startswith("evaluation peak: this rank's share") for n in after.coverage["notes"])
    def said(report):  # the search's wall time is in a combination's words: the rest must be the same
        return [(re.sub(r"traced in [\d.]+ s", "traced in ... s", s["description"]), s["predicted_peak_bytes"])
                for s in report.suggestions]

    assert after.suggestions and said(after) == said(before)


@pytest.mark.slow
def test_a_hybrid_wrapping_is_read_with_its_nodes_and_traced_as_before():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from preflight.parallel import read_fsdp1

    model, optimizer, x = _setup()
    plan = FSDP1Plan(units=_UNITS, sharding_strategy="HYBRID_SHARD", ranks_per_node=2)
    alone = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full", fsdp=plan)))
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=WORLD)
    try:  # rank 3: node 1, index 1 in its node
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True,
                     sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=init_device_mesh("cpu", (2, 2)),
                     device_id=torch.device("cpu"))
        read = read_fsdp1(model)
        est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), x, step=_step)
    finally:
        dist.destroy_process_group()
    assert (read.plan, read.world_size, read.rank) == (plan, WORLD, 3)
    assert est.per_rank_peak_bytes == alone.per_rank_peak_bytes


@pytest.mark.slow
def test_the_module_a_wrapper_holds_steps_through_the_root_wrapper_as_the_trainers_run_it():
    """The callbacks pass the module the root wrapper holds and step it (Lightning: ``training_step``, which its
    ``FSDPStrategy`` runs as the root's forward); the trace runs each step through the root's forward the same way,
    so the figure is the one of the wrapped model stepped through its root."""
    model, optimizer, x = _setup()
    alone = preflight.estimate(model, optimizer, x, step=_step, run=preflight.Run(parallel=preflight.ParallelPlan(WORLD, "fsdp-full", fsdp=FSDP1Plan(units=_UNITS))))
    model, optimizer, x = _wrapped_in_a_job()
    inner = model.module
    inner.training_step = types.MethodType(lambda self, batch: self(batch), inner)  # a LightningModule's hook
    try:
        est = preflight.estimate(inner, optimizer, x, step=lambda m, b: m.training_step(b))
        assert "forward" not in vars(inner)  # the redirection is put back
    finally:
        dist.destroy_process_group()
    assert est.per_rank_peak_bytes == alone.per_rank_peak_bytes
