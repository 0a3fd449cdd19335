"""`Checkpoint`: how a run saves its checkpoints, the checkpoint section of a `preflight.Run`, and `collect_state`,
the one definition of what a save gathers on the device, run by the trace (on fake tensors, as the phase
``save``) and by a real measurement alike.

What a save holds on the device, read from the engines' source (torch 2.13):

- **One device, DDP, tensor-free serialisation.** ``model.state_dict()`` and ``optimizer.state_dict()`` return the
  live tensors (detached views, no copy). ``torch.save`` copies each storage to the host as it writes it
  (``torch/serialization.py``: ``storage.cpu()``), safetensors likewise (``_tobytes``: ``tensor.to("cpu")``); on the
  CPU both write from the storage itself (measured: ``torch.save`` of a model's and an AdamW's state dicts, and
  transformers' ``save_pretrained``, allocate no tensor on the CPU). The save's device peak is the training state
  alive when it runs, which the trace's last step leaves.
- **FSDP1** ``FULL_STATE_DICT`` (``torch/distributed/fsdp/_state_dict_utils.py``): each unit's flat parameter is
  gathered whole while the unit's entries are cloned, an outer unit staying gathered while its inner ones are; with
  ``offload_to_cpu`` the gathered parameter is moved to the host first (``FlatParamHandle.to_cpu``), so the clones
  are host memory, and with ``rank0_only`` the other ranks clone nothing. ``SHARDED_STATE_DICT``: each rank's own
  shards. ``FSDP.optim_state_dict`` gathers every parameter's optimizer state whole on rank 0 (every rank without
  ``rank0_only``) through one buffer of the flat parameter's padded size per unit
  (``_optim_utils._allgather_orig_param_states``), a sharded one too (then cut again); it merges which ranks hold
  which state with ``all_gather_object``, which a one-rank trace answers as if every rank were this one
  (`answered_object_collectives`, `every_parameter_in_state`).
- **FSDP2 and DTensor models** (``torch.distributed.checkpoint.state_dict``, what accelerate, Lightning's
  ``ModelParallelStrategy`` and torchtitan call): ``full_state_dict`` gathers each DTensor whole
  (``full_tensor()``), moved to the host with ``cpu_offload`` and then kept by rank 0 alone; without it every rank
  keeps every full tensor. A sharded state dict is each rank's own shards.

- **DeepSpeed** (a ZeRO plan, whose partitioned model is not traced): counted from DeepSpeed's source after the
  rescaled steps (`preflight.parallel._deepspeed.deepspeed_save`): ``"full"`` is the HF Trainer's ``save_model``
  (ZeRO-3's 16-bit gather when the config asks for it, ZeRO-1/2's clone of the state dict), ``"sharded"`` each
  rank's partitions alone (Lightning's ``DeepSpeedStrategy``).

Host memory is not device memory: on a CUDA target the trace runs on CPU tensors, where a copy to the host cannot
be told from the device, so the entries a save made and moved to the host (``offload_to_cpu``) are taken off the
device figure (`preflight.trace`'s save phase does it), and the note says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import nn

__all__ = ["STATE_DICTS", "Checkpoint", "answered_object_collectives", "collect_state",
           "engine_of", "every_parameter_in_state"]

STATE_DICTS = ("full", "sharded")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """How the run saves checkpoints: the checkpoint section of a `preflight.Run`. A `Run` without one predicts no
    save; the callbacks fill it from the trainer (the HF Trainer's ``save_strategy``, Lightning's ``ModelCheckpoint``).

    Attributes:
        optimizer: the optimizer's state is saved with the model (False: weights only, the HF Trainer's
            ``save_only_model``, Lightning's ``save_weights_only``).
        state_dict: under FSDP or tensor parallelism, ``"full"`` (``FULL_STATE_DICT``, ``full_state_dict=True``:
            the whole model gathered, Lightning's ``FSDPStrategy`` default and accelerate's FSDP1 default) or
            ``"sharded"`` (each rank saves its own shards: ``SHARDED_STATE_DICT``, distributed checkpoint). Under
            DeepSpeed, ``"full"`` is the HF Trainer's save (the model consolidated as DeepSpeed does it, whatever
            the two options below say) and ``"sharded"`` the partitions alone. Ignored on one device.
        offload_to_cpu: a full state dict is gathered into host memory (FSDP1's ``offload_to_cpu``, DCP's
            ``cpu_offload``), as accelerate and Lightning save on more than one rank; False keeps it on the device.
        rank0_only: with a full state dict, only rank 0 keeps it (FSDP1's ``rank0_only``; DCP keeps it on rank 0
            alone exactly when it offloads).
    """

    optimizer: bool = True
    state_dict: str = "full"
    # accelerate's and Lightning's full state dicts on several ranks: FullStateDictConfig(offload_to_cpu=True,
    # rank0_only=True).
    offload_to_cpu: bool = True
    rank0_only: bool = True

    def __post_init__(self) -> None:
        if self.state_dict not in STATE_DICTS:
            raise ValueError(f"`Checkpoint.state_dict` should be one of {STATE_DICTS}, got {self.state_dict!r}.")
        for name in ("optimizer", "offload_to_cpu", "rank0_only"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`Checkpoint.{name}` should be True or False, got {getattr(self, name)!r}.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def engine_of(model: nn.Module) -> str:
    """How ``model``'s state is gathered: ``"fsdp1"`` (a ``FullyShardedDataParallel`` inside), ``"dcp"`` (FSDP2 or
    DTensor parameters: torch's distributed ``state_dict`` API) or ``"plain"``."""
    for module in model.modules():
        if type(module).__name__ == "FullyShardedDataParallel":
            return "fsdp1"
    for p in model.parameters():
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
            return "dcp"
    return "plain"


def collect_state(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Checkpoint, *,
                  host_is_device: bool) -> dict[str, Any]:
    """What a save gathers before it serialises, as the run's engine gathers it (module docstring): ``{"model":
    state dict, "optimizer": state dict}``; the caller holds it for as long as the save would.

    ``host_is_device``: the run's device is the CPU, where moving a tensor "to the CPU" moves nothing (FSDP1's
    ``offload_to_cpu`` is then not asked for: on CPU tensors it frees the storage its own views read, and the real
    CPU run crashes; DCP's ``cpu_offload`` still decides which ranks keep a full state dict).
    """
    engine = engine_of(model)
    if engine == "fsdp1":
        return _fsdp1_state(model, optimizer, checkpoint, host_is_device)
    if engine == "dcp":
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=checkpoint.state_dict == "full",
                                   cpu_offload=checkpoint.offload_to_cpu)
        held = {"model": get_model_state_dict(model, options=options)}
        if checkpoint.optimizer:
            held["optimizer"] = get_optimizer_state_dict(model, optimizer, options=options)
        return held
    held = {"model": model.state_dict()}
    if checkpoint.optimizer:
        held["optimizer"] = optimizer.state_dict()
    return held


def _fsdp1_state(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Checkpoint,
                 host_is_device: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, ShardedOptimStateDictConfig,
                                        ShardedStateDictConfig, StateDictType)

    offload = checkpoint.offload_to_cpu and not host_is_device
    if checkpoint.state_dict == "full":
        kind = StateDictType.FULL_STATE_DICT
        config = FullStateDictConfig(offload_to_cpu=offload, rank0_only=checkpoint.rank0_only)
        optim_config = FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=checkpoint.rank0_only)
    else:
        kind = StateDictType.SHARDED_STATE_DICT
        config = ShardedStateDictConfig(offload_to_cpu=offload)
        optim_config = ShardedOptimStateDictConfig(offload_to_cpu=offload)
    root = model if isinstance(model, FSDP) else next(m for m in model.modules() if isinstance(m, FSDP))
    with FSDP.state_dict_type(root, kind, config, optim_config):
        held = {"model": root.state_dict()}
        if checkpoint.optimizer:
            held["optimizer"] = FSDP.optim_state_dict(root, optimizer)
    return held


def every_parameter_in_state(optimizer: torch.optim.Optimizer) -> None:
    """Give each trained parameter of ``optimizer`` that has no state an empty one (every state tensor with no
    elements, the scalars as another parameter has them), so that a one-rank trace of ``FSDP.optim_state_dict`` can
    run: FSDP1 with ``use_orig_params`` merges the parameters every rank holds state for (``all_gather_object``,
    ``_optim_utils._map_param_key_to_optim_keys``), and a parameter whose shard is empty on this rank has none
    here. Every rank answered as this one (`answered_object_collectives`) then names every parameter, and the
    gathers run at the flat parameters' own sizes, which decide the memory. Zero bytes are added; for the trace's own
    optimizer only."""
    template = next((s for s in optimizer.state.values() if s), None)
    if template is None:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and not optimizer.state.get(p):
                optimizer.state[p] = {k: torch.empty(0, dtype=v.dtype, device=v.device)
                                      if isinstance(v, torch.Tensor) and v.dim() > 0 else v  # scalars shared
                                      for k, v in template.items()}


@contextlib.contextmanager
def answered_object_collectives() -> Any:
    """``all_gather_object`` and ``broadcast_object_list`` answered in a one-rank trace's fake world: every rank's
    object is taken to be this rank's, the same object (a fake group carries no data to unpickle; the objects hold
    fake tensors, which are not copied). Put back on exit."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
        for i in range(len(object_list)):
            object_list[i] = obj

    def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None, **_: Any) -> None:
        return None  # every rank holds what the source holds: the list stays as this rank has it

    saved = [(owner, name, getattr(owner, name)) for owner in (dist, c10d)
             for name in ("all_gather_object", "broadcast_object_list")]
    for owner, name, _ in saved:
        setattr(owner, name, all_gather_object if name == "all_gather_object" else broadcast_object_list)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
