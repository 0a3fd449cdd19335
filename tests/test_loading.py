"""The loading phase (`preflight.Loading`): one device counted, each rank traced as its engine wraps the whole model,
against real loads measured on CPU (transformers' ``from_pretrained``; FSDP2 and FSDP1 on 2 gloo processes)."""

import math

import pytest
import torch

import preflight
from preflight import Loading, ParallelPlan, Run, Target
from preflight.parallel import FSDP1Plan, FSDP2Plan
from tests.conftest import gloo_rank, lm_batch, make_llama, only_options, spawned


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_the_loading_section_is_checked_and_said_by_every_door():
    with pytest.raises(ValueError, match="'device'.*'host'.*'meta'"):
        Loading("gpu")
    with pytest.raises(TypeError, match=r"Loading\('meta'\)"):
        Run(loading="meta")
    run = Run(loading=Loading("meta"))
    assert run.to_dict()["loading"] == {"placement": "meta", "from_rank0": False}
    assert run.cli_flags()[-2:] == ["--loading", "meta"]
    assert Run(loading=Loading("meta", from_rank0=True)).cli_flags()[-2:] == ["--loading", "meta-rank0"]
    assert Run(precision="bf16-mixed").over(run).loading == Loading("meta")  # the trainer's, kept under the user's
    assert Run(loading=Loading("host")).over(run).loading == Loading("host")


def test_one_device_loading_is_the_models_tensors_and_leaves_the_training_figure_as_it_was():
    model = make_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    plain = preflight.estimate(model, optimizer, lm_batch(2, 64))
    est = preflight.estimate(model, optimizer, lm_batch(2, 64), Run(loading=Loading()))
    loading = est.phase("loading")
    assert loading.peak_bytes == _model_bytes(model) and loading.where == "load"
    assert loading.breakdown["parameters"] + loading.breakdown["buffers"] == loading.peak_bytes
    assert (est.peak_bytes, est.peak_phase) == (plain.peak_bytes, plain.peak_phase)
    assert est.run_required_bytes == est.required_bytes  # one device: training holds the model and more
    assert plain.phase("loading") is None


def test_from_pretrained_on_cpu_peaks_at_the_predicted_loading(tmp_path):
    from transformers import AutoModelForCausalLM

    from preflight._measure import cpu_profiled_peak

    make_llama().save_pretrained(tmp_path)
    loaded = {}
    measured, _ = cpu_profiled_peak(lambda: loaded.update(model=AutoModelForCausalLM.from_pretrained(tmp_path)),
                                    resident={})
    model = loaded["model"]
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 64), Run(loading=Loading()))
    predicted = est.phase("loading").peak_bytes
    # On the CPU the safetensors file is read into one block that the parameters view (transformers 5.24): its
    # header rides along (2,216 B here), with a few hundred bytes of scalars while the model is built.
    [file] = tmp_path.glob("*.safetensors")
    header = file.stat().st_size - sum(p.numel() * p.element_size() for p in model.parameters())
    assert header <= measured - predicted <= header + 1024, (predicted, measured, header)


def _fsdp_load_worker(rank: int, world: int, port: int, queue, engine: str, placement: str) -> None:
    from benchmarks.loading import loaded_peak

    with gloo_rank(rank, world, port):
        queue.put((rank, loaded_peak(make_llama, engine, placement, rank)))


@pytest.mark.slow
@pytest.mark.parametrize("engine, placement", [("fsdp2", "device"), ("fsdp2", "meta"), ("fsdp2", "meta-rank0"),
                                              ("fsdp-full", "device"), ("fsdp-full", "meta"),
                                              ("fsdp-full", "meta-rank0")])
def test_real_gloo_fsdp_load_per_rank_equals_its_loading_phase(engine, placement):
    model = make_llama()
    loading = Loading("meta", from_rank0=True) if placement == "meta-rank0" else Loading(placement)
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 64),
                             Run(parallel=ParallelPlan(2, engine), loading=loading))
    predicted = est.phase("loading").per_rank_peak_bytes
    measured = spawned(_fsdp_load_worker, 2, engine, placement)
    for rank in range(2):
        # fully_shard without a mesh makes the job's default one: its few int64 tensors (8 to 24 B) are the job's.
        assert 0 <= measured[rank] - predicted[rank] <= 64, (engine, placement, predicted, measured)
    if placement == "device":  # the whole model on each rank, then its shards while the engine cuts it
        assert min(predicted) > _model_bytes(model)
    elif placement == "meta":  # FSDP2: its own shards only
        assert engine != "fsdp2" or max(predicted) < _model_bytes(model) / 2 + 1024
    elif engine == "fsdp2":  # on a CPU target rank 0's full state dict is device memory; the others hold one full
        assert predicted[0] > _model_bytes(model) > predicted[1]  # tensor at a time
    else:  # FSDP1's sync_module_states: rank 0's model is on the CPU target; the others materialise unit by unit
        assert predicted[0] >= predicted[1]


class _Buffered(torch.nn.Module):
    """A block whose buffer (1 MiB) outweighs its weight: FSDP1 broadcasts buffers with the parameters but flattens
    only the parameters, so the broadcast's bucket is a unit's loading peak."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(256, 256)
        self.register_buffer("table", torch.zeros(256, 1024))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.table[:, :256].sum()


def _buffered() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(_Buffered(), _Buffered(), torch.nn.Linear(256, 1))


def _buffered_load_worker(rank: int, world: int, port: int, queue) -> None:
    from benchmarks.loading import loaded_peak

    with gloo_rank(rank, world, port):
        queue.put((rank, loaded_peak(_buffered, "fsdp-full", "meta-rank0", rank, unit_types={_Buffered})))


def _buffered_loading(from_rank0: bool, target: Target | None = None) -> tuple[int, ...]:
    model = _buffered()
    plan = ParallelPlan(2, "fsdp-full", fsdp=FSDP1Plan(unit_types=(_Buffered,)))
    run = Run(parallel=plan, loading=Loading("meta", from_rank0=from_rank0), target=target or Target())
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(4, 256), run,
                             step=lambda m, b: m(b).sum())
    return est.phase("loading").per_rank_peak_bytes


def test_fsdp1_sync_module_states_broadcast_is_traced_where_it_is_the_loading_peak():
    # Rank 0 holds the model on its host and broadcasts each unit's states as FSDP1 wraps it (accelerate's
    # cpu_ram_efficient_loading); torch's _broadcast_coalesced flattens a unit's parameters and buffer into one
    # bucket (1,311,744 B here) while the unit is whole: above the unit's own flattening, which leaves out the buffer.
    without, synced = _buffered_loading(False), _buffered_loading(True)
    params, buffer = _model_bytes(_buffered()[0].proj), 256 * 1024 * 4
    # At the peak the bucket (the unit's parameters and buffer) stands where, without the broadcast, the unit's flat
    # parameter and its shard (half of it on 2 ranks) stand.
    assert synced[1] - without[1] == (params + buffer) - (params + params // 2), (without, synced)
    # On a CPU target rank 0's host is the device: its whole model is there from the start. On a GPU, rank 0 moves
    # each unit from its host as the others materialise theirs: the same figure.
    assert synced[0] > synced[1]
    assert _buffered_loading(True, Target(gpu="H100-80GB")) == (synced[1], synced[1])


@pytest.mark.slow
def test_real_gloo_fsdp1_sync_module_states_per_rank_equals_its_loading_phase():
    predicted = _buffered_loading(True)
    measured = spawned(_buffered_load_worker, 2)
    for rank in range(2):
        assert 0 <= measured[rank] - predicted[rank] <= 64, (predicted, measured)


def test_from_the_host_each_unit_is_counted_from_its_move():
    """FSDP2 moves a unit's parameters to the device inside ``fully_shard``: a rank holds the units already cut, the
    unit being cut whole, and its new shard. On a CPU copy the hook is what a CUDA target needs."""
    from preflight.parallel._fsdp2 import _engine
    from preflight.parallel._rank import trace_loading
    from preflight.trace import Sweep

    model = make_llama()

    def shard(t: torch.Tensor) -> int:  # dim 0 cut into 2, padded to equal parts
        return math.ceil(t.shape[0] / 2) * (t.numel() // t.shape[0]) * t.element_size()

    def full(ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    layers = [list(layer.parameters()) for layer in model.model.layers]
    root = [p for name, p in model.named_parameters() if ".layers." not in name]
    cut = sum(shard(p) for layer in layers for p in layer)  # every layer cut, before the root is
    expected = max([sum(shard(p) for layer in layers[:i] for p in layer) + full(layers[i]) +
                    sum(shard(p) for p in layers[i]) for i in range(len(layers))] +
                   [cut + full(root) + full(model.buffers()) + sum(shard(p) for p in root)])
    kept = cut + sum(shard(p) for p in root) + full(model.buffers())
    results = {placement: trace_loading(_engine(FSDP2Plan()), model, world_size=2, rank=0, placement=placement,
                                        precision=None, sweep=Sweep()) for placement in ("host", "device")}
    peaks = {}
    for placement, result in results.items():
        assert result.error is None
        live = peak = 0
        for event in result.events:
            live += event.nbytes
            peak = max(peak, live)
        peaks[placement] = peak
        assert live == kept  # the shards and buffers stay
    assert peaks["host"] == expected
    assert peaks["device"] > _model_bytes(model) > peaks["host"]


def test_on_a_cuda_target_from_the_host_holds_less_than_on_the_device_and_other_engines_say_upper_bound():
    model = make_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    figures = {}
    for placement in ("device", "host", "meta"):
        est = preflight.estimate(model, optimizer, lm_batch(2, 64), Run(
            parallel=ParallelPlan(4, "fsdp2"), loading=Loading(placement), target=Target(gpu="H100-80GB")))
        figures[placement] = est.phase("loading").peak_bytes
        assert est.phase("loading").how == ("counted" if placement == "meta" else "traced")
    assert figures["device"] > figures["host"] > figures["meta"]
    # On a CPU target the host is the device.
    cpu = {placement: preflight.estimate(model, optimizer, lm_batch(2, 64), Run(
        parallel=ParallelPlan(2, "fsdp2"), loading=Loading(placement))).phase("loading") for placement in
        ("device", "host")}
    assert cpu["host"].peak_bytes == cpu["device"].peak_bytes


def test_a_rescaled_plan_holds_the_whole_model_unless_built_on_meta():
    model = make_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    whole = _model_bytes(model)
    figures = {}
    for sharding in ("ddp", "zero3"):
        for placement in ("device", "meta"):
            est = preflight.estimate(model, optimizer, lm_batch(2, 64), Run(
                parallel=ParallelPlan(4, sharding), loading=Loading(placement)))
            figures[sharding, placement] = est.phase("loading").peak_bytes
    assert figures["ddp", "device"] == figures["ddp", "meta"] == whole  # every DDP rank holds the whole model
    assert figures["zero3", "device"] == whole
    assert figures["zero3", "meta"] < whole / 2  # zero.Init: each rank its partitions


def test_a_ddp_model_already_wrapped_has_loaded_and_no_loading_is_predicted():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = torch.get_num_threads()
    try:
        with gloo_rank(0, 1, port):
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64)))
            est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(8, 64),
                                     Run(loading=Loading()), step=lambda m, b: m(b).sum())
    finally:
        torch.set_num_threads(threads)
    assert est.phase("loading") is None
    assert any(n.startswith("loading: not predicted: the model is already wrapped") for n in est.coverage.notes)


def _deep_llama():
    """16 narrow layers: the whole model outweighs what one of 8 ranks holds for its step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=16,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                        max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def _fits_only_on_meta(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, Run]:
    """A budget between the training step's need and the loading's, for a whole-model load on 8 ranks."""
    run = Run(parallel=ParallelPlan(8, "fsdp2"), loading=Loading())
    est = preflight.estimate(model, optimizer, lm_batch(1, 8), run)
    assert est.phase("loading").peak_bytes > est.required_bytes
    return (est.required_bytes + est.phase("loading").peak_bytes) // 2, run


@pytest.mark.slow  # four traces of 8 ranks' steps
def test_advice_builds_the_model_on_meta_when_the_whole_model_on_each_rank_does_not_fit(monkeypatch):
    model = _deep_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    budget, run = _fits_only_on_meta(model, optimizer)
    only_options(monkeypatch, "model built on meta", "activation checkpointing")
    run = run.replace(target=Target(budget=budget))
    suggestions = preflight.advise(model, optimizer, lm_batch(1, 8), run, headroom=0.0)
    first = suggestions[0]
    assert first.changes == ("meta-init",) and first.fits and first.run.loading == Loading("meta")
    assert first.predicted_peak_bytes == preflight.estimate(model, optimizer, lm_batch(1, 8),
                                                            first.run).run_required_bytes
    assert "--loading meta" in " ".join(first.run.cli_flags())
    # Checkpointing lowers the training step, not the loading that is the run's peak: said, and not a fit.
    checkpointing = next(s for s in suggestions if s.changes == ("checkpointing",))
    assert not checkpointing.fits and "the run's peak is its loading phase" in checkpointing.description


@pytest.mark.slow  # three CLI processes tracing an 8-rank plan: about 100 s on 2 cores
def test_cli_stops_a_run_whose_loading_does_not_fit_and_names_the_fix(tmp_path):
    from tests.test_cli import run_cli

    _deep_llama().config.save_pretrained(tmp_path)
    args = ["estimate", "--hf-config", str(tmp_path), "--batch", "1", "--seq", "8", "--world-size", "8",
            "--sharding", "fsdp2", "--headroom", "0", "--no-suggest"]
    low = run_cli(*args, "--budget", "1GiB", "--loading", "device", "--json", str(tmp_path / "out.json"))
    assert low.returncode == 0, low.stderr[-2000:]
    import json

    out = json.loads((tmp_path / "out.json").read_text())
    loading = next(p for p in out["phases"] if p["name"] == "loading")
    training, load = out["peak_bytes"], loading["peak_bytes"]
    assert load > training and out["inputs"]["loading"] == "device"
    assert out["run"]["loading"] == {"placement": "device", "from_rank0": False}
    budget = f"{(training + load) // 2}B"
    stopped = run_cli(*args, "--budget", budget, "--loading", "device")
    assert stopped.returncode == 3, stopped.stdout[-2000:]
    assert "(loading peak)" in stopped.stdout and "--loading meta" in stopped.stdout
    fits = run_cli(*args, "--budget", budget, "--loading", "meta")
    assert fits.returncode == 0, fits.stdout[-2000:]
    assert "loading:" in fits.stdout and "verdict: FITS" in fits.stdout


def test_loading_notes_say_what_is_and_is_not_traced():
    model = make_llama()
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 64),
                             Run(parallel=ParallelPlan(2, "fsdp2"), loading=Loading("meta")))
    note = next(n for n in est.coverage.notes if n.startswith("loading (meta)"))
    assert "broadcast from rank 0" in note
    assert est.phase("loading").to_dict()["per_rank_peak_bytes"] == [est.phase("loading").peak_bytes] * 2


def test_a_loading_the_trace_cannot_follow_is_a_labelled_lower_bound_and_the_steps_stand(monkeypatch):
    import contextlib

    from preflight.parallel import _rank

    model = make_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    run = Run(parallel=ParallelPlan(2, "fsdp2"), loading=Loading())
    plain = preflight.estimate(model, optimizer, lm_batch(2, 64), run)

    @contextlib.contextmanager
    def cannot(tracker, *, count):
        raise NotImplementedError("a wrapping fake tensors cannot follow")
        yield

    monkeypatch.setattr(_rank, "moved_by_engine", cannot)
    est = preflight.estimate(model, optimizer, lm_batch(2, 64), run)
    assert est.per_rank_peak_bytes == plain.per_rank_peak_bytes  # the steps' figures stand
    loading = est.phase("loading")
    assert loading.how == "labelled lower bound"
    assert loading.peak_bytes < plain.phase("loading").peak_bytes  # the rank's resident shards alone
    assert any("could not wrap the loading copy" in n and "NotImplementedError" in n for n in est.coverage.notes)


def test_from_rank0_on_a_cuda_target_each_rank_holds_its_shards_and_one_full_tensor_at_a_time():
    model = make_llama()
    optimizer = torch.optim.AdamW(model.parameters())

    def loading(placement: Loading) -> tuple[int, ...]:
        return preflight.estimate(model, optimizer, lm_batch(2, 64), Run(
            parallel=ParallelPlan(2, "fsdp2"), loading=placement, target=Target(gpu="H100-80GB"))
        ).phase("loading").per_rank_peak_bytes

    shards, broadcast = loading(Loading("meta")), loading(Loading("meta", from_rank0=True))
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    # Rank 0's state dict is host memory: it moves one tensor at a time to the device, as the others receive one.
    assert broadcast[0] == broadcast[1]
    assert 0 < broadcast[1] - shards[1] - largest <= 8192  # with a 512-byte block or so of torch's own
    with pytest.raises(ValueError, match="placement='meta'"):
        Loading("device", from_rank0=True)


def test_on_a_gpu_target_the_host_memory_the_model_takes_while_it_loads_is_said():
    model = make_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    whole = _model_bytes(model)

    def host(loading: Loading, target: Target) -> int | None:
        return preflight.estimate(model, optimizer, lm_batch(2, 64), Run(
            parallel=ParallelPlan(2, "fsdp2"), loading=loading, target=target)).phase("loading").host_bytes

    gpu = Target(gpu="H100-80GB")
    assert host(Loading("host"), gpu) == whole  # every rank's whole model on its host until FSDP moves it
    assert host(Loading("meta", from_rank0=True), gpu) == whole  # rank 0's full state dict
    assert host(Loading("device"), gpu) == host(Loading("meta"), gpu) == 0
    assert host(Loading("host"), Target()) is None  # on a CPU target the host is the device, counted there
