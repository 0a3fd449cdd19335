"""What a trainer's distributed strategy means for one rank's memory: the parallel section of a `preflight.Run`.

Lightning's strategies, the HF Trainer's ``fsdp`` / ``deepspeed`` arguments and accelerate's plugins describe the
same few choices in their own words. The integrations read those words off the trainer (framework glue only)
and hand them here, where each becomes a `ParallelPlan`: the world size, the sharding (`preflight._sharding`'s
vocabulary), and what is offloaded to the CPU, with a note saying where it came from.

- FSDP (``torch.distributed.fsdp.ShardingStrategy`` or its name, in any case, as FSDP1 configs spell it):
  ``FULL_SHARD`` shards parameters, gradients and optimizer state (``fsdp-full``); ``SHARD_GRAD_OP`` gradients and
  optimizer state (``fsdp-grad-op``); ``NO_SHARD`` is data parallelism (``ddp``); ``HYBRID_SHARD`` and
  ``_HYBRID_SHARD_ZERO2`` shard as ``FULL_SHARD`` / ``SHARD_GRAD_OP`` inside a node and replicate across nodes
  (an `FSDP1Plan` with ``ranks_per_node``: each rank is traced over the two groups, holding the shards of the ranks
  in its node). ``CPUOffload(offload_params=True)`` keeps parameters,
  gradients and the optimizer step on the CPU; with ``SHARD_GRAD_OP``, whose parameters are whole on the GPU
  through forward and backward, the plan is predicted without the offload and says so (an upper bound). FSDP2
  (``fully_shard``) is ``fsdp2``; its HSDP (a 2-D mesh) an `FSDP2Plan` with ``replicate``.
- accelerate (`accelerate_plan`): the plugin its state says it applied, read by attribute name.
- DeepSpeed (its JSON config, as a dict, a path or a JSON string, read by
  `preflight._sharding.read_deepspeed_config`): ``zero_optimization.stage`` 1, 2, 3 is ``zero1``, ``zero2``,
  ``zero3``; stage 0 is data parallelism; ``offload_optimizer.device`` and ``offload_param.device`` of ``cpu`` or
  ``nvme`` offload. The config travels with the plan: `preflight.estimate` sizes ZeRO's gradient reduction buffers
  from it (``"auto"`` values the HF Trainer has not filled yet are filled from the model's hidden size, as it fills
  them).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from preflight._checkpoint import Checkpoint
from preflight._sharding import SHARDING_CHOICES

__all__ = ["ParallelPlan", "accelerate_checkpoint", "accelerate_plan", "already_sharded", "deepspeed_plan", "fsdp_plan",
           "read_ddp"]

_FSDP = {"FULL_SHARD": "fsdp-full", "SHARD_GRAD_OP": "fsdp-grad-op", "NO_SHARD": "ddp",
         "HYBRID_SHARD": "fsdp-full", "_HYBRID_SHARD_ZERO2": "fsdp-grad-op", "HYBRID_SHARD_ZERO2": "fsdp-grad-op"}


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """One rank's share of a data-parallel run.

    Attributes:
        world_size: the job's ranks (hybrid sharding's shard groups, one node's ranks, are in ``fsdp``).
        sharding: a `preflight._sharding.SHARDING_CHOICES` name; None for a single process.
        offload_optimizer, offload_params: what lives on the CPU instead of the GPU.
        source: where the plan was read, for the report (``"Lightning FSDPStrategy(SHARD_GRAD_OP)"``).
        fsdp: how FSDP wraps the model, where the strategy says (an `FSDP1Plan` or `FSDP2Plan`); None: the
            engine's defaults.
        deepspeed: the DeepSpeed config (a dict) of a DeepSpeed plan, for `preflight.estimate`'s
            ``deepspeed_config``; None otherwise.
        gradient_as_bucket_view: DDP's option (a ``"ddp"`` plan): gradients are views into DDP's buckets.
        tp: tensor parallelism (a `preflight.parallel.TPPlan`): with ``sharding=None`` its degree is the world size;
            with ``"fsdp2"``, FSDP2 shards over the data-parallel dim of the mesh ``(world_size // degree,
            degree)``, as torchtitan lays out TP x FSDP2 (``fsdp`` may give an `FSDP2Plan` for it).
        pp: pipeline parallelism (a `preflight.parallel.PPPlan`): with ``sharding=None`` its ranks (times ``cp``'s
            and ``tp``'s degrees, where given) are the world size; with ``"fsdp2"``, FSDP2 shards each stage over the
            data-parallel dim (and the ring's) of the mesh ``(pp ranks, dp, cp degree, tp degree)``, torchtitan's
            layout; with ``cp``, each rank's steps run inside the ring.
        cp: context parallelism (a `preflight.parallel.CPPlan`): with ``sharding=None`` its degree is the world size
            (the model replicated on every rank of the ring); with ``"fsdp2"``, FSDP2 shards over every rank of the
            job (torchtitan's ``dp_shard_cp``) and the rings are the consecutive runs of ``degree`` ranks. With
            ``tp``, the mesh is ``(dp, cp, tp)``, tensor-parallel ranks innermost: the world size is ``cp`` times
            ``tp`` degree without sharding, FSDP2 shards over the ``dp`` and ``cp`` dims.
        ep: expert parallelism (a `preflight.parallel.EPPlan`), as transformers lays a mixture-of-experts model out
            with ``DistributedConfig(fsdp_size=world_size, ep_size=degree)``: ``sharding`` is ``"fsdp2"``
            (transformers' FSDP2 over every rank). With ``tp`` (a `TPPlan` without styles, whose degree divides
            ``ep``'s), transformers' tensor parallelism lays the dense layers out with the model's own plan:
            ``DistributedConfig(tp_size=tp.degree, fsdp_size=world_size // tp.degree, ep_size=degree)``. With
            ``fsdp=FSDP2Plan(replicate=R)``, R replicas of that layout (``dp_replicate_size=R``, HSDP).
    """

    world_size: int
    sharding: str | None
    offload_optimizer: bool = False
    offload_params: bool = False
    source: str = ""
    fsdp: Any = None
    deepspeed: Mapping[str, Any] | None = None
    gradient_as_bucket_view: bool = False
    tp: Any = None
    pp: Any = None
    cp: Any = None
    ep: Any = None

    def __post_init__(self) -> None:
        _check_world(self.world_size)
        if self.tp is not None:
            self._check_tp()
        if self.cp is not None:
            self._check_cp()
        if self.pp is not None:
            self._check_pp()
        if self.ep is not None:
            self._check_ep()
        if self.sharding is not None and self.sharding not in SHARDING_CHOICES:
            raise ValueError(f"`ParallelPlan.sharding` should be one of {SHARDING_CHOICES} or None, got "
                             f"{self.sharding!r}.")
        for name in ("offload_optimizer", "offload_params", "gradient_as_bucket_view"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`ParallelPlan.{name}` should be True or False, got {getattr(self, name)!r}.")
        if self.gradient_as_bucket_view and self.sharding not in (None, "ddp"):
            raise ValueError(f"`gradient_as_bucket_view` is DDP's option, but the sharding is {self.sharding!r}: "
                             "pass sharding='ddp', or leave gradient_as_bucket_view out.")

    def _check_tp(self) -> None:
        from preflight.parallel._fsdp2 import FSDP2Plan
        from preflight.parallel._tensor import TPPlan, tp_mesh

        if not isinstance(self.tp, TPPlan):
            raise TypeError(f"`ParallelPlan.tp` should be a preflight.parallel.TPPlan or None, got {self.tp!r}.")
        if self.pp is not None or self.cp is not None or self.ep is not None:
            return  # the world holds their ranks too, or transformers lays it out: `_check_pp`, `_check_cp`, `_ep`
        # A ValueError where the degrees do not divide the world (HSDP's replicate dim included).
        tp_mesh(self.tp, self.world_size, self.fsdp if isinstance(self.fsdp, FSDP2Plan) else None)
        if self.sharding is None and self.tp.degree != self.world_size:
            raise ValueError(f"`tp.degree` is {self.tp.degree} but the world size is {self.world_size}: data "
                             "parallelism beside tensor parallelism is traced with FSDP2 over the other dim; pass "
                             "sharding='fsdp2', or world_size equal to the degree.")
        if self.sharding is not None and (self.sharding != "fsdp2" or self.tp.degree == self.world_size):
            raise ValueError(f"with tensor parallelism of degree {self.tp.degree} over {self.world_size} rank(s), "
                             f"`sharding` should be 'fsdp2' (FSDP2 over the (world_size // degree) data-parallel "
                             f"ranks, world_size > degree) or None (tensor parallelism alone), got {self.sharding!r}.")
        if any((self.offload_optimizer, self.offload_params, self.deepspeed, self.gradient_as_bucket_view)):
            raise ValueError("tensor parallelism is traced with FSDP2 or alone, without CPU offload, DeepSpeed or "
                             "DDP's options: leave them out of a plan with `tp`.")

    def _check_pp(self) -> None:
        from preflight.parallel._pipeline import PPPlan

        if not isinstance(self.pp, PPPlan):
            raise TypeError(f"`ParallelPlan.pp` should be a preflight.parallel.PPPlan or None, got {self.pp!r}.")
        # One data-parallel replica's ranks: the pipeline's, each a ring of `cp` ranks and a tensor-parallel group of
        # `tp` ranks where they are given.
        degree = (self.tp.degree if self.tp is not None else 1) * (self.cp.degree if self.cp is not None else 1)
        what = "pipeline" + (f" x {self.cp.degree} context-parallel" if self.cp is not None else "") + (
            f" x {self.tp.degree} tensor-parallel" if self.tp is not None else "")
        ranks = self.pp.stages * degree
        if self.sharding is None and ranks != self.world_size:
            raise ValueError(f"the {what} ranks are {ranks} but the world size is {self.world_size}: data "
                             "parallelism beside pipeline parallelism is traced with FSDP2 over the other dim; pass "
                             f"sharding='fsdp2', or world_size equal to {ranks}.")
        # FSDP2 over the ring alone (no data-parallel dim: torchtitan's dp_shard_cp of a world of pp x cp) is allowed
        # beside a ring; without one it would shard over nothing.
        if self.sharding is not None and (self.sharding != "fsdp2" or self.world_size % ranks
                                          or (self.world_size == ranks and self.cp is None)):
            raise ValueError(f"with {ranks} {what} rank(s) in a world of {self.world_size}, `sharding` should be "
                             f"'fsdp2' (FSDP2 over the world_size // {ranks} ranks of each stage, a multiple of "
                             f"them) or None (no data parallelism), got {self.sharding!r}.")
        if any((self.offload_optimizer, self.offload_params, self.deepspeed, self.gradient_as_bucket_view)):
            raise ValueError("pipeline parallelism is traced alone or with FSDP2, tensor and context parallelism, not "
                             "yet with offload, DeepSpeed or DDP's options: leave them out of a plan with `pp`.")
        if (self.tp is not None or self.cp is not None) and getattr(self.fsdp, "replicate", 1) != 1:
            raise ValueError("pipeline parallelism beside tensor or context parallelism is traced with FSDP2 over one "
                             "data-parallel dim, not yet with HSDP: leave the FSDP2Plan's replicate at 1.")

    def _check_cp(self) -> None:
        from preflight.parallel._context import CPPlan

        if not isinstance(self.cp, CPPlan):
            raise TypeError(f"`ParallelPlan.cp` should be a preflight.parallel.CPPlan or None, got {self.cp!r}.")
        from preflight.parallel._tensor import TPPlan

        if self.tp is not None and not isinstance(self.tp, TPPlan):
            raise TypeError(f"`ParallelPlan.tp` should be a preflight.parallel.TPPlan or None, got {self.tp!r}.")
        if self.pp is not None:  # the world holds the pipeline's ranks too: `_check_pp`
            return
        self.cp.mesh(self.world_size, self.tp)  # a ValueError where the degrees do not divide the world
        ranks = self.cp.degree * (self.tp.degree if self.tp is not None else 1)
        if self.sharding is None and ranks != self.world_size:
            what = f"`cp.degree` times `tp.degree` is {ranks}" if self.tp else f"`cp.degree` is {ranks}"
            raise ValueError(f"{what} but the world size is {self.world_size}: data parallelism beside context "
                             "parallelism is traced with FSDP2 over every rank; pass sharding='fsdp2', or world_size "
                             f"equal to {ranks}.")
        if self.sharding not in (None, "fsdp2"):
            raise ValueError("with context parallelism, `sharding` should be 'fsdp2' (FSDP2 over every rank, "
                             f"torchtitan's dp_shard_cp) or None (the model replicated), got {self.sharding!r}.")
        if any((self.offload_optimizer, self.offload_params, self.deepspeed, self.gradient_as_bucket_view)):
            raise ValueError("context parallelism is traced alone, with FSDP2, tensor or pipeline parallelism, not yet "
                             "with offload, DeepSpeed or DDP's options: leave them out of a plan with `cp`.")
        if getattr(self.fsdp, "replicate", 1) != 1:
            raise ValueError("context parallelism is traced with FSDP2 over every rank, not yet with HSDP: leave "
                             "the FSDP2Plan's replicate at 1.")

    def _check_ep(self) -> None:
        from preflight.parallel._expert import EPPlan

        if not isinstance(self.ep, EPPlan):
            raise TypeError(f"`ParallelPlan.ep` should be a preflight.parallel.EPPlan or None, got {self.ep!r}.")
        from preflight.parallel._fsdp2 import FSDP2Plan

        if self.world_size % self.ep.degree:
            raise ValueError(f"`ep.degree` ({self.ep.degree}) should divide the world size {self.world_size}.")
        if self.sharding != "fsdp2":
            raise ValueError("transformers' expert parallelism comes with its FSDP2 over every rank: pass "
                             f"sharding='fsdp2', got {self.sharding!r}.")
        # Replicas (HSDP) are transformers' dp_replicate_size: an FSDP2Plan that says nothing else.
        replicas_only = isinstance(self.fsdp, FSDP2Plan) and self.fsdp == FSDP2Plan(replicate=self.fsdp.replicate)
        if self.pp is not None or self.cp is not None or (self.fsdp is not None and not replicas_only) or any(
                (self.offload_optimizer, self.offload_params, self.deepspeed, self.gradient_as_bucket_view)):
            raise ValueError("expert parallelism is traced with transformers' own FSDP2 (its replicas: "
                             "FSDP2Plan(replicate=R)) and tensor parallelism, not yet with pipeline or context "
                             "parallelism, FSDP2 settings of its own, offload or DeepSpeed: leave them out of a plan "
                             "with `ep`.")
        replicate = self.fsdp.replicate if self.fsdp is not None else 1
        if self.world_size % replicate or (self.world_size // replicate) % self.ep.degree:
            raise ValueError(f"`ep.degree` ({self.ep.degree}) should divide the ranks of one replica (world size "
                             f"{self.world_size} / replicate {replicate}), as DistributedConfig(dp_replicate_size=..., "
                             "ep_size=...) requires.")
        if self.tp is not None:
            from preflight.parallel._tensor import TPPlan

            if not isinstance(self.tp, TPPlan):
                raise TypeError(f"`ParallelPlan.tp` should be a preflight.parallel.TPPlan or None, got {self.tp!r}.")
            # transformers' DistributedConfig: tp_size divides ep_size, which divides fsdp_size x tp_size (the world).
            if self.tp.styles is not None or self.ep.degree % self.tp.degree:
                raise ValueError(f"beside expert parallelism, tensor parallelism is transformers' own (the model's "
                                 f"base_model_tp_plan: TPPlan(degree) without styles) over a degree that divides "
                                 f"`ep.degree` ({self.ep.degree}), as DistributedConfig(tp_size=..., ep_size=...) "
                                 f"requires; got {self.tp!r}.")

    @property
    def sharded(self) -> bool:
        """Whether the plan shards training state (anything but plain data parallelism)."""
        return self.sharding not in (None, "ddp")

    def estimate_kwargs(self) -> dict[str, Any]:
        """The plan as `preflight.estimate`'s keyword arguments."""
        kwargs = {"world_size": self.world_size, "sharding": self.sharding,
                  "offload_optimizer": self.offload_optimizer, "offload_params": self.offload_params}
        if self.fsdp is not None:
            kwargs["fsdp"] = self.fsdp
        if self.deepspeed is not None and self.sharded:
            kwargs["deepspeed_config"] = dict(self.deepspeed)
        if self.gradient_as_bucket_view and self.sharding == "ddp":
            kwargs["gradient_as_bucket_view"] = True
        if self.tp is not None:
            kwargs["tp"] = self.tp
        if self.pp is not None:
            kwargs["pp"] = self.pp
        if self.cp is not None:
            kwargs["cp"] = self.cp
        if self.ep is not None:
            kwargs["ep"] = self.ep
        return kwargs

    def note(self) -> str:
        """The coverage note: where the plan came from and what it shards and offloads."""
        offloaded = [name for name, on in (("optimizer state", self.offload_optimizer),
                                           ("parameters", self.offload_params)) if on]
        shard = self.fsdp.shard_size(self.world_size) if self.fsdp is not None else self.world_size
        over = (f"{self.world_size} rank(s)" if shard == self.world_size and not getattr(self.fsdp, "hybrid", False)
                else f"{self.world_size} rank(s) as {self.world_size // shard} replica(s) of {shard}-rank shard groups")
        if self.tp is not None:
            over += f", tensor parallel degree {self.tp.degree}"
        if self.pp is not None:
            over += f", pipeline parallel {self.pp.label}"
        if self.cp is not None:
            over += f", {self.cp.label}"
        if self.ep is not None:
            over += f", {self.ep.label}"
        return (f"per-rank plan read from {self.source or 'the trainer'}: {self.sharding} over {over}"
                + (f", {' and '.join(offloaded)} on the CPU" if offloaded else ""))


def fsdp_plan(strategy: Any, *, world_size: int, ranks_per_node: int | None = None, cpu_offload: bool = False,
              source: str = "", use_orig_params: bool | None = None, unit_types: tuple[type, ...] | None = None,
              reshard_after_forward: bool | None = None, replicate: int = 1) -> ParallelPlan:
    """The plan of an FSDP run.

    Args:
        strategy: a ``ShardingStrategy`` member or name (``"FULL_SHARD"``, ``"shard_grad_op"``, HF's
            ``"hybrid_shard"``, ...), or ``"fsdp2"`` for ``fully_shard``; None: FSDP's default, ``FULL_SHARD``.
        world_size: all ranks of the job.
        ranks_per_node: the ranks of one node, the group a hybrid strategy shards over (default ``world_size``:
            one node); it must divide ``world_size``.
        cpu_offload: ``CPUOffload(offload_params=True)`` (FSDP1) or ``CPUOffloadPolicy`` (FSDP2).
        use_orig_params, unit_types: FSDP1's ``use_orig_params`` and the module classes its wrap policy makes units
            of (``()``: no policy, the root alone), where the strategy says; None: `FSDP1Plan`'s defaults.
        reshard_after_forward: FSDP2's, as the trainer passes it to ``fully_shard``; False keeps each unit's
            parameters gathered from forward to backward; None: not passed (``fully_shard``'s default).
        replicate: FSDP2's HSDP replicate degree (the first dim of its 2-D mesh); 1: a 1-D mesh.

    Example:
        >>> fsdp_plan("hybrid_shard", world_size=16, ranks_per_node=8).fsdp.ranks_per_node
        8
    """
    name = "FULL_SHARD" if strategy is None else str(getattr(strategy, "name", strategy)).upper()
    if name == "FSDP2":
        sharding = "fsdp2"
    elif name in _FSDP:
        sharding = _FSDP[name]
    else:
        raise ValueError(f"Unknown FSDP sharding strategy {strategy!r}: expected one of "
                         f"{sorted(n for n in _FSDP if not n.startswith('_'))} or 'fsdp2'.")
    _check_world(world_size)
    hybrid = "HYBRID" in name
    per_node = min(ranks_per_node or world_size, world_size)
    if hybrid and world_size % per_node:
        raise ValueError(f"`ranks_per_node` ({ranks_per_node}) should divide `world_size` ({world_size}): a hybrid "
                         "strategy's nodes hold equally many ranks.")
    if sharding == "ddp":
        cpu_offload = False  # NO_SHARD: predicted as data parallelism, whose replicas stay on the GPU
    source = source or f"FSDP {name}"
    if cpu_offload and sharding == "fsdp-grad-op":
        # Whole parameters on the GPU through forward and backward: the per-category rescale has no offload for
        # this strategy, so it is predicted without it, which counts more on the GPU than the run holds.
        cpu_offload = False
        source += " with CPU offload, predicted without it (an upper bound)"
    fsdp = None
    if sharding == "fsdp2" and (reshard_after_forward is not None or replicate != 1):
        from preflight.parallel._fsdp2 import FSDP2Plan

        fsdp = FSDP2Plan(reshard_after_forward=reshard_after_forward, replicate=replicate)
        fsdp.shard_size(world_size)  # a ValueError where the replicas do not divide the world
    elif sharding in ("fsdp-full", "fsdp-grad-op") and (use_orig_params is not None or unit_types is not None
                                                         or hybrid):
        from preflight.parallel._fsdp1 import FSDP1Plan

        fsdp = FSDP1Plan(units=() if unit_types == () else None, unit_types=unit_types or None,
                         use_orig_params=True if use_orig_params is None else bool(use_orig_params),
                         ranks_per_node=per_node if hybrid else None)
    return ParallelPlan(world_size=world_size, sharding=sharding, offload_optimizer=cpu_offload,
                        offload_params=cpu_offload, source=source, fsdp=fsdp)


def deepspeed_plan(config: Mapping[str, Any] | str | os.PathLike, *, world_size: int,
                   source: str = "") -> ParallelPlan:
    """The plan of a DeepSpeed run from its config (a dict, a path to its JSON file, or the JSON text).

    Example:
        >>> plan = deepspeed_plan({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        ...                       world_size=8)
        >>> plan.sharding, plan.offload_optimizer, plan.offload_params
        ('zero2', True, False)
    """
    from preflight._sharding import read_deepspeed_config

    _check_world(world_size)
    config = _load(config)
    ds = read_deepspeed_config(dict(config))  # "auto" sizes stay unresolved here: the estimate fills them
    if ds["stage"] == 0 and ds["offload_optimizer"]:
        raise ValueError("DeepSpeed config: optimizer offload needs ZeRO stage 1, 2 or 3, but the stage is 0.")
    return ParallelPlan(world_size=world_size, sharding=ds["sharding"], offload_optimizer=ds["offload_optimizer"],
                        offload_params=ds["offload_params"], source=source or f"DeepSpeed ZeRO stage {ds['stage']}",
                        deepspeed=config)


def accelerate_checkpoint(state: Any, *, weights_only: bool) -> Checkpoint:
    """How accelerate saves under the plugin it applied (the HF Trainer's ``_save_checkpoint`` calls it), as a
    `preflight.Checkpoint`: under FSDP, the plugin's ``state_dict_type`` (accelerate's default: a full state dict for
    FSDP1, a sharded one for FSDP2) and its ``state_dict_config`` (``offload_to_cpu``, ``rank0_only``: both True by
    default); under DeepSpeed, the model consolidated through accelerate's ``get_state_dict`` (the Trainer's
    ``save_model``) and each rank's own partitions (``save_checkpoint``): a full state dict, as DeepSpeed makes it
    (`preflight.parallel._deepspeed.deepspeed_save`); else the model's and optimizer's state dicts.
    ``weights_only``: the optimizer's state is not saved (``save_only_model``)."""
    kind = getattr(state, "distributed_type", None)
    kind = str(getattr(kind, "value", kind) or "").upper()
    if kind == "DEEPSPEED":
        return Checkpoint(optimizer=not weights_only, state_dict="full")
    fsdp = getattr(state, "fsdp_plugin", None) if kind == "FSDP" else None
    if fsdp is None:
        return Checkpoint(optimizer=not weights_only)
    saved = getattr(fsdp, "state_dict_type", None)
    saved = str(getattr(saved, "name", saved) or "").upper()
    if not saved:  # the plugin's own default, before it resolved it
        saved = "FULL_STATE_DICT" if getattr(fsdp, "fsdp_version", 1) == 1 else "SHARDED_STATE_DICT"
    config = getattr(fsdp, "state_dict_config", None)
    return Checkpoint(optimizer=not weights_only, state_dict="full" if saved.startswith("FULL") else "sharded",
                      offload_to_cpu=bool(getattr(config, "offload_to_cpu", True)),
                      rank0_only=bool(getattr(config, "rank0_only", True)))


def accelerate_plan(state: Any) -> ParallelPlan | None:
    """The sharded plugin accelerate applied, from its state (``accelerator.state``, or the ``AcceleratorState``
    the HF Trainer made): ``DeepSpeedPlugin`` (its config, with the values accelerate filled in) under
    ``DistributedType.DEEPSPEED``; ``FullyShardedDataParallelPlugin`` under ``DistributedType.FSDP`` (FSDP2, with
    its ``reshard_after_forward``; FSDP1: its sharding strategy and ``use_orig_params``; offload only for
    ``CPUOffload(offload_params=True)`` or ``CPUOffloadPolicy``, not FSDP2's default ``OffloadPolicy()``), FSDP1's
    hybrid strategies over ``LOCAL_WORLD_SIZE`` ranks, FSDP2's HSDP over ``parallelism_config.dp_replicate_size``
    replicas. None otherwise: a plugin accelerate did not apply (FSDP asked for on
    CPU processes runs DDP) is not read, and under ``ParallelismConfig(tp_size=...)`` (without a ring) the model's
    own layout is the plan: accelerate takes the model transformers laid out and wraps it by ``fully_shard``, and
    `preflight.estimate` reads both off the model."""
    kind = getattr(state, "distributed_type", None)
    kind = str(getattr(kind, "value", kind) or "").upper()
    world = max(int(getattr(state, "num_processes", 1) or 1), 1)
    if dist.is_available() and dist.is_initialized():  # under DeepSpeed on CPU processes accelerate counts one
        world = dist.get_world_size()
    if kind == "DEEPSPEED":
        plugin = getattr(state, "deepspeed_plugin", None)
        return deepspeed_plan(getattr(plugin, "deepspeed_config", None) or {}, world_size=world,
                              source="accelerate's DeepSpeedPlugin")
    config = getattr(state, "parallelism_config", None)
    tp_size, cp_size = getattr(config, "tp_size", None), getattr(config, "cp_size", None)
    if isinstance(tp_size, int) and tp_size > 1 and not (isinstance(cp_size, int) and cp_size > 1):
        # accelerate takes a model transformers already laid out (from_pretrained(tp_plan="auto")) and wraps it by
        # fully_shard over the other dims: the model carries the whole layout, and is read off it.
        return None
    fsdp = getattr(state, "fsdp_plugin", None)
    if kind != "FSDP" or fsdp is None:
        return None
    reshard = getattr(fsdp, "reshard_after_forward", None)
    options: dict[str, Any] = {}
    if getattr(fsdp, "fsdp_version", 1) == 2:
        strategy = "fsdp2"
        options["reshard_after_forward"] = reshard is not False
        # HSDP: accelerate's ParallelismConfig (dp_replicate_size replicas of dp_shard_size-rank shard groups)
        replicas = getattr(getattr(state, "parallelism_config", None), "dp_replicate_size", None)
        if isinstance(replicas, int) and replicas > 1:
            options["replicate"] = replicas
    else:
        strategy = reshard if reshard not in (None, True, False) else getattr(fsdp, "sharding_strategy", None)
        options["use_orig_params"] = bool(getattr(fsdp, "use_orig_params", False))  # accelerate's default: False
        policy = getattr(fsdp, "auto_wrap_policy", "")
        if policy is None or str(policy).upper() == "NO_WRAP":  # accelerate's default, None once it has read it
            options["unit_types"] = ()
    offload = getattr(fsdp, "cpu_offload", None)
    offload = (offload if isinstance(offload, bool) else type(offload).__name__ == "CPUOffloadPolicy"
               or bool(getattr(offload, "offload_params", False)))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    plan = fsdp_plan(strategy, world_size=world, ranks_per_node=per_node, cpu_offload=offload,
                     source=f"accelerate's FullyShardedDataParallelPlugin ({getattr(strategy, 'name', strategy)})",
                     **options)
    return _with_context_parallel(plan, getattr(state, "parallelism_config", None))


def _with_context_parallel(plan: ParallelPlan, config: Any) -> ParallelPlan:
    """``plan`` with the ring accelerate's ``ParallelismConfig`` asks for (``cp_size`` > 1, torch's backend, its
    ``cp_handler.cp_comm_strategy``), as `preflight.parallel.CPPlan` over FSDP2 (accelerate shards over
    ``dp_shard_cp``, the ring innermost). Where the trace does not follow it (with tensor parallelism, HSDP or
    offloading) the plan is left without the ring and its source says so: each rank then holds the whole sequence's
    activations in the trace, more than a rank of the ring holds."""
    cp_size = getattr(config, "cp_size", None)
    if not isinstance(cp_size, int) or cp_size < 2 or getattr(config, "cp_backend", "torch") not in (None, "torch"):
        return plan
    from preflight.parallel._context import CPPlan

    rotate = getattr(getattr(config, "cp_handler", None), "cp_comm_strategy", None) or "allgather"
    try:
        return dataclasses.replace(plan, cp=CPPlan(cp_size, rotate),
                                   source=f"{plan.source}, accelerate's ParallelismConfig(cp_size={cp_size})")
    except ValueError as err:
        return dataclasses.replace(plan, source=f"{plan.source}; accelerate's context parallelism (cp_size={cp_size}) "
                                                f"is not traced here ({err}): each rank planned with whole sequences, "
                                                "more activations than a rank of the ring holds")


def read_ddp(model: Any) -> tuple[Any, ParallelPlan] | None:
    """The module a ``DistributedDataParallel`` wraps and the plan the wrapper runs (``"ddp"`` over its process
    group's ranks, with its ``gradient_as_bucket_view``), or None for any other model. A DDP model is itself a
    description of the run's parallel section: its buckets hold a flat copy of every gradient on each rank."""
    from torch import nn

    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return None
    world = dist.get_world_size(model.process_group) if dist.is_available() and dist.is_initialized() else 1
    return model.module, ParallelPlan(world, "ddp", source="the model's DistributedDataParallel",
                                      gradient_as_bucket_view=bool(model.gradient_as_bucket_view))


def already_sharded(model: Any) -> str | None:
    """What says that ``model``'s parameters are already one rank's shards (the strategy wrapped it before
    preflight saw it), or None: DTensor parameters (FSDP2, ``fully_shard``), FSDP1's flat parameters or wrappers,
    DeepSpeed ZeRO-3's partitioned parameters (``ds_numel``). The plan of an FSDP2 or FSDP1 wrapping is then read
    off the model (`read_fsdp2`, `read_fsdp1`) and each rank traced; ZeRO-3's model is read back unpartitioned
    (`read_zero`) and rescaled."""
    for name, p in model.named_parameters():
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
            return f"parameter {name!r} is a DTensor (FSDP2)"
        if getattr(p, "_is_flat_param", False):
            return f"parameter {name!r} is an FSDP flat parameter"
        if hasattr(p, "ds_numel"):
            return f"parameter {name!r} is partitioned by DeepSpeed ZeRO-3"
    for module in model.modules():
        if type(module).__name__ == "FullyShardedDataParallel":
            return "a submodule is wrapped in FullyShardedDataParallel"
    if getattr(model, "_is_fsdp_managed_module", False):  # a wrapper holds it (its parameters are views of shards)
        return "the model is held by a FullyShardedDataParallel wrapper"
    return None


def _load(config: Mapping[str, Any] | str | os.PathLike) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    text = os.fspath(config)
    if os.path.isfile(text):
        with open(text) as f:
            text = f.read()
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"DeepSpeed config {os.fspath(config)!r} is neither a file nor JSON text ({err}).") from None
    if not isinstance(loaded, Mapping):
        raise ValueError(f"DeepSpeed config should be a JSON object, got {type(loaded).__name__}.")
    return loaded


def _check_world(world_size: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size` should be a positive integer, got {world_size!r}.")
