"""A model and optimizer DeepSpeed has already taken over, read back as the unpartitioned model and torch optimizer
that `preflight.estimate` predicts a ZeRO rank from.

By the time a trainer's callback runs, ``deepspeed.initialize`` has replaced the user's objects (Lightning's
``DeepSpeedStrategy`` and the HF Trainer both initialize before training starts):

- the optimizer is DeepSpeed's ZeRO optimizer (``DeepSpeedZeroOptimizer`` for stages 1 and 2,
  ``DeepSpeedZeroOptimizer_Stage3``; accelerate wraps it once more), whose inner torch optimizer steps flat fp32
  partitions instead of the model's parameters. The model's parameters of each of its groups are listed in the
  same order as the inner optimizer's groups (``bit16_groups``, ``fp16_groups``), so a stand-in optimizer of the
  inner class and hyperparameters is rebuilt over them;
- at stage 3 every parameter is partitioned: its tensor is empty, its shape is ``ds_shape`` and this rank's
  partition ``ds_tensor`` (``partition_parameters.py``), and every module carries DeepSpeed's hooks, which gather
  parameters over the job's process group when the module runs.

`read_zero` gives a stand-in model (the same modules, copied as `preflight.parallel.fake_replica` copies them, with
every parameter a meta tensor of its unpartitioned shape and DeepSpeed's hooks left out; buffers, which ZeRO does
not partition, are the model's own) and a stand-in optimizer. `preflight.estimate` then traces the replica and
rescales it to the rank under the run's DeepSpeed config, as before the job. Nothing of the user's is changed: the
real model, its partitions and DeepSpeed's state are only read. `held_tensors` lists what DeepSpeed itself holds
on the rank (partitions, flat buffers), for the verification's measured resident bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from preflight.trace._twin import clone_optimizer

__all__ = ["WrappedZero", "deepspeed_optimizer", "held_tensors", "read_zero", "zero_plan"]


@dataclasses.dataclass(frozen=True)
class WrappedZero:
    """What DeepSpeed ZeRO made of the user's model and optimizer (`read_zero`).

    Attributes:
        model: the unpartitioned stand-in model (meta parameters, no DeepSpeed hooks) the estimate traces.
        optimizer: the stand-in torch optimizer over ``model``'s parameters (the inner optimizer's class and group
            hyperparameters, or the plain optimizer's over a partitioned model); None when none was given.
        stage: the ZeRO stage read off the objects (1, 2 or 3), or None where it cannot be told (stage 1 and 2
            share DeepSpeed's optimizer class; ``partition_gradients`` tells them apart).
        world_size: the ranks the state is partitioned over (the optimizer's ``partition_count``), or None.
        notes: what was substituted, for the coverage notes.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    stage: int | None
    world_size: int | None
    notes: tuple[str, ...] = ()

    def note(self) -> str:
        """The coverage note: what was read back from DeepSpeed's objects."""
        stage = f"ZeRO stage {self.stage}" if self.stage is not None else "ZeRO"
        over = f" over {self.world_size} rank(s)" if self.world_size else ""
        return "; ".join((f"read back from DeepSpeed {stage}{over}: the unpartitioned model and the inner "
                          "optimizer are traced and the rank's share rescaled from them", *self.notes))


def deepspeed_optimizer(optimizer: Any) -> Any:
    """DeepSpeed's ZeRO optimizer inside ``optimizer`` (accelerate's ``DeepSpeedOptimizerWrapper`` holds it as
    ``.optimizer``), or None when there is none."""
    for _ in range(4):  # wrappers of wrappers, a few deep at most
        if optimizer is None:
            return None
        if type(optimizer).__module__.startswith("deepspeed.") and hasattr(optimizer, "optimizer") and \
                any(hasattr(optimizer, k) for k in ("bit16_groups", "fp16_groups", "bf16_groups")):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def _partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_shape") and hasattr(p, "ds_tensor")


def read_zero(model: nn.Module, optimizer: Any) -> WrappedZero | None:
    """The stand-in model and optimizer of a model and optimizer DeepSpeed ZeRO has taken over (module docstring),
    or None when neither is DeepSpeed's.

    Raises:
        ValueError: DeepSpeed's optimizer groups do not line up with the inner optimizer's, or the inner optimizer
            cannot be rebuilt over the stand-in's parameters (the message says which).

    Example (inside a DeepSpeed job):
        >>> zero = read_zero(trainer.model, trainer.optimizer)          # doctest: +SKIP
        >>> run = preflight.Run(parallel=zero_plan(zero, None))             # doctest: +SKIP
        >>> preflight.estimate(zero.model, zero.optimizer, batch, run)       # doctest: +SKIP
    """
    from preflight.parallel._rank import MetaTwins, fake_replica

    ds_opt = deepspeed_optimizer(optimizer)
    partitioned = any(_partitioned(p) for p in model.parameters())
    if ds_opt is None and not partitioned:
        return None
    params: dict[int, nn.Parameter] = {}
    replica = fake_replica(model, MetaTwins(), keep_buffers=True, params=params)
    stage = 3 if partitioned or hasattr(ds_opt, "fp16_partitioned_groups_flat") else None
    if stage is None and ds_opt is not None and hasattr(ds_opt, "partition_gradients"):
        stage = 2 if ds_opt.partition_gradients else 1
    count = getattr(ds_opt, "partition_count", None)
    world = count[0] if isinstance(count, (list, tuple)) and count else count
    notes: list[str] = []
    if optimizer is None:  # the model alone (evaluation)
        stand_in = None
    elif ds_opt is None:  # a partitioned model with an optimizer DeepSpeed does not hold (a plain one)
        stand_in = _rebuilt(optimizer, [list(g["params"]) for g in optimizer.param_groups], params, notes)
    else:
        inner = ds_opt.optimizer
        groups = _groups(ds_opt, stage, len(inner.param_groups))
        stand_in = _rebuilt(inner, groups, params, notes)
    return WrappedZero(replica, stand_in, stage, int(world) if isinstance(world, int) else None, tuple(notes))


def _groups(ds_opt: Any, stage: int | None, count: int) -> list[list[torch.Tensor]]:
    """The model's parameters of each of the inner optimizer's ``count`` groups. Stage 3 lists them by sub-group
    (``fp16_groups``: a group split by ``sub_group_size`` or by process group, a group without trainable
    parameters left out), each sub-group's group in ``sub_group_to_group_id`` (``stage3.py
    _create_fp16_sub_groups``); stages 1 and 2 one list per group (``bit16_groups``)."""
    if hasattr(ds_opt, "bf16_groups") and not hasattr(ds_opt, "bit16_groups"):
        raise ValueError(f"DeepSpeed's {type(ds_opt).__name__} (bf16 parameters with fp32 gradient accumulation at "
                         "ZeRO stage 1) keeps fp32 gradients of its own, which are not modelled.")
    if stage == 3:
        owner = getattr(ds_opt, "sub_group_to_group_id", None)
        subs = getattr(ds_opt, "fp16_groups", None) or []
        if owner is None or len(owner) != len(subs) or any(not 0 <= owner[i] < count for i in range(len(subs))):
            raise ValueError(f"DeepSpeed's {type(ds_opt).__name__} does not say which of its inner optimizer's "
                             f"{count} group(s) each of its {len(subs)} parameter sub-group(s) belongs to.")
        groups: list[list[torch.Tensor]] = [[] for _ in range(count)]
        for i, sub in enumerate(subs):
            groups[owner[i]].extend(sub)
        return groups
    groups = getattr(ds_opt, "bit16_groups", None)
    if groups is None or len(groups) != count:
        raise ValueError(f"DeepSpeed's optimizer ({type(ds_opt).__name__}) lists {len(groups or ())} parameter "
                         f"group(s) of the model, its inner optimizer {count}: the inner optimizer cannot be mapped "
                         "back to the model's parameters.")
    return list(groups)


def _rebuilt(inner: torch.optim.Optimizer, groups: list[list[torch.Tensor]], params: dict[int, nn.Parameter],
             notes: list[str]) -> torch.optim.Optimizer:
    """``inner``'s class and group hyperparameters over the stand-in parameters of ``groups`` (the model's
    parameters, by identity): a torch optimizer cloned with its defaults and constructor options (`clone_optimizer`;
    bitsandbytes' bits), without its state (held for DeepSpeed's flat partitions); DeepSpeed's own kernels as the
    torch optimizer holding the same state."""
    cls = type(inner)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    if not issubclass(cls, torch.optim.Optimizer) or cls.__module__.startswith("deepspeed."):
        # DeepSpeed's own kernels, as the torch optimizer holding the same state per parameter: FusedAdam /
        # DeepSpeedCPUAdam / FusedLamb two moments (Adam, AdamW), the Adagrad ones a sum, the Lion ones one moment
        # (SGD's momentum buffer).
        name = type(inner).__name__
        if "Adagrad" in name:
            cls, keep = torch.optim.Adagrad, {"lr", "eps", "weight_decay"}
        elif "Lion" in name:
            cls, keep = torch.optim.SGD, {"lr", "weight_decay"}
            hyper = [{**h, "momentum": 0.9} for h in hyper]
        else:
            cls = torch.optim.AdamW if getattr(inner, "adam_w_mode", True) else torch.optim.Adam
            keep = {"lr", "betas", "eps", "weight_decay", "amsgrad"}
        hyper = [{k: v for k, v in h.items() if k in keep | {"momentum"}} for h in hyper]
        notes.append(f"DeepSpeed's {name} is traced as torch.optim.{cls.__name__} (the same state per parameter)")
    missing = [p for g in groups for p in g if id(p) not in params]
    if missing:
        raise ValueError(f"DeepSpeed's optimizer holds {len(missing)} tensor(s) that are not the model's parameters "
                         f"(the first of shape {tuple(getattr(missing[0], 'ds_shape', missing[0].shape))}): the inner "
                         "optimizer cannot be mapped back to the model.")
    try:
        if cls is type(inner):  # a torch optimizer: its defaults and constructor options (bitsandbytes' bits) kept
            return clone_optimizer(inner, None, foreach=None, keep_state=False, param_groups=[
                (i, [params[id(p)] for p in g]) for i, g in enumerate(groups) if g])
        return cls([{**h, "params": [params[id(p)] for p in g]} for h, g in zip(hyper, groups) if g])
    except Exception as err:  # noqa: BLE001 - any constructor's refusal is reported with the class named
        raise ValueError(f"{cls.__name__} could not be rebuilt over the model's unpartitioned parameters "
                         f"({type(err).__name__}: {err}).") from err


def held_tensors(model: nn.Module, optimizer: Any) -> list[torch.Tensor]:
    """The tensors DeepSpeed holds on this rank beside the model's own: each ZeRO-3 parameter's partition
    (``ds_tensor``), and the tensors its ZeRO optimizer keeps in its attributes (flat fp32 partitions, gradient
    partitions, reduction buffers; in lists, dicts and DeepSpeed's own objects below it) and its inner optimizer's
    state. Empty
    when DeepSpeed holds none. For the verification, which counts what is resident when a step begins."""
    held = [p.ds_tensor for p in model.parameters() if _partitioned(p) and isinstance(p.ds_tensor, torch.Tensor)]
    ds_opt = deepspeed_optimizer(optimizer)
    if ds_opt is None:
        return held
    for value in vars(ds_opt).values():
        held.extend(_tensors(value, depth=2))
    for state in ds_opt.optimizer.state.values():
        held.extend(_tensors(state, depth=1))
    return held


def _tensors(value: Any, depth: int) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth <= 0:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v, depth - 1)]
    if type(value).__module__.startswith("deepspeed.") and hasattr(value, "__dict__"):  # its buckets' holders
        return [t for v in vars(value).values() for t in _tensors(v, depth - 1)]
    return []


def zero_plan(zero: WrappedZero, plan: Any) -> Any:
    """The `ParallelPlan` a read-back model is predicted under: the trainer's DeepSpeed plan (its config), with the
    stage and world size DeepSpeed's objects show where they show them (accelerate's state on CPU processes counts
    one process, the ZeRO optimizer its real partition count); without a DeepSpeed plan, the stage read off the
    objects at DeepSpeed's default settings, which the note says."""
    from preflight.parallel._strategies import deepspeed_plan

    world = zero.world_size or (plan.world_size if plan is not None else None) or _job_world_size()
    if plan is not None and plan.deepspeed is not None:
        config = dict(plan.deepspeed)
        section = dict(config.get("zero_optimization") or {})
        if zero.stage is not None and section.get("stage") != zero.stage:
            config["zero_optimization"] = {**section, "stage": zero.stage}
        return deepspeed_plan(config, world_size=world, source=plan.source)
    stage = zero.stage if zero.stage is not None else 2
    return deepspeed_plan({"zero_optimization": {"stage": stage}}, world_size=world,
                          source=f"DeepSpeed's objects (ZeRO stage {stage}; the run's config was not found, so "
                                 "DeepSpeed's defaults size its buffers)")


def _job_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
