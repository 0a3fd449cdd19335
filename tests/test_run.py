"""`preflight.Run`: one description of how a run trains, checked at construction, laid over another (`over`), and
said back as plain values and CLI flags."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from preflight import Loop, ParallelPlan, Run, Target, fsdp_plan
from preflight._run import check_run, pinned, run_budget


def test_defaults_are_one_device_as_the_tensors_are_and_the_composed_trace():
    run = Run()
    assert (run.precision, run.parallel, run.routing, run.fast, run.world_size) == (None, None, "balanced", True, 1)
    assert run.loop == Loop(accumulate=1, zero_grad="after_step", max_grad_norm=None, grad_scaler=False, steps=2)
    assert check_run(None) == run


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: Run(precision="fp8"), ValueError, r"`precision` should be one of"),
    (lambda: Run(loop={"accumulate": 2}), TypeError, r"`Run.loop` should be a preflight.Loop"),
    (lambda: Run(target="H100-80GB"), TypeError, r"`Run.target` should be a preflight.Target"),
    (lambda: Run(parallel={"world_size": 4}), TypeError, r"`Run.parallel` should be None or a preflight.ParallelPlan"),
    (lambda: Run(routing="uniform"), ValueError, r"`Run.routing` should be one of \('balanced', 'skewed'\)"),
    (lambda: Run(fast="yes"), TypeError, r"`Run.fast` should be True or False"),
    (lambda: Loop(accumulate=0), ValueError, r"`accumulate` should be a positive integer"),
    (lambda: Loop(steps=0), ValueError, r"`steps` should be at least 1"),
    (lambda: Loop(zero_grad="sometimes"), ValueError, r"`zero_grad` should be one of"),
    (lambda: Target(gpu="Z9000"), ValueError, r"Z9000"),
    (lambda: Target(device="cpu", gpu="H100-80GB"), ValueError, r"plans for a CUDA device, but `device` is 'cpu'"),
    (lambda: Target(budget="lots"), ValueError, r"Cannot read"),
    (lambda: Target(budget=0), ValueError, r"more than 0 bytes"),
    (lambda: Target(allocator=3), TypeError, r"PYTORCH_CUDA_ALLOC_CONF"),
    (lambda: ParallelPlan(0, "ddp"), ValueError, r"`world_size` should be a positive integer, got 0"),
    (lambda: ParallelPlan(2, "zero4"), ValueError, r"`ParallelPlan.sharding` should be one of"),
    (lambda: ParallelPlan(2, "zero2", gradient_as_bucket_view=True), ValueError, r"DDP's option"),
    (lambda: check_run({"precision": "bf16-mixed"}), TypeError, r"`run` should be a preflight.Run"),
])
def test_every_section_is_checked_at_construction(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_aliases_are_normalised():
    assert Run(precision="bf16").precision == "bf16-mixed" and Run(precision="fp16").precision == "16-mixed"


def test_over_lays_the_fields_someone_set_over_a_base():
    trainer = Run(precision="16-mixed", loop=Loop(accumulate=4, zero_grad="before_backward", grad_scaler=True),
                  parallel=fsdp_plan("FULL_SHARD", world_size=8))
    user = Run(target=Target(gpu="H100-80GB"), loop=Loop(max_grad_norm=1.0), fast=False)
    run = user.over(trainer)
    assert run.precision == "16-mixed" and run.parallel == trainer.parallel  # not set by the user: the trainer's
    assert run.target == Target(gpu="H100-80GB") and run.fast is False  # set by the user: theirs
    # Sections merge field by field: the user's clipping, the trainer's accumulation, zero_grad and scaler.
    assert run.loop == Loop(accumulate=4, zero_grad="before_backward", max_grad_norm=1.0, grad_scaler=True)
    assert Run().over(trainer) == trainer and trainer.over(Run()) == trainer
    assert Run(precision="bf16-true").over(trainer).precision == "bf16-true"


def test_a_tensor_parallel_plan_says_its_degree_back():
    from preflight.parallel import TPPlan

    run = Run(parallel=ParallelPlan(8, "fsdp2", tp=TPPlan(2)))
    assert run.to_dict()["parallel"]["tp_degree"] == 2
    assert run.cli_flags() == ["--world-size", "8", "--sharding", "fsdp2", "--tp", "2"]


def test_to_dict_and_cli_flags_say_the_description_back():
    run = Run(precision="bf16-mixed", loop=Loop(accumulate=2),
              target=Target(gpu="A100-80GB", budget="70GiB", allocator="expandable_segments:True"),
              parallel=ParallelPlan(4, "zero3", offload_optimizer=True, source="a test"), fast=False)
    plain = run.to_dict()
    assert plain["parallel"] == {"world_size": 4, "sharding": "zero3", "offload_optimizer": True,
                                 "offload_params": False, "gradient_as_bucket_view": False, "source": "a test",
                                 "tp_degree": None, "pp": None}
    assert plain["target"] == {"device": None, "gpu": "A100-80GB", "budget": "70GiB",
                               "allocator": "expandable_segments:True", "cuda_context": None,
                               "nccl_buffers": None}
    assert plain["loop"]["accumulate"] == 2 and plain["fast"] is False
    assert run.cli_flags() == ["--precision", "bf16-mixed", "--gpu", "A100-80GB", "--budget", "70GiB", "--allocator",
                               "expandable_segments:True", "--accumulate", "2", "--world-size", "4", "--sharding",
                               "zero3", "--offload-optimizer", "--full"]
    assert Run().cli_flags() == []


def test_the_cli_flags_parse_back_to_the_same_description(tmp_path):
    from preflight import _cli

    run = Run(precision="bf16-mixed", loop=Loop(accumulate=2), target=Target(gpu="A100-80GB", budget="70GiB"),
              parallel=ParallelPlan(4, "zero3", offload_optimizer=True))
    args = _cli._parser().parse_args(["estimate", "--hf-config", "unused", "--batch", "1", *run.cli_flags()])
    back = _cli._run(args, *_cli._sharding(args))
    assert back.precision == run.precision and back.loop == run.loop and back.fast == run.fast
    assert (back.target.gpu, back.target.budget) == ("A100-80GB", "70GiB")
    assert dataclasses.replace(back.parallel, source="") == run.parallel


def test_budget_comes_from_the_target():
    model = torch.nn.Linear(4, 4)
    assert run_budget(Run(target=Target(budget="1GiB")), model) == 2**30
    assert run_budget(Run(target=Target(gpu="H100-80GB")), model) > 70 * 2**30
    assert run_budget(Run(), model, required=False) is None  # a CPU target has no budget unless given
    with pytest.raises(ValueError, match=r"Target\(budget='24GiB'\)"):
        run_budget(Run(), model)


def test_pinned_plans_a_copy_for_the_users_device_unless_the_target_names_one():
    assert pinned(Run(), torch.device("cpu")).target.device == torch.device("cpu")
    assert pinned(Run(target=Target(gpu="H100-80GB")), torch.device("cpu")).target.device is None


def test_changes_from_and_with_changes_are_inverse_and_compose():
    base = Run(precision="bf16-mixed", loop=Loop(zero_grad="before_backward"), target=Target(budget="24GiB"))
    bf16 = base.replace(precision="bf16-true")
    micro = base.replace(loop=Loop(accumulate=4, zero_grad="before_backward"))
    assert bf16.changes_from(base) == {"precision": "bf16-true"}
    assert micro.changes_from(base) == {"loop": {"accumulate": 4}}
    assert base.with_changes(micro.changes_from(base)) == micro
    both = bf16.with_changes(micro.changes_from(base))
    assert both == Run(precision="bf16-true", loop=Loop(accumulate=4, zero_grad="before_backward"),
                       target=Target(budget="24GiB"))
    assert base.changes_from(base) == {}


def test_pipelined_says_whether_the_plan_runs_a_pipeline_schedule():
    from preflight.parallel import PPPlan, causal_lm_loss

    assert not Run().pipelined and not Run(parallel=ParallelPlan(4, "ddp")).pipelined
    assert Run(parallel=ParallelPlan(2, None, pp=PPPlan(2, causal_lm_loss))).pipelined
