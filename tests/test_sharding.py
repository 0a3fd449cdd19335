"""Per-rank memory under DDP / ZeRO / FSDP sharding, and the DeepSpeed config reader."""

from __future__ import annotations

import json

import pytest

from preflight._sharding import (
    SHARDING_CHOICES,
    ShardedState,
    model_state_bytes,
    read_deepspeed_config,
    shard_breakdown,
    zero3_terms,
)

GB = 10**9


@pytest.mark.parametrize(
    "sharding, paper_gb",
    [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)],
)
def test_zero_paper_figure_1(sharding, paper_gb):
    # arXiv:1910.02054 Figure 1: 7.5B parameters, N_d = 64, mixed-precision Adam (K = 12). The paper rounds
    # to one decimal (31.40625 -> 31.4, 16.640625 -> 16.6, 1.875 -> 1.9).
    state = model_state_bytes(7_500_000_000, world_size=64, sharding=sharding)
    assert state.total / GB == pytest.approx(paper_gb, abs=0.05)


def test_zero_paper_terms():
    psi, n = 7_500_000_000, 64
    assert model_state_bytes(psi, world_size=n, sharding="ddp") == ShardedState(2 * psi, 2 * psi, 12 * psi)
    assert model_state_bytes(psi, world_size=n, sharding="zero1") == ShardedState(2 * psi, 2 * psi, 12 * psi // n)
    assert model_state_bytes(psi, world_size=n, sharding="zero2") == ShardedState(2 * psi, 2 * psi // n, 12 * psi // n)
    assert model_state_bytes(psi, world_size=n, sharding="zero3") == ShardedState(
        2 * psi // n, 2 * psi // n, 12 * psi // n
    )


def test_fsdp_strategies_match_their_zero_stages():
    for fsdp, zero in (("fsdp-full", "zero3"), ("fsdp-grad-op", "zero2")):
        expected = model_state_bytes(10**9, world_size=8, sharding=zero)
        assert model_state_bytes(10**9, world_size=8, sharding=fsdp) == expected


def test_one_rank_is_the_single_gpu_baseline():
    base = model_state_bytes(1000, world_size=1, sharding="ddp")
    assert all(model_state_bytes(1000, world_size=1, sharding=s) == base for s in SHARDING_CHOICES)


def test_shares_round_up():
    # 10 parameters over 4 ranks: each rank holds 3 (FSDP pads the flat parameter to a multiple of 4).
    state = model_state_bytes(
        10, world_size=4, sharding="zero3", param_bytes=4, grad_bytes=4, optimizer_state_bytes_per_param=8
    )
    assert state == ShardedState(parameters=12, gradients=12, optimizer_state=24)
    assert state.total == 48
    assert state.to_dict() == {"parameters": 12, "gradients": 12, "optimizer_state": 24, "total": 48}


def test_offload():
    psi = 1_000_000
    zero2 = model_state_bytes(psi, world_size=4, sharding="zero2", offload_optimizer=True)
    assert zero2 == ShardedState(2 * psi, 2 * psi // 4, 0)
    zero3 = model_state_bytes(psi, world_size=4, sharding="zero3", offload_optimizer=True, offload_params=True)
    assert zero3 == ShardedState(0, 2 * psi // 4, 0)
    # FSDP CPUOffload(offload_params=True) also moves gradients and the optimizer step to CPU.
    assert model_state_bytes(psi, world_size=4, sharding="fsdp-full", offload_params=True).total == 0


def test_invalid_sharding_lists_the_choices():
    with pytest.raises(ValueError) as err:
        model_state_bytes(10, world_size=2, sharding="zero4")
    message = str(err.value)
    assert "'zero4'" in message and all(choice in message for choice in SHARDING_CHOICES)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(world_size=0, sharding="ddp"), "`world_size` should be an integer >= 1, got 0"),
        (dict(world_size=2, sharding="zero2", offload_params=True), "Use sharding='zero3' or 'fsdp-full'"),
        (dict(world_size=2, sharding="ddp", offload_optimizer=True), "DDP keeps the optimizer on the GPU"),
        (dict(world_size=2, sharding="fsdp-full", offload_optimizer=True), "CPUOffload(offload_params=True)"),
        (dict(world_size=2, sharding="zero1", param_bytes=-2), "`param_bytes` should be an integer >= 0"),
    ],
)
def test_invalid_options(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        model_state_bytes(10, **kwargs)
    assert fragment in str(err.value)


BREAKDOWN = {
    "parameters": 4000,
    "buffers": 40,
    "gradients": 4000,
    "optimizer_state": 8000,
    "activations": 3000,
    "temporaries": 500,
    "inputs": 64,
}


def test_breakdown_zero_stages():
    z1 = shard_breakdown(BREAKDOWN, world_size=4, sharding="zero1")
    assert z1 == {**BREAKDOWN, "optimizer_state": 2000}
    z2 = shard_breakdown(BREAKDOWN, world_size=4, sharding="zero2")
    assert z2 == {**BREAKDOWN, "optimizer_state": 2000, "gradients": 1000}
    assert shard_breakdown(BREAKDOWN, world_size=4, sharding="fsdp-grad-op") == z2


def test_breakdown_zero3_adds_the_gathered_units():
    z3 = shard_breakdown(BREAKDOWN, world_size=4, sharding="zero3", largest_unit_param_bytes=300)
    assert z3 == {**BREAKDOWN, "optimizer_state": 2000, "gradients": 1000, "parameters": 1000,
                  "temporaries": 500 + 2 * 300}
    assert shard_breakdown(BREAKDOWN, world_size=4, sharding="fsdp-full", largest_unit_param_bytes=300) == z3
    # Unknown unit: the whole model is one unit, gathered once (nothing to prefetch).
    whole = shard_breakdown(BREAKDOWN, world_size=4, sharding="zero3")
    assert whole["temporaries"] == 500 + 4000
    # A unit larger than half the model cannot be prefetched beyond the model itself.
    big = shard_breakdown(BREAKDOWN, world_size=4, sharding="zero3", largest_unit_param_bytes=3000)
    assert big["temporaries"] == 500 + 4000


def test_breakdown_ddp_buckets():
    ddp = shard_breakdown(BREAKDOWN, world_size=8, sharding="ddp")
    assert ddp == {**BREAKDOWN, "gradients": 8000}
    view = shard_breakdown(BREAKDOWN, world_size=8, sharding="ddp", gradient_as_bucket_view=True)
    assert view == BREAKDOWN
    # The buckets hold each gradient once whatever their cap.
    assert shard_breakdown(BREAKDOWN, world_size=8, sharding="ddp", ddp_bucket_bytes=2**20) == ddp


def test_breakdown_offload():
    z3 = shard_breakdown(BREAKDOWN, world_size=4, sharding="zero3", largest_unit_param_bytes=300,
                         offload_optimizer=True, offload_params=True)
    assert z3 == {**BREAKDOWN, "parameters": 0, "gradients": 1000, "optimizer_state": 0, "temporaries": 1100}
    fsdp = shard_breakdown(
        BREAKDOWN, world_size=4, sharding="fsdp-full", largest_unit_param_bytes=300, offload_params=True
    )
    assert fsdp == {**BREAKDOWN, "parameters": 0, "gradients": 0, "optimizer_state": 0, "temporaries": 1100}
    z1 = shard_breakdown(BREAKDOWN, world_size=4, sharding="zero1", offload_optimizer=True)
    assert z1 == {**BREAKDOWN, "optimizer_state": 0}


def test_breakdown_is_not_modified():
    before = dict(BREAKDOWN)
    shard_breakdown(BREAKDOWN, world_size=4, sharding="zero3")
    assert BREAKDOWN == before


def test_breakdown_errors():
    with pytest.raises(ValueError, match=r"missing \['inputs'\], unknown \['weights'\]"):
        shard_breakdown({**{k: v for k, v in BREAKDOWN.items() if k != "inputs"}, "weights": 1},
                        world_size=2, sharding="zero1")
    with pytest.raises(ValueError, match=r"`breakdown\['gradients'\]` should be an integer >= 0, got -1"):
        shard_breakdown({**BREAKDOWN, "gradients": -1}, world_size=2, sharding="zero1")
    with pytest.raises(ValueError, match="`sharding` should be one of"):
        shard_breakdown(BREAKDOWN, world_size=2, sharding="FSDP")
    with pytest.raises(ValueError, match="`ddp_bucket_bytes` should be an integer >= 1"):
        shard_breakdown(BREAKDOWN, world_size=2, sharding="ddp", ddp_bucket_bytes=0)


def test_deepspeed_defaults():
    cfg = read_deepspeed_config({})
    assert cfg == {
        "stage": 0,
        "sharding": "ddp",
        "offload_optimizer": False,
        "offload_optimizer_device": "none",
        "offload_params": False,
        "offload_param_device": "none",
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 500_000_000,
        "allgather_bucket_size": 500_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "stage3_model_persistence_threshold": 2**63 - 1,
        "sub_group_size": 1_000_000_000,
        "stage3_gather_16bit_weights_on_model_save": False,
        "bf16": False,
        "fp16": False,
    }


def test_deepspeed_stage3_offload_from_a_file(tmp_path):
    config = {
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
            "reduce_bucket_size": 5e7,
        },
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    for source in (path, str(path), config, json.dumps(config)):
        cfg = read_deepspeed_config(source)
        assert cfg["stage"] == 3 and cfg["sharding"] == "zero3"
        assert cfg["offload_optimizer"] and cfg["offload_optimizer_device"] == "cpu"
        assert cfg["offload_params"] and cfg["offload_param_device"] == "nvme"
        assert cfg["overlap_comm"] is True  # DeepSpeed turns it on by default for stage 3
        assert cfg["reduce_bucket_size"] == 50_000_000 and isinstance(cfg["reduce_bucket_size"], int)
        assert cfg["bf16"] is True and cfg["fp16"] is False
    # The reader's flags plug straight into shard_breakdown.
    shard_breakdown(BREAKDOWN, world_size=2, sharding=cfg["sharding"],
                    offload_optimizer=cfg["offload_optimizer"], offload_params=cfg["offload_params"])


def test_deepspeed_offload_param_is_ignored_below_stage_3():
    cfg = read_deepspeed_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"},
                                                       "overlap_comm": True}})
    assert cfg["offload_params"] is False and cfg["offload_param_device"] == "none"
    assert cfg["overlap_comm"] is True


def test_deepspeed_auto_values():
    config = {"fp16": {"enabled": "auto"}, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"}}
    cfg = read_deepspeed_config(config)
    assert cfg["reduce_bucket_size"] is None and cfg["stage3_prefetch_bucket_size"] is None
    assert cfg["fp16"] is None
    # Filled like the Hugging Face Trainer does from the model's hidden size.
    cfg = read_deepspeed_config(config, hidden_size=4096)
    assert cfg["reduce_bucket_size"] == 4096**2
    assert cfg["stage3_prefetch_bucket_size"] == int(0.9 * 4096**2)
    assert cfg["stage3_param_persistence_threshold"] == 40_960


def test_deepspeed_deprecated_spellings():
    assert read_deepspeed_config({"zero_optimization": True})["stage"] == 1
    cfg = read_deepspeed_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg["offload_optimizer"] and cfg["offload_optimizer_device"] == "cpu"
    gather = "stage3_gather_16bit_weights_on_model_save"
    assert read_deepspeed_config({"zero_optimization": {"stage": 3, gather.replace("16bit", "fp16"): True}})[gather]
    assert read_deepspeed_config({"zero_optimization": {"stage": 3, gather: "auto"}})[gather] is None


def test_deepspeed_errors(tmp_path):
    with pytest.raises(ValueError, match="should be 0, 1, 2 or 3, got 4"):
        read_deepspeed_config({"zero_optimization": {"stage": 4}})
    with pytest.raises(ValueError, match="offload_optimizer.device` should be one of none, cpu, nvme, got 'gpu'"):
        read_deepspeed_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}})
    with pytest.raises(FileNotFoundError):
        read_deepspeed_config(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="should be a dict, a JSON string or a path"):
        read_deepspeed_config(3)


def _z3(world_size=2, itemsize=4, grad_itemsize=None, params=None, modules=None, **zero):
    ds = read_deepspeed_config({"zero_optimization": {"stage": 3, **zero}})
    if params is None:  # eight modules of one 1000-element parameter each
        params = [(i, 1000, True) for i in range(8)]
        modules = [[i] for i in range(8)]
    return zero3_terms(ds, params, modules, world_size=world_size, param_itemsize=itemsize,
                       grad_itemsize=grad_itemsize or itemsize)


def test_zero3_partitions_master_and_gradient_buffers():
    # Partitions round up per parameter (10 -> 3, 7 -> 2 over 4 ranks); the frozen one has neither master nor
    # gradient partition. fp32 master (4 B) whatever the model's dtype; gradients in their own dtype.
    t = _z3(world_size=4, itemsize=2, params=[(1, 10, True), (2, 7, True), (3, 100, False)], modules=[[1, 2, 3]])
    assert t.master_bytes == 4 * 5 and t.grad_partition_bytes == 2 * 5
    assert t.init_grad_bytes == t.step_grad_bytes == 4 * 5  # one sub-group


def test_zero3_sub_groups():
    # sub_group_size 4 over partitions of 3, 2, 5 elements: the first sub-group closes at 5 (>= 4), the second at 5.
    t = _z3(world_size=4, params=[(1, 10, True), (2, 7, True), (3, 20, True)], modules=[[1, 2, 3]],
            sub_group_size=4)
    assert t.master_bytes == 4 * 10 and t.init_grad_bytes == t.step_grad_bytes == 4 * 5


def test_zero3_persistent_parameters_stay_whole():
    params = [(1, 1000, True), (2, 10, True), (3, 50, True)]
    t = _z3(params=params, modules=[[1, 2], [3]], stage3_param_persistence_threshold=50)
    assert t.persistent_bytes == 4 * 60  # both small ones, whole on every rank
    # The running total is capped by stage3_model_persistence_threshold: 10 fits, 10 + 50 does not.
    t = _z3(params=params, modules=[[1, 2], [3]], stage3_param_persistence_threshold=50,
            stage3_model_persistence_threshold=55)
    assert t.persistent_bytes == 4 * 10
    # Only non-persistent parameters count as gathered (the one of 1000 elements, all kept by default).
    assert t.gathered_bytes == 4 * 1050


def test_zero3_first_step_gathers_one_module_at_a_time():
    t = _z3(stage3_param_persistence_threshold=0)
    assert t.first_step_gathered_bytes == 4 * 2 * 1000  # the module in use and its all-gather output


def test_zero3_reuse_distance_keeps_parameters_for_backward():
    # By default (1e9 elements) every parameter is kept from its forward to its backward.
    assert _z3(stage3_param_persistence_threshold=0).gathered_bytes == 4 * 8000
    # Within 1500 elements only the last module reaches its backward use (the next module); the others are
    # released. Gathered: the kept one + 2 x (largest module + prefetch window). With no prefetch:
    t = _z3(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=1500, stage3_prefetch_bucket_size=0)
    assert t.gathered_bytes == 4 * (1000 + 2 * 1000)


def test_zero3_prefetch_bucket_and_max_live_parameters_cap_the_gathered_bytes():
    small = dict(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=1500)
    # Prefetch window: the bucket (500) plus at most one parameter's overshoot (999), as DeepSpeed adds whole ones.
    t = _z3(**small, stage3_prefetch_bucket_size=500)
    assert t.gathered_bytes == 4 * (1000 + 2 * (1000 + 500 + 999))
    # stage3_max_live_parameters 1200 leaves 200 beside the 1000 kept.
    t = _z3(**small, stage3_prefetch_bucket_size=500, stage3_max_live_parameters=1200)
    assert t.gathered_bytes == 4 * (1000 + 2 * (1000 + 200 + 999))
    # With nothing left under it, nothing is prefetched.
    t = _z3(**small, stage3_prefetch_bucket_size=500, stage3_max_live_parameters=1000)
    assert t.gathered_bytes == 4 * (1000 + 2 * 1000)
    # Never more than every non-persistent parameter.
    assert _z3(**small, stage3_prefetch_bucket_size=10**6).gathered_bytes == 4 * 8000


def test_zero3_terms_need_resolved_auto_values():
    ds = read_deepspeed_config({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}})
    with pytest.raises(ValueError, match="stage3_param_persistence_threshold` is \"auto\""):
        zero3_terms(ds, [(1, 10, True)], [[1]], world_size=2, param_itemsize=4, grad_itemsize=4)
