"""Planning for a CUDA target and for sharded ranks from a CPU-only machine."""

from __future__ import annotations

import pytest
import torch
from conftest import lm_batch, make_gpt2, make_llama

import preflight
from preflight import allocator


@pytest.fixture(scope="module")
def gpt2_cpu_and_cuda():
    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    cpu = preflight.estimate(model, opt, lm_batch())
    cuda = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(target=preflight.Target(gpu="H100-80GB")))
    return model, cpu, cuda


def test_cuda_target_rounds_every_storage_to_512_bytes(gpt2_cpu_and_cuda):
    _, cpu, cuda = gpt2_cpu_and_cuda
    assert cuda.device == "cuda" and cuda.gpu == "H100-80GB"
    assert all(e.nbytes % 512 == 0 for e in cuda.events)
    # Not comparable with the CPU peak byte for byte: the CUDA target keeps bool dropout masks and the fused
    # attention kernel's tensors (tests/cuda/), the CPU trace fp32 masks and the CPU kernel's.
    assert cuda.peak_bytes % 512 == 0 and cpu.peak_bytes % 512 != 0
    assert sum(cuda.breakdown.values()) == cuda.peak_bytes


def test_cuda_target_simulates_reserved_and_device_total(gpt2_cpu_and_cuda):
    _, _, cuda = gpt2_cpu_and_cuda
    sim = allocator.simulate(cuda.events)
    assert cuda.peak_reserved_bytes == sim.peak_reserved_bytes >= cuda.peak_bytes
    gpu = preflight.get_gpu("H100-80GB")
    assert cuda.device_total_bytes == cuda.peak_reserved_bytes + gpu.context_bytes  # workspaces are allocated
    assert cuda.required_bytes == cuda.device_total_bytes


def test_cuda_target_traces_the_foreach_optimizer():
    # torch picks foreach for CUDA tensors: its step allocates per-group temporaries the for-loop does not.
    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    cuda = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(loop=preflight.Loop(steps=1), target=preflight.Target(device="cuda")))
    ops = {e.phase for e in cuda.events}
    assert "step1/optimizer" in ops
    assert cuda.device_total_bytes is None  # no GPU named: no context or workspace figure
    explicit = preflight.estimate(model, torch.optim.AdamW(model.parameters(), foreach=False), lm_batch(),
                                  run=preflight.Run(loop=preflight.Loop(steps=1), target=preflight.Target(device="cuda")))
    opt_bytes = lambda est: max(  # noqa: E731 - peak live bytes during the optimizer phase
        p.live_bytes for p in est.timeline if p.phase == "step1/optimizer")
    assert opt_bytes(cuda) > opt_bytes(explicit)


def test_a_cuda_target_traces_a_capturable_or_differentiable_optimizer_as_its_gpu_step_runs():
    """capturable=True (CUDA graphs) asserts its tensors are on a GPU, which the trace's are not: traced as
    capturable=False with a note of the step counters left out, not refused as the user's error. A differentiable
    optimizer is not given torch's foreach default, which refuses autograd (torch picks the for-loop there)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 4))
    batch = (torch.randn(16, 64), torch.randint(0, 4, (16,)))
    step = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    cuda = preflight.Run(target=preflight.Target(gpu="H100-80GB"))
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters(), capturable=True), batch, cuda, step=step)
    plain = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, cuda, step=step)
    assert not est.coverage.lower_bound and est.peak_bytes == plain.peak_bytes
    assert ("capturable=True (CUDA graphs) was traced as capturable=False for 4 parameter(s): its step counters on "
            "the GPU (one 0-dim tensor per parameter, 512 B each after the allocator's rounding: 2,048 B)") in \
        " ".join(est.coverage.notes)
    # On a CPU target the real step refuses capturable=True as the trace does: the user's to fix.
    with pytest.raises(AssertionError, match="capturable=True"):
        preflight.estimate(model, torch.optim.AdamW(model.parameters(), capturable=True), batch, step=step)
    # differentiable=True: torch's for-loop on the GPU as on the CPU, so the same trace (the step itself raises
    # outside a graph that allows it, on either device: a labelled lower bound here, the same on both targets).
    on_gpu = preflight.estimate(model, torch.optim.AdamW(model.parameters(), differentiable=True), batch, cuda,
                                step=step)
    on_cpu = preflight.estimate(model, torch.optim.AdamW(model.parameters(), differentiable=True), batch, step=step)
    assert on_gpu.coverage.failed_op == on_cpu.coverage.failed_op and "_single_tensor_adam" in on_gpu.coverage.failed_op


def test_expandable_segments_setting_changes_reserved_not_allocated():
    model = make_llama()
    opt = torch.optim.AdamW(model.parameters())
    default = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(target=preflight.Target(gpu="A100-80GB")))
    expandable = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(target=preflight.Target(gpu="A100-80GB", allocator="expandable_segments:True")))
    assert expandable.peak_bytes == default.peak_bytes
    assert expandable.peak_reserved_bytes == allocator.simulate(
        expandable.events, allocator.AllocatorConfig(expandable_segments=True)).peak_reserved_bytes


@pytest.mark.parametrize("sharding", ["ddp", "zero1", "zero2", "zero3",
                                      pytest.param("fsdp-full", marks=pytest.mark.slow),
                                      pytest.param("fsdp-grad-op", marks=pytest.mark.slow)])
def test_sharding_gives_each_rank_its_share(gpt2_cpu_and_cuda, sharding):
    # DDP and ZeRO rescale every allocation of the single-device trace; FSDP1's strategies trace each rank.
    model, _, single = gpt2_cpu_and_cuda
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), lm_batch(), run=preflight.Run(target=preflight.Target(gpu="H100-80GB"), parallel=preflight.ParallelPlan(4, sharding)))
    assert est.world_size == 4 and est.sharding == sharding
    if sharding.startswith("fsdp"):
        assert est.per_rank_peak_bytes is not None and est.peak_bytes == max(est.per_rank_peak_bytes)
    else:
        assert est.unsharded_peak_bytes == single.peak_bytes
    assert est.peak_bytes == sum(est.breakdown.values())
    assert est.peak_reserved_bytes == allocator.simulate(est.events).peak_reserved_bytes
    param_bytes = sum(-(-p.numel() * 4 // 512) * 512 for p in model.parameters())  # fp32, 512-byte blocks
    state_bytes = single.breakdown["optimizer_state"]  # AdamW's state is alive at the single-device peak
    b = est.breakdown
    if sharding == "ddp":
        assert b["gradients"] >= param_bytes  # DDP's bucket copy of every gradient, alive from construction
        assert est.peak_bytes > single.peak_bytes
    else:
        # A quarter of each state tensor (rounded up per tensor), and for ZeRO DeepSpeed's fp32 copy of the rank's
        # quarter of the parameters, kept with the optimizer state even in fp32 training (stage_1_and_2.py's
        # weights_partition, stage3.py's _create_fp32_partitions).
        master = 4 * sum(-(-p.numel() // 4) for p in model.parameters()) if sharding.startswith("zero") else 0
        assert b["optimizer_state"] - master < state_bytes / 3
        # ZeRO's gradient reduction buffers at DeepSpeed's default size (2 GB of fp32) outweigh this tiny model.
        buffers = 500_000_000 * 4 if sharding.startswith("zero") else 0
        assert b["communication"] >= buffers and est.peak_bytes - buffers < single.peak_bytes
    if sharding in ("zero3", "fsdp-full", "fsdp-grad-op"):
        assert b["parameters"] < param_bytes / 3  # SHARD_GRAD_OP: the shards; what it keeps gathered is communication
        if sharding == "fsdp-grad-op":
            assert b["communication"] > 0
    else:
        assert b["parameters"] == param_bytes


def test_offloading_the_optimizer_removes_its_step_from_the_gpu():
    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    on_gpu = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(target=preflight.Target(gpu="A100-80GB"), parallel=preflight.ParallelPlan(2, "zero2")))
    offloaded = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(target=preflight.Target(gpu="A100-80GB"), parallel=preflight.ParallelPlan(2, "zero2", offload_optimizer=True)))
    for est in (on_gpu, offloaded):
        assert est.peak_bytes == sum(est.breakdown.values())
    optimizer_phase = [e for e in offloaded.events if e.phase.endswith("/optimizer") and e.nbytes > 0]
    assert optimizer_phase == []  # state and the step's temporaries are on the CPU
    assert offloaded.breakdown["optimizer_state"] == 0 < on_gpu.breakdown["optimizer_state"]


def test_target_argument_errors():
    model = make_gpt2(n_layer=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Known GPUs|known"):
        preflight.estimate(model, opt, lm_batch(), run=preflight.Run(target=preflight.Target(gpu="H1000")))
    with pytest.raises(ValueError, match="sharding"):
        preflight.estimate(model, opt, lm_batch(), run=preflight.Run(parallel=preflight.ParallelPlan(2, "zero4")))
    with pytest.raises(ValueError, match="world_size"):
        preflight.estimate(model, opt, lm_batch(), run=preflight.Run(parallel=preflight.ParallelPlan(0, None)))
    with pytest.raises(ValueError, match="gpu="):
        preflight.estimate(model, opt, lm_batch(), run=preflight.Run(target=preflight.Target(device="cpu", gpu="H100-80GB")))
    with pytest.raises(ValueError, match="max_split|expandable|known"):
        preflight.estimate(model, opt, lm_batch(), run=preflight.Run(target=preflight.Target(device="cuda", allocator="bogus_option:3")))


@pytest.mark.requires_cuda
@pytest.mark.xfail(reason="on the H200 (2026-11-30) the on-device trace read 1,032,192 B (1.06%) under "
                          "max_memory_allocated for this 2-layer GPT-2, not located yet (docs/limitations.md)",
                   strict=False)
def test_prediction_matches_the_cuda_allocator():  # pragma: no cover - needs a GPU
    model = make_gpt2().cuda()
    opt = torch.optim.AdamW(model.parameters())
    batch = {k: v.cuda() for k, v in lm_batch().items()}
    est = preflight.estimate(model, opt, batch)
    measured = preflight.measure(model, opt, batch)
    # max_memory_allocated counts the allocator's blocks: peak_allocated_bytes (on an H200 the storage peak alone
    # read under by more than 1% here; benchmarks/results/gpu_validation_h200.md has the same effect per model)
    assert abs(est.peak_allocated_bytes - measured.peak_bytes) / measured.peak_bytes < 0.01
    assert abs(est.peak_reserved_bytes - measured.peak_reserved_bytes) / measured.peak_reserved_bytes < 0.05


def test_paged_optimizer_state_is_managed_memory_on_a_cuda_target():
    bnb = pytest.importorskip("bitsandbytes")
    model = make_gpt2()
    paged = preflight.estimate(model, bnb.optim.PagedAdamW8bit(model.parameters()), lm_batch(), run=preflight.Run(target=preflight.Target(gpu="A100-80GB")))
    plain = preflight.estimate(model, bnb.optim.AdamW8bit(model.parameters()), lm_batch(), run=preflight.Run(target=preflight.Target(gpu="A100-80GB")))
    # bitsandbytes pages state1 and state2 of a parameter of 1e5 elements or more (get_state_buffer): the embedding's
    # two uint8 states are in CUDA managed memory, outside the caching allocator and the peak
    big = [p.numel() for p in model.parameters() if p.numel() >= 100_000]
    assert big and paged.managed_bytes == 2 * sum(big)
    # the other parameters' states and every block maximum stay in the allocator
    assert paged.breakdown["optimizer_state"] == plain.breakdown["optimizer_state"] - paged.managed_bytes > 0
    assert plain.peak_bytes - paged.peak_bytes == paged.managed_bytes
    assert any("state1 and state2 of the parameters of 100,000 elements or more" in n for n in paged.coverage.notes)


def test_paged_state_is_told_apart_in_a_composed_trace_as_in_a_full_one():
    # 12 blocks: the depth-independent trace composes them from 4 to 6, and carries which storages are paged.
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(400, 256), torch.nn.Linear(256, 400))
                                  for _ in range(12)])
    batch = torch.randn(8, 400)
    figures = []
    for fast in (True, False):
        run = preflight.Run(target=preflight.Target(gpu="A100-80GB"), fast=fast)
        est = preflight.estimate(model, bnb.optim.PagedAdamW8bit(model.parameters()), batch, run=run,
                                 step=lambda m, b: m(b).square().mean())
        assert any("composed" in n for n in est.coverage.notes) == fast
        figures.append((est.managed_bytes, est.peak_bytes, est.breakdown["optimizer_state"]))
    assert figures[0] == figures[1]
    assert figures[0][0] == 2 * 24 * 400 * 256  # both weights of every block, two uint8 states each


class ResizesInPlace(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.lin(x)
        out = torch.empty(0)
        with torch.no_grad():
            torch.mul(h, 2, out=out)  # `out` grows in place: a new block for the allocator
        return h.sum() + out.sum()


def test_storages_resized_in_place_replay_through_the_allocator():
    model = ResizesInPlace()
    est = preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 64),
                             run=preflight.Run(target=preflight.Target(gpu="A100-80GB")))
    assert est.coverage.traced and est.peak_reserved_bytes >= est.peak_bytes > 0
    uids = [e.uid for e in est.events if e.nbytes > 0]
    assert len(uids) == len(set(uids))  # one allocation per uid, as the simulator requires


def test_offload_and_zero3_from_arguments():
    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    plain = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(target=preflight.Target(gpu="A100-80GB"), parallel=preflight.ParallelPlan(4, "zero3")))
    offloaded = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(target=preflight.Target(gpu="A100-80GB"), parallel=preflight.ParallelPlan(4, "zero3", offload_optimizer=True, offload_params=True)))
    assert offloaded.breakdown["optimizer_state"] == 0 and offloaded.breakdown["parameters"] == 0
    assert plain.breakdown["optimizer_state"] > 0 and offloaded.peak_bytes < plain.peak_bytes
    with pytest.raises(ValueError, match="offload"):
        preflight.estimate(model, opt, lm_batch(), run=preflight.Run(parallel=preflight.ParallelPlan(4, "ddp", offload_params=True)))


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero1", "zero2", "zero3"])
def test_a_zero_figure_counts_deepspeeds_gradient_reduction_buffers(sharding):
    # DeepSpeed 0.19.8 allocates `reduce_bucket_size` elements per gradient dtype for its gradient reduction
    # (twice with overlap_comm at stages 1 and 2); measured on 2 CPU processes: benchmarks/deepspeed_cpu.py.
    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    default = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(parallel=preflight.ParallelPlan(2, sharding)))
    stage = int(sharding[-1])
    # Stage 3's gathered parameters are communication too (its own terms, tests/test_sharding.py); the buffers
    # are what changes with the config below.
    gathered = default.breakdown["communication"] - 500_000_000 * 4  # DeepSpeed's default size, fp32 gradients
    assert gathered == 0 if stage < 3 else gathered > 0
    assert any("DeepSpeed's default" in n for n in default.coverage.notes)
    off = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(parallel=preflight.deepspeed_plan({"zero_optimization": {"stage": stage, "contiguous_gradients": False}}, world_size=2)))
    assert off.breakdown["communication"] == gathered
    config = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 5e7, "overlap_comm": True},
              "bf16": {"enabled": True}}
    given = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(parallel=preflight.deepspeed_plan(config, world_size=2)))
    copies = 1 if stage == 3 else 2  # stage 3 keeps one buffer per dtype whatever overlap_comm says
    assert given.sharding == sharding
    if stage < 3:
        assert given.breakdown["communication"] == 50_000_000 * copies * 2
        # Only the buffers change with their settings (the bf16 model is traced as DeepSpeed casts it either way).
        bf16 = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(parallel=preflight.deepspeed_plan({
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}, world_size=2)))
        assert given.peak_bytes - given.breakdown["communication"] == \
            bf16.peak_bytes - bf16.breakdown["communication"] < default.peak_bytes - 2_000_000_000
    else:  # bf16: the gathered parameters are 16-bit, half the fp32 figure
        assert given.breakdown["communication"] - 50_000_000 * copies * 2 == gathered // 2
    ddp = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(parallel=preflight.ParallelPlan(2, "ddp")))
    assert ddp.breakdown["communication"] == 0


def test_stage_1_and_2_buffers_live_during_backward_and_stage_3s_from_the_start():
    from preflight._result import Category, Event
    from preflight._sharding import ZeroBuffers
    from preflight._target import shard_events

    model = make_gpt2()
    events = [Event(1, 100, 0, "step1/forward"), Event(3, 8, 1, "step1/backward"), Event(2, 10, 2, "step1/backward"),
              Event(2, -10, 3, "step1/backward"), Event(3, -8, 4, "step1/backward"), Event(1, -100, 5, "step1/optimizer")]
    for during in (True, False):
        out, categories, note = shard_events(events, {2: Category.GRADIENTS}, model, world_size=2, sharding="zero2",
                                             dtype=None, zero_buffers=ZeroBuffers(1000, during, "test"))
        buffers = [i for i, e in enumerate(out) if categories.get(e.uid) is Category.COMMUNICATION]
        if during:
            # Made in the backward's first gradient's hook (not at the backward's first event), released when the
            # backward ends, before the optimizer step's first event.
            first_gradient = next(i for i, e in enumerate(out) if e.uid == 2)
            assert buffers[0] == first_gradient - 1 and out[buffers[0]].nbytes == 1000
            assert out[buffers[1]].nbytes == -1000 and out[buffers[1] + 1].phase == "step1/optimizer"
        else:  # stage 3: from the start
            assert len(buffers) == 1 and out[buffers[0]].phase == "setup" and out[buffers[0]].nbytes == 1000


def test_a_deepspeed_config_that_contradicts_the_arguments_is_refused():
    # Where a DeepSpeed config meets other settings of the plan (`preflight estimate --deepspeed-config` beside
    # --sharding or offload flags), a contradiction is refused, naming both.
    from preflight._sharding import read_deepspeed_config
    from preflight.parallel._deepspeed import deepspeed_settings

    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    no_offload = {"offload_optimizer": False, "offload_params": False}
    with pytest.raises(ValueError, match="stage 2 is 'zero2'"):
        deepspeed_settings(read_deepspeed_config({"zero_optimization": {"stage": 2}}), "zero3", no_offload)
    with pytest.raises(ValueError, match="offload_params=True"):
        deepspeed_settings(read_deepspeed_config({"zero_optimization": {"stage": 3}}), None,
                           {**no_offload, "offload_params": True})
    auto = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    est = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(parallel=preflight.deepspeed_plan(auto, world_size=2)))
    # Filled as the HF Trainer fills "auto": hidden_size**2 elements, alive during each backward (the peak of this
    # tiny model is elsewhere, so it is in the events, not the breakdown).
    elements = model.config.hidden_size ** 2
    assert any(f"reduce_bucket_size {elements:,} elements" in n for n in est.coverage.notes)
    assert elements * 4 in [e.nbytes for e in est.events if e.phase.endswith("/backward")]

def test_a_measured_cuda_context_replaces_the_catalogs_in_the_device_total():
    # The 2022 V100 series measured 1,343 MB of context against the catalog's 400 MiB: given, it is what is added.
    from conftest import lm_batch, make_gpt2

    import preflight

    model = make_gpt2()
    optimizer = torch.optim.AdamW(model.parameters())
    catalog = preflight.estimate(model, optimizer, lm_batch(2, 32), preflight.Run(target=preflight.Target(gpu="V100-32GB")))
    run = preflight.Run(target=preflight.Target(gpu="V100-32GB", cuda_context="1343MB"))
    given = preflight.estimate(model, optimizer, lm_batch(2, 32), run)
    assert given.peak_bytes == catalog.peak_bytes and given.peak_reserved_bytes == catalog.peak_reserved_bytes
    assert given.device_total_bytes - catalog.device_total_bytes == 1343 * 10**6 - 400 * 2**20
    assert "device total adds the CUDA context (1,343,000,000 B, as given)" in given.coverage.notes
    assert any("--cuda-context gives the one you measured" in n for n in catalog.coverage.notes)
    evaluation = preflight.estimate_eval(model, lm_batch(2, 32), run)
    assert evaluation.device_total_bytes - evaluation.peak_reserved_bytes == 1343 * 10**6
    assert run.cli_flags()[-2:] == ["--cuda-context", "1343MB"]
    with pytest.raises(ValueError, match="cuda_context"):
        preflight.Target(gpu="V100-32GB", cuda_context="1343")  # no unit: bytes or megabytes?


def test_a_cuda_target_predicts_max_memory_allocated_with_the_allocators_block_rounding(capsys):
    # The caching allocator counts the blocks it hands out: each request rounded to 512 B, and a large cached block
    # it does not split keeps its remainder (up to 1 MiB). On an H200 (benchmarks/gpu_validation.py) the measured
    # max_memory_allocated sat 0.3% to 2.3% above peak_bytes; this is that figure, from the same simulation as the
    # reserved one.
    from preflight.allocator import simulate

    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    est = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(target=preflight.Target(gpu="H200")))
    assert est.peak_allocated_bytes == simulate(est.events).peak_allocated_bytes
    assert est.peak_allocated_bytes >= est.peak_bytes  # equal here: every block this small model asks for is split
    assert est.to_dict()["peak_allocated_bytes"] == est.peak_allocated_bytes
    assert "max_memory_allocated (the allocator's blocks)" in str(est)
    assert preflight.estimate(model, opt, lm_batch()).peak_allocated_bytes is None  # a CPU target: no allocator
    report = preflight.check(model, opt, lm_batch(), run=preflight.Run(target=preflight.Target(gpu="H200")))
    assert report.predicted_allocated_bytes == est.peak_allocated_bytes
    assert report.to_dict()["predicted_allocated_bytes"] == est.peak_allocated_bytes
    assert "max allocated" in capsys.readouterr().out


def test_each_steps_max_memory_allocated_on_a_cuda_target_from_the_allocator_simulation():
    # The callbacks reset the peak stats at each measured step's start and read max_memory_allocated at its end;
    # on a CUDA target their per-step predictions are the simulated allocator's blocks over the same spans.
    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    est = preflight.estimate(model, opt, lm_batch(), run=preflight.Run(target=preflight.Target(gpu="A100-80GB")))
    allocated, live = est.step_allocated_peaks(), est.step_peaks()
    assert set(allocated) == set(live) == {1, 2}
    assert all(allocated[k] >= live[k] for k in live)
    assert max(allocated.values()) == est.peak_allocated_bytes
    assert preflight.estimate(model, opt, lm_batch()).step_allocated_peaks() is None  # a CPU target
