"""`Run`: one description of how a training run trains, taken the same way by every entry point.

The model, optimizer and batch are the user's own objects. Everything else that changes the peak is said once,
in sections (torchtitan's ``JobConfig`` style):

- ``precision``: Lightning's names (``"bf16-mixed"``, ``"16-true"``, ...).
- ``loop`` (`Loop`): accumulation, where gradients are freed, clipping, loss scaling, simulated steps.
- ``target`` (`Target`): where it runs: the model's device, a CUDA device, or a GPU from the catalog, with the
  memory budget and the CUDA allocator's settings.
- ``parallel`` (`preflight.parallel.ParallelPlan`): world size and the engine's plan (DDP, FSDP1/2, ZeRO,
  offloading). A model already wrapped (DDP, FSDP, DeepSpeed) is itself a description of this section: every door
  reads it off the model.
- ``routing``: the mixture-of-experts routing assumed where the trace needs the router's choices.
- ``fast``: how preflight traces (not how the run trains): a deep repeated stack composed from its first blocks
  (the default everywhere), or every block traced.
- ``generation``: how the run generates, as ``model.generate``'s keyword arguments: in evaluation (a
  ``Seq2SeqTrainer`` with ``predict_with_generate``) and for a generation job (`preflight.estimate_generation`).
- ``checkpoint`` (`Checkpoint`): how the run saves checkpoints (the optimizer's state too, a full or sharded state
  dict, gathered on the host or the device); the save is traced after the steps as a phase of its own.
- ``loading`` (`Loading`): how the model comes to each rank's device (whole on the device, moved from the host by
  the engine, or built on meta); predicted as a phase of its own, before the steps.

`preflight.estimate`, ``estimate_eval``, ``check``, ``advise``, ``max_batch_size``, ``measure``, the callbacks and
the CLI all take a `Run`; a `preflight.Suggestion` returns one changed. `Run.over` lays the fields someone set
over a base description: the callbacks lay the user's over what they read off the trainer, and
``preflight check``'s flags over the script's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from preflight._budget import check_budget, resolve_budget
from preflight._checkpoint import Checkpoint
from preflight._device import resolve_device
from preflight._eval_loop import EvalLoop
from preflight._loading import Loading
from preflight._steps import Loop, check_precision
from preflight.allocator import AllocatorConfig
from preflight.parallel import ParallelPlan
from preflight.trace import ROUTINGS

__all__ = ["Checkpoint", "EvalLoop", "Loading", "Loop", "Run", "Target", "check_run", "pinned", "run_budget"]


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the run trains: the target section of a `Run`.

    Attributes:
        device: the device planned for (``"cuda"``, ``"cuda:1"``, ``"cpu"``); None: the model's own (CPU for a meta
            model), or CUDA when ``gpu`` is given.
        gpu: a GPU from the catalog (``"H100-80GB"``, ``"A100-40GB"``, ... see ``preflight.known_gpus()``) to plan
            for from any machine: its attention kernels, cuBLAS workspaces and CUDA context, and its memory as the
            budget.
        budget: the memory the run may use per device: an int or a size such as ``"24GiB"`` or ``"80GB"``. None:
            ``gpu``'s memory if given, else the CUDA device's capacity; a CPU target has no budget unless given.
        allocator: CUDA caching-allocator settings for the reserved-memory simulation: an `AllocatorConfig` or a
            ``PYTORCH_CUDA_ALLOC_CONF`` string such as ``"expandable_segments:True"``. None: the environment's
            ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``, else PyTorch's defaults.
        cuda_context: the CUDA context's bytes on the target (outside PyTorch's allocator, seen by nvidia-smi),
            an int or a size such as ``"1343MiB"``, added to ``device_total_bytes``: measure it where the job runs
            (nvidia-smi's figure for the process after a first small CUDA tensor, minus
            ``torch.cuda.memory_reserved()``), as it depends on the driver, the CUDA version and lazy module
            loading more than on the card. None: the catalog GPU's approximate figure (`preflight.known_gpus`).
        nccl_buffers: on a CUDA target over several ranks, the bytes of NCCL's buffers each communicator (process
            group) holds on a rank, as measured where the job runs (an int or a size such as ``"600MiB"``), added
            to ``device_total_bytes`` once per communicator the plan uses. None: modelled from NCCL's defaults and
            ``NCCL_*`` environment variables (`preflight.cuda._nccl`), an assumption the notes state.
    """

    device: str | torch.device | None = None
    gpu: str | None = None
    budget: int | float | str | None = None
    allocator: AllocatorConfig | str | None = None
    cuda_context: int | float | str | None = None
    nccl_buffers: int | float | str | None = None

    def __post_init__(self) -> None:
        if self.device is not None and not isinstance(self.device, (str, torch.device)):
            raise TypeError(f"`Target.device` should be a device name such as 'cuda' or a torch.device, got "
                            f"{type(self.device).__name__} {self.device!r}.")
        if self.gpu is not None:
            from preflight._gpus import get_gpu

            get_gpu(self.gpu)  # raises listing the known names
            if self.device is not None and torch.device(self.device).type != "cuda":
                raise ValueError(f"`Target(gpu={self.gpu!r})` plans for a CUDA device, but `device` is "
                                 f"{self.device!r}. Drop one of them.")
        if self.budget is not None:
            check_budget(self.budget)  # raises with the accepted forms
        if self.cuda_context is not None:
            from preflight._units import parse_bytes

            parse_bytes(self.cuda_context, name="cuda_context")  # raises with the accepted forms
        if self.nccl_buffers is not None:
            from preflight._units import parse_bytes

            parse_bytes(self.nccl_buffers, name="nccl_buffers")
        if self.allocator is not None and not isinstance(self.allocator, (str, AllocatorConfig)):
            raise TypeError("`Target.allocator` should be a PYTORCH_CUDA_ALLOC_CONF string such as "
                            "'expandable_segments:True' or a preflight.allocator.AllocatorConfig, got "
                            f"{type(self.allocator).__name__}.")

    @property
    def planned_device(self) -> str | torch.device | None:
        """The device the prediction is for: ``device``, or CUDA for a catalog ``gpu``, or None (the model's)."""
        return self.device if self.device is not None or self.gpu is None else "cuda"


@dataclasses.dataclass(frozen=True)
class Run:
    """How a training run trains, in sections; the user's model, optimizer and batch stay their own objects.

    Attributes:
        precision: ``None`` (as the tensors are), ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``
            or ``"16-true"`` (Lightning's names; ``*-mixed`` runs the forward under autocast; aliases ``"bf16"``,
            ``"fp16"``, ``"16"``, ``"32"`` are normalised).
        loop: the training loop (`Loop`): accumulation, ``zero_grad`` placement, clipping, GradScaler, steps.
        target: where it trains (`Target`): device or catalog GPU, budget, allocator settings.
        parallel: the data-parallel plan (`preflight.ParallelPlan`, or ``fsdp_plan(...)``, ``deepspeed_plan(...)``);
            None: one device, or the plan read off a model DDP, FSDP or DeepSpeed already wrapped.
        routing: the mixture-of-experts routing assumed where a per-expert loop needs the router's choices, which a
            fake trace does not have: ``"balanced"`` (each expert gets top_k x tokens / experts, what
            load-balancing losses train routers towards) or ``"skewed"`` (every token to the same top_k experts, a
            worst case). Said in ``coverage.notes`` when it decided a shape.
        fast: trace a model with a repeated stack of blocks (a transformer's layers) at three shallow depths and
            compose the full depth's timeline from them, exactly; the composed trace is checked against the traced
            depths and falls back to a full trace by itself (``coverage.notes`` says which). False traces every
            block (slower on deep models, the same bytes).
        generation: the keyword arguments of ``model.generate`` the run generates with (``{"max_new_tokens": 128,
            "num_beams": 4}``; any of transformers' ``GenerationConfig`` fields, over the model's own
            ``generation_config``): for `preflight.estimate_generation`, and for evaluation where the trainer
            generates (the HF callback reads a ``Seq2SeqTrainer``'s ``generation_max_length`` /
            ``generation_num_beams`` into it). None: the model's ``generation_config`` as it is. Traced to its
            longest: no sequence stops before ``max_new_tokens`` (the worst case for memory, said in the notes).
        checkpoint: how the run saves checkpoints (`Checkpoint`): the save is traced after the steps, with the
            training state they leave, and predicted as the phase ``"saving"`` (``Estimate.phases``); under FSDP a
            full state dict is gathered as the engine gathers it, per rank. None: no save predicted (the callbacks
            fill it from the trainer's saving settings).
        loading: how the model comes to each rank's device (`Loading`): predicted as the phase ``"loading"``
            (``Estimate.phases``), per rank under a sharding engine, where a rank holding the whole model before the
            engine shards it can be the run's peak. None: no loading predicted (nor for a model already wrapped or
            laid out: its loading is over).
        evaluation: what the evaluation loop keeps of each batch (`EvalLoop`): the HF Trainer with a
            ``compute_metrics`` keeps every batch's predictions and labels on the device, concatenated, until
            ``eval_accumulation_steps`` (the callback reads it off the Trainer); the evaluation phase's peak is then
            the last kept batch's. None: nothing kept across batches.

    Example:
        >>> run = preflight.Run(precision="bf16-mixed", loop=preflight.Loop(accumulate=4),
        ...                     target=preflight.Target(gpu="H100-80GB"),
        ...                     parallel=preflight.ParallelPlan(8, "fsdp2"))
        >>> est = preflight.estimate(model, optimizer, batch, run)  # doctest: +SKIP
    """

    precision: str | None = None
    loop: Loop = Loop()
    target: Target = Target()
    parallel: ParallelPlan | None = None
    routing: str = "balanced"
    # The composed trace is exact where it applies and checks itself, so it is the default at every door.
    fast: bool = True
    generation: Mapping[str, Any] | None = None
    checkpoint: Checkpoint | None = None
    loading: Loading | None = None
    evaluation: EvalLoop | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", check_precision(self.precision))
        # The optional sections: None (that phase is not predicted) or the section's class.
        for name, kind, missing, example in (("checkpoint", Checkpoint, "save", "Checkpoint(optimizer=True)"),
                                             ("loading", Loading, "loading", "Loading('meta')"),
                                             ("evaluation", EvalLoop, "outputs kept across evaluation batches",
                                              "EvalLoop(kept_batches=50)")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"`Run.{name}` should be None (no {missing} predicted) or a preflight."
                                f"{kind.__name__}, e.g. {example}, got {type(value).__name__}.")
        if self.generation is not None:
            object.__setattr__(self, "generation", check_generation(self.generation))
        for name, kind in (("loop", Loop), ("target", Target)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"`Run.{name}` should be a preflight.{kind.__name__}, got "
                                f"{type(getattr(self, name)).__name__}: e.g. Run({name}={kind.__name__}(...)).")
        if self.parallel is not None and not isinstance(self.parallel, ParallelPlan):
            raise TypeError("`Run.parallel` should be None or a preflight.ParallelPlan (e.g. ParallelPlan(8, "
                            "'fsdp2'), fsdp_plan('FULL_SHARD', world_size=8) or deepspeed_plan(config, "
                            f"world_size=8)), got {type(self.parallel).__name__}.")
        if self.routing not in ROUTINGS:
            raise ValueError(f"`Run.routing` should be one of {ROUTINGS}, got {self.routing!r}.")
        if not isinstance(self.fast, bool):
            raise TypeError(f"`Run.fast` should be True or False, got {self.fast!r}.")

    @property
    def world_size(self) -> int:
        """The ranks the plan spans (1 without one)."""
        return 1 if self.parallel is None else self.parallel.world_size

    @property
    def pipelined(self) -> bool:
        """The plan runs the model under a pipeline schedule (``parallel.pp``)."""
        return self.parallel is not None and self.parallel.pp is not None

    def replace(self, **changes: Any) -> Run:
        """A copy with whole fields replaced: ``run.replace(precision="bf16-true")``."""
        return dataclasses.replace(self, **changes)

    def over(self, base: Run) -> Run:
        """This description laid over ``base``: each field (and each field of ``loop`` and ``target``) set here to
        other than its default wins, the rest comes from ``base``. The callbacks lay the user's `Run` over the one
        they read off the trainer; ``preflight check``'s flags are laid over the script's."""
        return Run(**{f.name: _over(getattr(self, f.name), getattr(base, f.name), f.name)
                      for f in dataclasses.fields(self)})

    def changes_from(self, base: Run) -> dict[str, Any]:
        """What this description changes of ``base``: ``{field: value}``, and for ``loop`` and ``target`` the changed
        fields of the section as a dict (``{"precision": "bf16-true", "loop": {"accumulate": 4}}``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(base, f.name)
            if isinstance(mine, (Loop, Target)):
                section = {g.name: getattr(mine, g.name) for g in dataclasses.fields(mine)
                           if getattr(mine, g.name) != getattr(theirs, g.name)}
                if section:
                    out[f.name] = section
            elif mine != theirs:
                out[f.name] = mine
        return out

    def with_changes(self, changes: dict[str, Any]) -> Run:
        """This description with ``changes`` (`changes_from`'s form) made: sections field by field."""
        fields = {}
        for name, value in changes.items():
            current = getattr(self, name)
            fields[name] = dataclasses.replace(current, **value) if isinstance(current, (Loop, Target)) else value
        return dataclasses.replace(self, **fields)

    def to_dict(self) -> dict[str, Any]:
        """The description as plain values, for the JSON report (plans and allocator settings as their text)."""
        parallel = None
        if self.parallel is not None:
            parallel = {"world_size": self.parallel.world_size, "sharding": self.parallel.sharding,
                        "offload_optimizer": self.parallel.offload_optimizer,
                        "offload_params": self.parallel.offload_params,
                        "gradient_as_bucket_view": self.parallel.gradient_as_bucket_view,
                        "source": self.parallel.source,
                        "tp_degree": None if self.parallel.tp is None else self.parallel.tp.degree,
                        "pp": None if self.parallel.pp is None else {
                            "stages": self.parallel.pp.stages, "schedule": self.parallel.pp.schedule_class.__name__,
                            "microbatches": self.parallel.pp.n_microbatches}}
        target = {k: (v if v is None or isinstance(v, (int, float)) else str(v))
                  for k, v in dataclasses.asdict(self.target).items()}
        return {"precision": self.precision, "loop": self.loop.to_dict(), "target": target, "parallel": parallel,
                "routing": self.routing, "fast": self.fast,
                "generation": None if self.generation is None else {
                    k: v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
                    for k, v in self.generation.items()},
                "checkpoint": None if self.checkpoint is None else self.checkpoint.to_dict(),
                "loading": None if self.loading is None else self.loading.to_dict(),
                "evaluation": None if self.evaluation is None else self.evaluation.to_dict()}

    def cli_flags(self) -> list[str]:
        """The ``preflight estimate`` / ``preflight check`` flags that say this description (those the CLI has)."""
        flags: list[str] = []
        if self.precision is not None:
            flags += ["--precision", self.precision]
        if self.target.gpu is not None:
            flags += ["--gpu", self.target.gpu]
        if self.target.budget is not None:
            flags += ["--budget", str(self.target.budget)]
        if self.target.allocator is not None:
            flags += ["--allocator", str(self.target.allocator)]
        if self.target.cuda_context is not None:
            flags += ["--cuda-context", str(self.target.cuda_context)]
        if self.target.nccl_buffers is not None:
            flags += ["--nccl-buffers", str(self.target.nccl_buffers)]
        if self.loop.accumulate != 1:
            flags += ["--accumulate", str(self.loop.accumulate)]
        if self.loop.optimizer_impl is not None:
            flags += ["--optimizer-impl", self.loop.optimizer_impl]
        if self.loop.offload_activations is not None:
            flags += ["--offload-activations", self.loop.offload_activations]
        if self.parallel is not None:
            flags += ["--world-size", str(self.parallel.world_size)]
            if self.parallel.sharding is not None:
                flags += ["--sharding", self.parallel.sharding]
            flags += ["--offload-optimizer"] * self.parallel.offload_optimizer
            flags += ["--offload-params"] * self.parallel.offload_params
            flags += ["--gradient-as-bucket-view"] * self.parallel.gradient_as_bucket_view
            if self.parallel.tp is not None:  # the CLI plans the model's own styles; given ones are not flags
                flags += ["--tp", str(self.parallel.tp.degree)]
        if not self.fast:
            flags.append("--full")
        if self.checkpoint is not None:
            flags += ["--checkpoint", self.checkpoint.state_dict]
            flags += ["--checkpoint-weights-only"] * (not self.checkpoint.optimizer)
            flags += ["--checkpoint-on-device"] * (not self.checkpoint.offload_to_cpu)
            flags += ["--checkpoint-every-rank"] * (not self.checkpoint.rank0_only)
        if self.loading is not None:
            flags += ["--loading", "meta-rank0" if self.loading.from_rank0 else self.loading.placement]
        return flags  # generation is not a training flag: `preflight estimate --generate` plans it as its own job


def _over(mine: Any, base: Any, name: str) -> Any:
    default = _DEFAULTS[name]
    if isinstance(mine, (Loop, Target)):
        return dataclasses.replace(base, **{f.name: getattr(mine, f.name) for f in dataclasses.fields(mine)
                                            if getattr(mine, f.name) != getattr(default, f.name)})
    if name == "generation" and mine is not None and base is not None:  # the user's arguments over the trainer's
        return {**base, **mine}
    return base if mine == default else mine


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Run)}


_COUNTS = ("max_new_tokens", "max_length", "min_new_tokens", "min_length", "num_beams", "num_return_sequences")


def check_generation(generation: Any) -> dict[str, Any]:
    """``generation`` as a new dict of ``model.generate`` keyword arguments, or a TypeError / ValueError naming the
    fix."""
    if not isinstance(generation, Mapping) or not all(isinstance(k, str) for k in generation):
        raise TypeError("`Run.generation` should be a dict of model.generate keyword arguments, e.g. "
                        f"{{'max_new_tokens': 128, 'num_beams': 4}}, got {type(generation).__name__}.")
    for key in _COUNTS:
        value = generation.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0 or
                                  (value == 0 and key in ("num_beams", "num_return_sequences"))):
            raise ValueError(f"`Run.generation[{key!r}]` should be a positive whole number, got {value!r}.")
    return dict(generation)


def check_run(run: Any) -> Run:
    """``run`` if it is a `Run` (None: the defaults), else a TypeError naming the fix."""
    if run is None:
        return Run()
    if not isinstance(run, Run):
        raise TypeError(f"`run` should be a preflight.Run describing how the run trains (e.g. "
                        f"Run(precision='bf16-mixed', target=Target(gpu='H100-80GB'))), got {type(run).__name__}.")
    return run



def run_budget(run: Run, model: Any, *, required: bool = True) -> int | None:
    """The bytes ``run``'s target may use per device: its ``budget``, else its catalog GPU's memory, else the CUDA
    device's capacity. None where there is none (a CPU target without a budget), or a ValueError naming the fix when
    ``required``."""
    budget = resolve_budget(run.target.budget, device=resolve_device(run.target.planned_device, model),
                            gpu=run.target.gpu)
    if budget is None and required:
        raise ValueError("A budget is needed: there is no CUDA device to read a capacity from. Say the memory the "
                         "run may use, e.g. Run(target=Target(budget='24GiB')), or plan for a GPU from the catalog "
                         "with Target(gpu='H100-80GB').")
    return budget


def pinned(run: Run, device: torch.device) -> Run:
    """``run`` planned for ``device`` where its target names no device of its own: a traced model may be a meta copy
    (LoRA's option, an FSDP stand-in), whose own device is not the one the user's model plans for."""
    if run.target.planned_device is not None:
        return run
    return run.replace(target=dataclasses.replace(run.target, device=device))
