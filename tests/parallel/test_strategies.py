"""A trainer's strategy settings as a per-rank plan (`preflight.parallel.ParallelPlan`), and predictions that use it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import lm_batch, make_gpt2, only_options
from torch.distributed.fsdp import ShardingStrategy

import preflight
from preflight.verdict import Options, predict
from preflight._estimate import check_plan, fsdp_trace_plan
from preflight.parallel import FSDP1Plan, FSDP2Plan, ParallelPlan, deepspeed_plan, fsdp_plan


@pytest.mark.parametrize("strategy, sharding", [
    (ShardingStrategy.FULL_SHARD, "fsdp-full"), ("SHARD_GRAD_OP", "fsdp-grad-op"), ("shard_grad_op", "fsdp-grad-op"),
    (None, "fsdp-full"), (ShardingStrategy.NO_SHARD, "ddp"), ("fsdp2", "fsdp2"),
])
def test_fsdp_strategies_in_any_spelling(strategy, sharding):
    plan = fsdp_plan(strategy, world_size=8)
    assert (plan.sharding, plan.world_size, plan.offload_params) == (sharding, 8, False)
    assert plan.sharded is (sharding != "ddp")
    check_plan(**fsdp_plan(strategy, world_size=8, cpu_offload=True).estimate_kwargs())  # estimate accepts it


def test_hybrid_sharding_plans_every_rank_sharded_over_one_node_and_offload_moves_state_to_the_cpu():
    plan = fsdp_plan(ShardingStrategy.HYBRID_SHARD, world_size=16, ranks_per_node=8, cpu_offload=True)
    assert plan.estimate_kwargs() == {"world_size": 16, "sharding": "fsdp-full", "offload_optimizer": True,
                                      "offload_params": True, "fsdp": FSDP1Plan(ranks_per_node=8)}
    assert "fsdp-full over 16 rank(s) as 2 replica(s) of 8-rank shard groups" in plan.note()
    one_node = fsdp_plan("_HYBRID_SHARD_ZERO2", world_size=4)  # no ranks_per_node: one node holds every rank
    assert (one_node.sharding, one_node.fsdp) == ("fsdp-grad-op", FSDP1Plan(ranks_per_node=4))
    hsdp = fsdp_plan("fsdp2", world_size=8, replicate=2)
    assert (hsdp.world_size, hsdp.fsdp) == (8, FSDP2Plan(replicate=2))
    with pytest.raises(ValueError, match=r"`ranks_per_node` \(4\) should divide `world_size` \(6\)"):
        fsdp_plan("HYBRID_SHARD", world_size=6, ranks_per_node=4)
    with pytest.raises(ValueError, match=r"`fsdp.replicate` \(4\) should divide the world size 6"):
        fsdp_plan("fsdp2", world_size=6, replicate=4)
    with pytest.raises(ValueError, match="Unknown FSDP sharding strategy 'SHARD_EVERYTHING'"):
        fsdp_plan("SHARD_EVERYTHING", world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        fsdp_plan("FULL_SHARD", world_size=0)


def test_deepspeed_configs_as_dict_path_and_text_with_the_integrations_auto_values(tmp_path):
    # What HF's and Lightning's DeepSpeed integrations pass: sizes left "auto" for them to fill.
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "bf16": {"enabled": "auto"},
              "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto",
                                    "stage3_prefetch_bucket_size": "auto", "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "none"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    for given in (config, str(path), path, json.dumps(config)):
        plan = deepspeed_plan(given, world_size=4)
        assert plan.estimate_kwargs() == {"world_size": 4, "sharding": "zero3", "offload_optimizer": True,
                                          "offload_params": False, "deepspeed_config": config}
    assert deepspeed_plan({"zero_optimization": {"stage": 1}}, world_size=2).sharding == "zero1"
    assert deepspeed_plan({}, world_size=2).sharding == "ddp"
    with pytest.raises(ValueError, match="stage` should be 0, 1, 2 or 3, got 'auto'"):
        deepspeed_plan({"zero_optimization": {"stage": "auto"}}, world_size=2)
    with pytest.raises(ValueError, match="neither a file nor JSON"):
        deepspeed_plan("no-such-config.json", world_size=2)


@pytest.mark.slow
def test_a_prediction_under_a_plan_is_this_ranks_share_for_training_and_evaluation():
    model = make_gpt2(n_layer=2, n_embd=64)
    optimizer = torch.optim.AdamW(model.parameters())
    plan = fsdp_plan("FULL_SHARD", world_size=2, source="a test")
    options = Options(suggest=False)
    run = preflight.Run(target=preflight.Target(budget="1GiB"), fast=False)
    report = predict(model, optimizer, lm_batch(2, 16), run.replace(parallel=plan), options=options,
                     eval_batch=lm_batch(2, 16))
    alone = predict(model, optimizer, lm_batch(2, 16), run, options=options, eval_batch=lm_batch(2, 16))
    direct = preflight.estimate(model, optimizer, lm_batch(2, 16), run=preflight.Run(parallel=preflight.ParallelPlan(2, "fsdp-full")))
    assert report.predicted_peak_bytes == direct.peak_bytes < alone.predicted_peak_bytes
    assert any("per-rank plan read from a test: fsdp-full over 2 rank(s)" in n for n in report.coverage["notes"])
    # Evaluation: parameters and the resident optimizer state are this rank's share; the batch's activations are not.
    assert report.eval_predicted_peak_bytes < alone.eval_predicted_peak_bytes
    assert report.eval_estimate.breakdown["activations"] == alone.eval_estimate.breakdown["activations"]
    # `preflight check --world-size 2 --sharding fsdp-full` (its environment) plans the same way, the
    # evaluation included, and takes precedence over the trainer's plan.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PREFLIGHT_WORLD_SIZE", "2")
        env.setenv("PREFLIGHT_SHARDING", "fsdp-full")
        planned = predict(model, optimizer, lm_batch(2, 16),
                          run.replace(parallel=fsdp_plan("SHARD_GRAD_OP", world_size=4)), options=options,
                          eval_batch=lm_batch(2, 16))
    assert (planned.predicted_peak_bytes, planned.eval_predicted_peak_bytes) == \
        (report.predicted_peak_bytes, report.eval_predicted_peak_bytes)
    # Over budget under a plan: the suggestions are predicted per rank under it too.
    # Over by the headroom alone: single changes fit, so no combination is searched (tests/advice/test_combine.py).
    # Only the option asserted on is traced (tests/advice/test_options.py traces each under a plan).
    with pytest.MonkeyPatch.context() as patch:
        only_options(patch, "bf16 precision")
        tight = predict(model, optimizer, lm_batch(2, 16),
                        preflight.Run(target=preflight.Target(budget=report.predicted_peak_bytes), parallel=plan,
                                      fast=False),
                        options=Options(suggest=True))
    assert tight.fits is False and tight.suggestions
    bf16 = next(s for s in tight.suggestions if s["change"] == {"precision": "bf16-true"})
    assert bf16["predicted_peak_bytes"] == preflight.estimate(model, optimizer, lm_batch(2, 16), run=preflight.Run(precision="bf16-true", parallel=preflight.ParallelPlan(2, "fsdp-full"))).peak_bytes
    # Plain data parallelism is not a sharded plan: the prediction is the replica's.
    ddp = predict(model, optimizer, lm_batch(2, 16), run.replace(parallel=ParallelPlan(2, "ddp")), options=options)
    assert ddp.predicted_peak_bytes == alone.predicted_peak_bytes


def test_lightning_strategies_are_read_into_plans():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
    from types import SimpleNamespace

    from preflight.integrations.lightning import _parallel_plan

    def trainer(strategy, world_size=8, num_devices=4):
        return SimpleNamespace(strategy=strategy, world_size=world_size, num_devices=num_devices, num_nodes=2)

    plan = _parallel_plan(trainer(FSDPStrategy(sharding_strategy="SHARD_GRAD_OP", cpu_offload=True)))
    # SHARD_GRAD_OP keeps whole parameters on the GPU: predicted without the offload, and the note says so. No
    # auto_wrap_policy: FSDP1 wraps the root alone; Lightning's use_orig_params default is True.
    assert plan.estimate_kwargs() == {"world_size": 8, "sharding": "fsdp-grad-op", "offload_optimizer": False,
                                      "offload_params": False, "fsdp": FSDP1Plan(units=(), use_orig_params=True)}
    assert "with CPU offload, predicted without it (an upper bound)" in plan.note()
    kwargs = plan.estimate_kwargs()
    fsdp_trace_plan(kwargs.pop("fsdp"), plan.sharding)  # a plan estimate accepts
    check_plan(**kwargs)
    assert "Lightning FSDPStrategy(SHARD_GRAD_OP)" in plan.note()
    hybrid = FSDPStrategy(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={torch.nn.Linear},
                          use_orig_params=False)
    assert _parallel_plan(trainer(hybrid)).world_size == 8  # every rank, each sharded over the ranks of its node
    assert _parallel_plan(trainer(hybrid)).fsdp == FSDP1Plan(unit_types=(torch.nn.Linear,), use_orig_params=False,
                                                             ranks_per_node=4)
    assert _parallel_plan(trainer(FSDPStrategy())).sharding == "fsdp-full"  # FSDP's default
    model_parallel = _parallel_plan(trainer(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=4)))
    assert _parallel_plan(trainer(ModelParallelStrategy(), world_size=8)).world_size == 2  # "auto": num_nodes
    assert (model_parallel.sharding, model_parallel.world_size) == ("fsdp2", 2)
    assert _parallel_plan(trainer(DDPStrategy())) is None
    # DeepSpeed is not installed here: its strategy is recognised by name and read from its config.
    DeepSpeedStrategy = type("DeepSpeedStrategy", (), {"config": {"zero_optimization": {"stage": 3}}})
    assert _parallel_plan(trainer(DeepSpeedStrategy())).sharding == "zero3"


def test_the_hf_trainer_plan_is_what_accelerate_applied(tmp_path):
    # The Trainer hands fsdp / deepspeed to accelerate; what accelerate applied is read from its shared state. A
    # Trainer without either (here: one CPU process) has no sharded plan.
    from transformers import Trainer, TrainingArguments

    from preflight.integrations.hf import _parallel_plan

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = Trainer(model=make_gpt2(n_layer=1), args=args)
    assert _parallel_plan(trainer) is None and _parallel_plan(None) is None


def test_accelerate_plugins_are_read_into_plans_when_applied():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    from preflight.parallel import accelerate_plan

    def state(kind, **plugins):
        return SimpleNamespace(num_processes=4, distributed_type=kind, **{"fsdp_plugin": None, "deepspeed_plugin": None,
                                                                          **plugins})

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True, cpu_offload=CPUOffloadPolicy())
    plan = accelerate_plan(state(DistributedType.FSDP, fsdp_plugin=plugin))
    assert (plan.sharding, plan.world_size, plan.offload_params) == ("fsdp2", 4, True)
    # FSDP2's default is OffloadPolicy() (nothing offloaded), not None.
    plan = accelerate_plan(state(DistributedType.FSDP, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)))
    assert (plan.sharding, plan.offload_optimizer, plan.offload_params) == ("fsdp2", False, False)
    # A plugin accelerate did not apply (FSDP asked for on CPU processes runs DDP: MULTI_CPU) is not read.
    assert accelerate_plan(state(DistributedType.MULTI_CPU, fsdp_plugin=plugin)) is None
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy="SHARD_GRAD_OP")
    plan = accelerate_plan(state(DistributedType.FSDP, fsdp_plugin=plugin))
    assert plan.sharding == "fsdp-grad-op"
    assert plan.fsdp == FSDP1Plan(units=(), use_orig_params=False)  # accelerate's defaults: NO_WRAP, False
    # FSDP2 that keeps parameters gathered after forward is still FSDP2, traced with that option.
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False)
    plan = accelerate_plan(state(DistributedType.FSDP, fsdp_plugin=plugin))
    assert (plan.sharding, plan.fsdp) == ("fsdp2", FSDP2Plan(reshard_after_forward=False))
    # HSDP: accelerate's ParallelismConfig with 2 replicas of 2-rank shard groups.
    from accelerate.parallelism_config import ParallelismConfig

    hsdp = state(DistributedType.FSDP, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    hsdp.parallelism_config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    plan = accelerate_plan(hsdp)
    # accelerate passes its reshard_after_forward (True by default) to fully_shard explicitly
    assert (plan.sharding, plan.world_size, plan.fsdp) == ("fsdp2", 4, FSDP2Plan(reshard_after_forward=True,
                                                                                 replicate=2))
    ds = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})
    plan = accelerate_plan(state(DistributedType.DEEPSPEED, deepspeed_plugin=ds))
    assert (plan.sharding, plan.offload_optimizer) == ("zero1", True)
    assert accelerate_plan(state(DistributedType.NO)) is None


def test_a_model_the_strategy_already_sharded_gets_no_verdict_not_a_second_division():
    from torch.distributed.fsdp import fully_shard

    from preflight.parallel import already_sharded, fake_world

    model = make_gpt2(n_layer=2, n_embd=64)
    optimizer = torch.optim.AdamW(model.parameters())
    assert already_sharded(model) is None
    with fake_world(2, 0) as mesh:
        sharded = make_gpt2(n_layer=2, n_embd=64)
        fully_shard(sharded, mesh=mesh)
        assert "is a DTensor (FSDP2)" in already_sharded(sharded)
    # DeepSpeed ZeRO-3 marks its partitioned parameters with ds_numel (their full size).
    next(model.parameters()).ds_numel = 123
    assert "partitioned by DeepSpeed ZeRO-3" in already_sharded(model)
    report = predict(model, optimizer, lm_batch(2, 16),
                     preflight.Run(target=preflight.Target(budget="100KiB"), parallel=fsdp_plan("FULL_SHARD",
                                                                                                world_size=4)),
                     options=Options(suggest=False))
    del next(model.parameters()).ds_numel
    assert report.fits is None and report.coverage["lower_bound"] is True
    assert any(w.startswith("no verdict: the strategy sharded the model before preflight saw it") for w in
               report.warnings)
