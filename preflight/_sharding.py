"""Per-rank memory under data-parallel sharding (DDP, DeepSpeed ZeRO 1/2/3, FSDP), as arithmetic on byte counts.

Nothing here traces a model: `model_state_bytes` applies the ZeRO paper's formulas to a parameter count,
`shard_breakdown` turns a single-GPU breakdown (a traced peak's bytes per category) into one rank's,
`read_deepspeed_config` reads the options of a DeepSpeed config that change memory, and `zero_buffers` sizes
ZeRO's gradient reduction buffers from them.

Sources:
    * ZeRO: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
      arXiv:1910.02054. Sec 3.1: mixed-precision Adam keeps 2 bytes of fp16 parameters and 2 of fp16
      gradients per parameter, plus K = 12 bytes of optimizer state (fp32 parameters, momentum, variance).
      Sec 5.1-5.3 and Figure 1, per rank with N_d ranks: baseline (2 + 2 + K)Ψ; P_os 4Ψ + KΨ/N_d;
      P_os+g 2Ψ + (2 + K)Ψ/N_d; P_os+g+p (2 + 2 + K)Ψ/N_d.
    * FSDP: ``torch.distributed.fsdp.ShardingStrategy`` (FULL_SHARD: parameters, gradients and optimizer
      state sharded, parameters gathered per wrapped unit for forward and backward; SHARD_GRAD_OP:
      gradients and optimizer state sharded, parameters sharded only outside forward/backward) and
      ``CPUOffload`` ("If True, then this offloads gradients to CPU as well, meaning that the optimizer step
      runs on CPU").
    * DDP: ``torch.nn.parallel.DistributedDataParallel``, ``gradient_as_bucket_view``: "the saved memory
      size will be equal to the total gradients size"; the reducer allocates one flat ``gradients`` tensor
      per bucket (``Reducer::initialize_buckets``, torch/csrc/distributed/c10d/reducer.cpp).
    * DeepSpeed: ``DeepSpeedZeroConfig`` and the offload configs (deepspeed/runtime/zero/config.py,
      offload_config.py): ``offload_param`` "Valid only with stage 3", ``offload_optimizer`` "Valid for
      ZeRO stage 1, 2, 3". Gradient reduction buffers (DeepSpeed 0.19.8): with ``contiguous_gradients``, stages 1
      and 2 allocate ``reduce_bucket_size`` elements per gradient dtype at the start of each backward, twice with
      ``overlap_comm``, and release them when the backward's reduction ends (stage_1_and_2.py ``setup_buckets``,
      ``_release_ipg_buffers``); stage 3 allocates one per dtype when the optimizer is built and keeps it
      (stage3.py). Their dtype is the gradient accumulation dtype, by default the model's (bf16 or fp16 when
      enabled). ZeRO-3's own terms (fp32 partition copy, gradient partitions, persistent and gathered parameters):
      `zero3_terms`. Measured on CPU processes: ``benchmarks/deepspeed_cpu.py``.

Known limitations (all functions):
    * Sharded bytes are rounded up to a whole share per rank (FSDP pads flat parameters to a multiple of the
      world size); per-tensor padding and alignment are not modelled.
    * Communication buffers other than ZeRO's gradient reduction buffers and ZeRO-3's gathered parameters
      (`zero3_terms`) are not counted: NCCL's own buffers, the reduce-scatter copy of a full bucket, stage 1 and
      2's all-gather of updated parameters, FSDP's unsharded gradient of the unit being reduce-scattered (a per-rank
      trace has that one, `preflight.parallel`). ``data_types.grad_accum_dtype`` is not read (its default, the
      model's dtype, is assumed).
    * DeepSpeed ZeRO-Offload also moves the gradient partitions to CPU; here they stay on the GPU, which
      over-estimates by the sharded gradient bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

__all__ = ["SHARDED_STATES", "SHARDING_CHOICES", "ShardedState", "Zero3Terms", "ZeroBuffers", "hf_hidden_size",
           "model_state_bytes", "read_deepspeed_config", "shard_breakdown", "zero3_consolidation", "zero3_terms",
           "zero_buffers"]

SHARDING_CHOICES = ("ddp", "zero1", "zero2", "zero3", "fsdp-full", "fsdp-grad-op", "fsdp2")

# Which model states each choice partitions across ranks (ZeRO paper Sec 5; FSDP ShardingStrategy).
SHARDED_STATES: dict[str, frozenset[str]] = {
    "ddp": frozenset(),
    "zero1": frozenset({"optimizer_state"}),
    "zero2": frozenset({"optimizer_state", "gradients"}),
    "zero3": frozenset({"optimizer_state", "gradients", "parameters"}),
    "fsdp-full": frozenset({"optimizer_state", "gradients", "parameters"}),  # FULL_SHARD
    "fsdp-grad-op": frozenset({"optimizer_state", "gradients"}),  # SHARD_GRAD_OP: parameters whole in fwd/bwd
    # FSDP2 (fully_shard): traced per rank by `preflight.parallel`; rescaled as FULL_SHARD where it cannot be traced.
    "fsdp2": frozenset({"optimizer_state", "gradients", "parameters"}),
}
_FSDP = frozenset({"fsdp-full", "fsdp-grad-op", "fsdp2"})
_BREAKDOWN_KEYS = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries", "inputs")
# Only a traced sharded step has it (`preflight.parallel`); a single-device breakdown's is 0 and stays per rank.
_OPTIONAL_KEYS = ("communication",)


@dataclasses.dataclass(frozen=True)
class ShardedState:
    """Model-state bytes held on the GPU by one rank.

    Attributes:
        parameters: parameter bytes on the GPU between steps (0 when offloaded).
        gradients: gradient bytes on the GPU after backward.
        optimizer_state: optimizer-state bytes on the GPU (0 when offloaded).
    """

    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        """``parameters + gradients + optimizer_state``."""
        return self.parameters + self.gradients + self.optimizer_state

    def to_dict(self) -> dict[str, int]:
        """A JSON-ready dict with ``total``."""
        return {**dataclasses.asdict(self), "total": self.total}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` should be an integer >= {minimum}, got {value!r}.")


def _check_options(world_size: int, sharding: str, offload_optimizer: bool, offload_params: bool) -> None:
    _check_int("world_size", world_size, 1)
    if sharding not in SHARDING_CHOICES:
        raise ValueError(f"`sharding` should be one of {', '.join(SHARDING_CHOICES)}; got {sharding!r}.")
    for name, flag in (("offload_optimizer", offload_optimizer), ("offload_params", offload_params)):
        if not isinstance(flag, bool):
            raise ValueError(f"`{name}` should be True or False, got {flag!r}.")
    if offload_params and sharding not in ("zero3", "fsdp-full", "fsdp2"):
        raise ValueError(
            f"offload_params=True needs full parameter sharding, got sharding={sharding!r}. DeepSpeed offloads "
            "parameters only with ZeRO stage 3 (`offload_param`), and preflight models FSDP parameter offload "
            "only with FULL_SHARD. Use sharding='zero3' or 'fsdp-full', or set offload_params=False."
        )
    if offload_optimizer and sharding == "ddp":
        raise ValueError(
            "offload_optimizer=True is not available with sharding='ddp': DDP keeps the optimizer on the GPU. "
            "Use a DeepSpeed stage ('zero1', 'zero2', 'zero3'; `offload_optimizer` in its config) "
            "or set offload_optimizer=False."
        )
    if offload_optimizer and sharding in _FSDP and not offload_params:
        raise ValueError(
            f"FSDP offloads the optimizer state only together with the parameters (CPUOffload(offload_params=True)), "
            f"got sharding={sharding!r} with offload_optimizer=True and offload_params=False. "
            "Set offload_params=True (with sharding='fsdp-full'), or use a DeepSpeed stage ('zero1', 'zero2', 'zero3')."
        )


def model_state_bytes(
    num_params: int,
    *,
    world_size: int,
    sharding: str,
    param_bytes: int = 2,  # fp16/bf16 parameters, the ZeRO paper's mixed-precision setting (Sec 3.1)
    grad_bytes: int = 2,  # gradients in the parameters' dtype
    optimizer_state_bytes_per_param: int = 12,  # ZeRO's K for mixed-precision Adam: fp32 copy, momentum, variance
    offload_optimizer: bool = False,
    offload_params: bool = False,
) -> ShardedState:
    """Per-rank model-state bytes (parameters, gradients, optimizer state) under data-parallel sharding.

    Each sharded state holds ``ceil(num_params / world_size)`` parameters' worth of bytes per rank; the
    others are replicated. zero1 shards the optimizer state, zero2 and fsdp-grad-op also the gradients,
    zero3 and fsdp-full also the parameters (ZeRO paper, Sec 5.1-5.3). With ``offload_optimizer`` the
    optimizer state lives on the CPU (DeepSpeed ``offload_optimizer``; for FSDP only together with
    ``offload_params``). With ``offload_params`` the parameter shards live on the CPU (DeepSpeed stage 3
    ``offload_param``); under FSDP that also moves gradients and optimizer state to the CPU (``CPUOffload``).

    Args:
        num_params: number of trainable parameters. Frozen ones have no gradient or optimizer state: count
            them in a second call with ``grad_bytes=0, optimizer_state_bytes_per_param=0`` and add the two.
        world_size: data-parallel ranks sharing the states.
        sharding: one of `SHARDING_CHOICES`.
        param_bytes: bytes per parameter as stored on the GPU.
        grad_bytes: bytes per gradient element.
        optimizer_state_bytes_per_param: optimizer-state bytes per parameter, including any fp32 master copy.
        offload_optimizer: the optimizer state is on the CPU.
        offload_params: the parameter shards are on the CPU.

    Returns:
        A `ShardedState`; its ``total`` is one rank's model-state bytes.

    Raises:
        ValueError: an unknown ``sharding``, a non-positive ``world_size``, negative sizes, or an offload
            combination the frameworks do not offer.

    Example:
        ZeRO paper Figure 1, 7.5B parameters on 64 GPUs with P_os+g:

        >>> model_state_bytes(7_500_000_000, world_size=64, sharding="zero2").total / 1e9
        16.640625

    Known limitations: the states between steps only; gathered parameters, activations and communication
    buffers are not model states (see `shard_breakdown` and the module docstring).
    """
    _check_options(world_size, sharding, offload_optimizer, offload_params)
    _check_int("num_params", num_params, 0)
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("optimizer_state_bytes_per_param", optimizer_state_bytes_per_param)):
        _check_int(name, value, 0)
    sharded = SHARDED_STATES[sharding]
    share = _ceil_div(num_params, world_size)

    def held(state: str, per_param: int) -> int:
        return (share if state in sharded else num_params) * per_param

    parameters = held("parameters", param_bytes)
    gradients = held("gradients", grad_bytes)
    optimizer_state = held("optimizer_state", optimizer_state_bytes_per_param)
    if offload_optimizer:
        optimizer_state = 0
    if offload_params:
        parameters = 0
        if sharding in _FSDP:  # CPUOffload(offload_params=True): gradients and the optimizer step go to CPU too
            gradients = optimizer_state = 0
    return ShardedState(parameters=parameters, gradients=gradients, optimizer_state=optimizer_state)


def shard_breakdown(
    breakdown: dict[str, int],
    *,
    world_size: int,
    sharding: str,
    largest_unit_param_bytes: int = 0,  # 0: unknown, so the whole model is taken as one unit (an upper bound)
    offload_optimizer: bool = False,
    offload_params: bool = False,
    ddp_bucket_bytes: int = 25 * 2**20,  # DDP's default bucket_cap_mb=25
    gradient_as_bucket_view: bool = False,  # DDP's default
) -> dict[str, int]:
    """Turn a single-GPU breakdown into one rank's under data-parallel sharding.

    Starting from the bytes per category at the single-GPU peak (keys ``parameters``, ``buffers``,
    ``gradients``, ``optimizer_state``, ``activations``, ``temporaries``, ``inputs``, traced with the per-rank
    micro-batch):

    * ``zero1`` divides ``optimizer_state`` by ``world_size``; ``zero2`` and ``fsdp-grad-op`` also
      ``gradients``; ``zero3`` and ``fsdp-full`` also ``parameters`` (ZeRO paper Sec 5; FSDP
      ``ShardingStrategy``). Shares round up.
    * ``zero3`` / ``fsdp-full`` gather each wrapped unit's parameters for its forward and backward and
      prefetch the next unit's, so ``temporaries`` gains ``2 * largest_unit_param_bytes``, capped at the
      unsharded ``parameters``. With ``largest_unit_param_bytes=0`` the whole model is taken as one unit
      (FSDP without an auto-wrap policy), which bounds DeepSpeed ZeRO-3's gathers from above too.
    * ``ddp`` without ``gradient_as_bucket_view`` keeps a flat copy of every gradient in its buckets, so
      ``gradients`` doubles (DDP docs: the view "saved memory size will be equal to the total gradients
      size"). The buckets together hold each gradient once whatever their cap, so ``ddp_bucket_bytes``
      does not change the total; it is checked and kept for callers that pass DDP's settings through.
    * ``offload_optimizer`` zeroes ``optimizer_state``; ``offload_params`` zeroes ``parameters`` (the gathered
      units stay in ``temporaries``) and, under FSDP, ``gradients`` and ``optimizer_state`` too.
    * ``buffers``, ``activations`` and ``inputs`` are replicated and unchanged.

    Args:
        breakdown: single-GPU bytes per category, all seven keys.
        world_size: data-parallel ranks.
        sharding: one of `SHARDING_CHOICES`.
        largest_unit_param_bytes: unsharded parameter bytes of the largest FSDP-wrapped unit (or ZeRO-3
            fetch group), in the dtype they are gathered in.
        offload_optimizer: the optimizer state is on the CPU.
        offload_params: the parameter shards are on the CPU.
        ddp_bucket_bytes: DDP's bucket cap in bytes (``bucket_cap_mb * 2**20``).
        gradient_as_bucket_view: DDP's option of the same name.

    Returns:
        One rank's bytes per category, same keys.

    Raises:
        ValueError: missing or unknown keys, negative byte counts, or invalid options (see `model_state_bytes`).

    Example:
        >>> b = dict(parameters=400, buffers=0, gradients=400, optimizer_state=800, activations=100,
        ...          temporaries=0, inputs=4)
        >>> shard_breakdown(b, world_size=4, sharding="zero2")["gradients"]
        100

    Known limitations:
        * It rescales the categories at the single-GPU peak; the sharded run's peak can fall at another
          moment (sharding the optimizer state can move the peak from the optimizer step into backward).
        * With ``gradient_as_bucket_view=True`` gradients become bucket views only after the first
          iteration, so a peak in step 1 still holds both.
        * A peak in the middle of backward holds only the gradients produced so far; DDP's buckets are
          allocated whole at construction, so the doubling under-counts there.
        * Communication buffers and FSDP's unsharded gradient of the unit being reduce-scattered are not
          counted (module docstring).
    """
    _check_options(world_size, sharding, offload_optimizer, offload_params)
    _check_int("largest_unit_param_bytes", largest_unit_param_bytes, 0)
    _check_int("ddp_bucket_bytes", ddp_bucket_bytes, 1)
    if not isinstance(gradient_as_bucket_view, bool):
        raise ValueError(f"`gradient_as_bucket_view` should be True or False, got {gradient_as_bucket_view!r}.")
    missing = [k for k in _BREAKDOWN_KEYS if k not in breakdown]
    unknown = [k for k in breakdown if k not in _BREAKDOWN_KEYS + _OPTIONAL_KEYS]
    if missing or unknown:
        raise ValueError(
            f"`breakdown` should have exactly the keys {', '.join(_BREAKDOWN_KEYS)}; "
            f"missing {missing or 'none'}, unknown {unknown or 'none'}. Pass an Estimate's `breakdown`."
        )
    for key in _BREAKDOWN_KEYS:
        _check_int(f"breakdown[{key!r}]", breakdown[key], 0)

    sharded = SHARDED_STATES[sharding]
    out = {key: breakdown[key] for key in _BREAKDOWN_KEYS}
    out.update({key: breakdown[key] for key in _OPTIONAL_KEYS if key in breakdown})
    for state in sharded:
        out[state] = _ceil_div(breakdown[state], world_size)
    if "parameters" in sharded:
        unit = largest_unit_param_bytes or breakdown["parameters"]
        out["temporaries"] += min(2 * unit, breakdown["parameters"])
    if sharding == "ddp" and not gradient_as_bucket_view:
        out["gradients"] += breakdown["gradients"]
    if offload_optimizer:
        out["optimizer_state"] = 0
    if offload_params:
        out["parameters"] = 0
        if sharding in _FSDP:
            out["gradients"] = out["optimizer_state"] = 0
    return out


# DeepSpeed's defaults (DeepSpeedZeroConfig, deepspeed/runtime/zero/config.py). Bucket and threshold sizes
# count elements, not bytes.
_DS_DEFAULTS: dict[str, Any] = {
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_model_persistence_threshold": 2**63 - 1,  # sys.maxsize: no cap on the persistent parameters together
    "sub_group_size": 1_000_000_000,
    "stage3_gather_16bit_weights_on_model_save": False,
}
_DS_ELEMENT_COUNTS = (
    "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_model_persistence_threshold", "sub_group_size",
)
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _load_config(obj: dict | str | os.PathLike) -> dict:
    if isinstance(obj, dict):
        return obj
    if isinstance(obj, str) and obj.lstrip().startswith("{"):
        return json.loads(obj)
    if isinstance(obj, (str, os.PathLike)):
        with open(obj, encoding="utf-8") as f:
            return json.load(f)
    raise ValueError(
        f"A DeepSpeed config should be a dict, a JSON string or a path to a JSON file, got {type(obj).__name__}."
    )


def _offload_device(section: Any, key: str) -> str:
    if section is None:
        return "none"
    device = section.get("device", "none") if isinstance(section, dict) else None
    if device is None:
        device = "none"
    if device not in _OFFLOAD_DEVICES:
        raise ValueError(
            f"DeepSpeed `zero_optimization.{key}.device` should be one of {', '.join(_OFFLOAD_DEVICES)}, "
            f"got {device!r}."
        )
    return device


def _enabled(config: dict, *keys: str) -> bool | None:
    for key in keys:
        if key in config:
            value = (config[key] or {}).get("enabled", False)
            return None if value == "auto" else bool(value)
    return False


def read_deepspeed_config(obj: dict | str | os.PathLike, *, hidden_size: int | None = None) -> dict[str, Any]:
    """Read the memory-relevant ZeRO options of a DeepSpeed config, with DeepSpeed's defaults filled in.

    Args:
        obj: the config as a dict, a JSON string, or a path to a JSON file.
        hidden_size: the model's hidden size, to resolve ``"auto"`` the way the Hugging Face Trainer does
            (transformers ``HfTrainerDeepSpeedConfig.trainer_config_finalize``: ``reduce_bucket_size =
            hidden_size**2``, ``stage3_prefetch_bucket_size = int(0.9 * hidden_size**2)``,
            ``stage3_param_persistence_threshold = 10 * hidden_size``). Without it those come back as None.

    Returns:
        A dict with ``stage`` (0-3), ``sharding`` (the matching `SHARDING_CHOICES` value; DeepSpeed's stage 0
        replicates like ``"ddp"``), ``offload_optimizer`` and ``offload_params`` (bools, usable as the options of
        `shard_breakdown`), ``offload_optimizer_device`` and ``offload_param_device`` (``"none"``, ``"cpu"`` or
        ``"nvme"``), ``overlap_comm`` (DeepSpeed: True for stage 3, else False), ``contiguous_gradients``,
        ``reduce_scatter``, the element counts ``reduce_bucket_size``, ``allgather_bucket_size``,
        ``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``, ``stage3_max_live_parameters``,
        ``stage3_max_reuse_distance``, ``stage3_model_persistence_threshold``, ``sub_group_size``,
        ``stage3_gather_16bit_weights_on_model_save`` (None when ``"auto"``, which accelerate fills from its
        plugin), and ``bf16`` / ``fp16`` (None when ``"auto"``).

    Raises:
        ValueError: the stage is not 0-3, an offload device is unknown, or ``obj`` is not a config.
        FileNotFoundError: ``obj`` is a path that does not exist.

    Example:
        >>> read_deepspeed_config({"zero_optimization": {"stage": 3}})["stage3_prefetch_bucket_size"]
        50000000

    Known limitations: only the ZeRO section and the precision flags are read. ``offload_param`` is reported
    only for stage 3, where DeepSpeed uses it. Deprecated spellings read: ``"zero_optimization": true`` (stage
    1), ``cpu_offload`` and ``cpu_offload_param``.
    """
    config = _load_config(obj)
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, (dict, bool)):
        raise ValueError(f"DeepSpeed `zero_optimization` should be a dict, got {zero!r}.")
    if isinstance(zero, bool):  # the deprecated format: ZeRO on means stage 1 (read_zero_config_deprecated)
        zero = {"stage": 1 if zero else 0, "allgather_bucket_size": config.get("allgather_size", 5e8)}
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"DeepSpeed `zero_optimization.stage` should be 0, 1, 2 or 3, got {stage!r}.")

    optimizer_device = _offload_device(zero.get("offload_optimizer"), "offload_optimizer")
    if optimizer_device == "none" and zero.get("cpu_offload"):
        optimizer_device = "cpu"
    param_device = _offload_device(zero.get("offload_param"), "offload_param")
    if param_device == "none" and zero.get("cpu_offload_param"):
        param_device = "cpu"
    if stage != 3:  # DeepSpeed reads offload_param only in stage 3
        param_device = "none"

    auto_values = {}
    if hidden_size is not None:
        _check_int("hidden_size", hidden_size, 1)
        auto_values = {
            "reduce_bucket_size": hidden_size * hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "stage3_param_persistence_threshold": 10 * hidden_size,
        }
    out: dict[str, Any] = {
        "stage": stage,
        "sharding": ("ddp", "zero1", "zero2", "zero3")[stage],
        "offload_optimizer": optimizer_device != "none",
        "offload_optimizer_device": optimizer_device,
        "offload_params": param_device != "none",
        "offload_param_device": param_device,
        "overlap_comm": bool(zero["overlap_comm"]) if zero.get("overlap_comm") is not None else stage == 3,
    }
    for key, default in _DS_DEFAULTS.items():
        value = zero.get(key, default)
        if key == "stage3_gather_16bit_weights_on_model_save" and key not in zero:  # DeepSpeed's deprecated name
            value = zero.get("stage3_gather_fp16_weights_on_model_save", default)
        if value == "auto":
            value = auto_values.get(key)
        elif key in _DS_ELEMENT_COUNTS:
            value = int(value)  # JSON configs often write 5e8
        else:
            value = bool(value)
        out[key] = value
    out["bf16"] = _enabled(config, "bf16", "bfloat16")
    out["fp16"] = _enabled(config, "fp16")
    return out


@dataclasses.dataclass(frozen=True)
class ZeroBuffers:
    """One rank's ZeRO gradient reduction buffers (`zero_buffers`).

    Attributes:
        nbytes: all of them together.
        during_backward: True: alive during each backward only (stages 1 and 2); False: from the optimizer's
            construction on (stage 3).
        how: what sized them, for the coverage note.
    """

    nbytes: int
    during_backward: bool
    how: str

    def note(self) -> str:
        span = "during each backward" if self.during_backward else "from the optimizer's construction on"
        return f"DeepSpeed's gradient reduction buffers counted as communication, {span}: {self.how}"


def zero_buffers(ds: dict[str, Any], grad_itemsizes: list[int], *, given: bool = True) -> ZeroBuffers:
    """ZeRO's gradient reduction buffers (module docstring, Sources) under ``ds`` (`read_deepspeed_config`'s
    output, stage 1 to 3) for gradients of the element sizes ``grad_itemsizes`` (one per gradient dtype, as
    DeepSpeed casts the model). ``given``: the settings come from the user's config (else DeepSpeed's defaults,
    said in the note).

    Raises:
        ValueError: ``reduce_bucket_size`` is ``"auto"`` and was not resolved (no hidden size to fill it from).

    Example:
        >>> zero_buffers(read_deepspeed_config({"zero_optimization": {"stage": 2}}), [4]).nbytes
        2000000000
    """
    stage = ds["stage"]
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO's gradient reduction buffers exist at stages 1 to 3, not {stage}.")
    if ds["reduce_bucket_size"] is None:
        raise ValueError("DeepSpeed config: `zero_optimization.reduce_bucket_size` is \"auto\", which the HF Trainer "
                         "fills with hidden_size * hidden_size, but the model's config has no hidden_size: give the "
                         "number.")
    if not ds["contiguous_gradients"]:
        return ZeroBuffers(0, stage != 3, "none, as `contiguous_gradients` is false")
    copies = 2 if ds["overlap_comm"] and stage in (1, 2) else 1
    elements = ds["reduce_bucket_size"]
    nbytes = elements * copies * sum(grad_itemsizes)
    source = "the config's" if given else "DeepSpeed's default; pass the run's DeepSpeed config for its own"
    how = (f"reduce_bucket_size {elements:,} elements ({source}) x {copies} buffer(s) x "
           f"{' + '.join(f'{n} B' for n in grad_itemsizes)} per element = {nbytes:,} bytes")
    return ZeroBuffers(nbytes, stage != 3, how)


@dataclasses.dataclass(frozen=True)
class Zero3Terms:
    """What DeepSpeed ZeRO-3 (0.19.8, no offload) holds on one rank besides the rescaled parameter, gradient and
    optimizer-state shares and the gradient reduction buffer (`zero3_terms`). Bytes; sources in `zero3_terms`.

    Attributes:
        master_bytes: the fp32 copy of the rank's parameter partitions, from construction on.
        grad_partition_bytes: the flat buffer of the rank's gradient partitions, from construction on.
        init_grad_bytes: the fp32 gradient buffer of the largest sub-group made when the optimizer state is
            initialised, alive until the first optimizer step replaces it.
        step_grad_bytes: the flattened fp32 gradient of the largest sub-group, alive during each optimizer step.
        persistent_bytes: parameters at or under ``stage3_param_persistence_threshold``, kept whole on every rank
            from the end of the first optimizer step on.
        first_step_gathered_bytes: gathered parameters in the first step (no module trace yet: only the module in
            use, with its all-gather buffer).
        gathered_bytes: gathered non-persistent parameters from the second step on (reuse distance, prefetch).
        how: the sizes and settings, for the coverage note.
    """

    master_bytes: int
    grad_partition_bytes: int
    init_grad_bytes: int
    step_grad_bytes: int
    persistent_bytes: int
    first_step_gathered_bytes: int
    gathered_bytes: int
    how: str

    def note(self) -> str:
        return f"DeepSpeed ZeRO-3's own terms counted: {self.how}"


def zero3_terms(ds: dict[str, Any], params: list[tuple[int, int, bool]], modules: list[list[int]], *,
                world_size: int, param_itemsize: int, grad_itemsize: int) -> Zero3Terms:
    """ZeRO-3's per-rank terms, counted from DeepSpeed 0.19.8's source (no parameter offload, optimizer on the GPU).

    Args:
        ds: `read_deepspeed_config`'s output (its ``"auto"`` values resolved).
        params: every parameter once, in ``model.named_parameters()`` order, as ``(id, numel, trainable)``.
        modules: the parameters each module owns directly (``recurse=False``), modules in forward order; modules
            without parameters may be left out.
        world_size: ranks the parameters are partitioned over.
        param_itemsize: bytes per element of the parameters as DeepSpeed holds them (2 with bf16 / fp16 enabled).
        grad_itemsize: bytes per element of the gradient partitions (``data_types.grad_accum_dtype``, by default
            the parameters' dtype).

    Terms (each partition is ``ceil(numel / world_size)`` elements: ``partition_parameters.py`` pads every
    parameter to a multiple of the world size, ``_padding_size``, so every rank holds the same sizes):

    * ``master_bytes``: ``stage3.py _create_fp32_partitions`` clones the flat partition to fp32
      (``converted.clone().detach()``). Its branch that would alias the partition instead compares a tensor's
      ``torch.device`` with the accelerator's device name, a string, which is never equal, so the copy is made in
      fp32 training too (measured: ``benchmarks/deepspeed_cpu.py``).
    * ``grad_partition_bytes``: ``stage3.py _setup_for_real_optimizer``: ``grad_partitions_flat_buffer``, the sum
      of the partitions, in the gradient accumulation dtype.
    * ``init_grad_bytes``: ``stage3.py initialize_optimizer_states``: ``gradient_buffer`` of the largest sub-group's
      partition (``_create_fp16_sub_groups`` closes a sub-group once it reaches ``sub_group_size`` elements), fp32,
      set as the master's ``.grad`` until ``_prepare_fp32_grad_for_sub_group`` replaces it in the first step.
    * ``step_grad_bytes``: ``_prepare_fp32_grad_for_sub_group`` flattens a sub-group's gradient partitions into a
      new fp32 tensor for its optimizer step; ``_release_sub_group`` drops it.
    * ``persistent_bytes``: ``parameter_offload.py mark_persistent_parameters``: parameters of at most
      ``stage3_param_persistence_threshold`` elements (while their running total stays within
      ``stage3_model_persistence_threshold``) are never released once the module trace is complete
      (``partitioned_param_coordinator.py __params_to_release`` skips ``ds_persist``); ``stage3.py _post_step``
      gathers them after each optimizer step. Their partitions stay too.
    * ``first_step_gathered_bytes``: the first forward starts the trace recording (``reset_step`` at the start of
      each forward: INVALID, then RECORD, then COMPLETE), and until the trace is complete ``release_sub_module``
      releases every parameter of a module after its forward and its backward, and nothing is prefetched. So the
      module in use is gathered, with its all-gather output (``_all_gather_dtype``: ``partition * world_size``
      elements, copied into each parameter by ``torch.cat`` in ``AllGatherCoalescedHandle.wait``): twice the
      largest module's parameters.
    * ``gathered_bytes``: with the trace complete (from the second step), a module's parameters are kept after
      its forward when the module that uses them next is reached within ``stage3_max_reuse_distance`` elements of
      the modules in between (``__params_to_release``), and the coordinator prefetches the next parameters up to
      ``min(stage3_max_live_parameters - available, stage3_prefetch_bucket_size)`` elements (``fetch_sub_module``).
      The parameters kept at the end of the forward (backward order taken as the forward's reverse), plus the
      largest module and the prefetch window with their all-gather buffers, capped at every non-persistent
      parameter (when every parameter is kept, nothing is in flight at the end of the forward).

    Known limitations: the forward order is the order the modules are registered in (``model.modules()``), not
    the traced call order, and the backward is taken as its reverse; the all-gather buffer's lifetime (until
    its handle is dropped) is taken as the module's; ``stage3_max_live_parameters`` only limits prefetching, as in
    DeepSpeed; the reduce-scatter buffers of a full bucket are not counted; with offloading the caller drops the
    terms that live on the host (`preflight.parallel._deepspeed.zero3_terms_for`).

    Example:
        >>> ds = read_deepspeed_config({"zero_optimization": {"stage": 3}})
        >>> t = zero3_terms(ds, [(1, 1000, True), (2, 10, True)], [[1, 2]], world_size=2, param_itemsize=4,
        ...                 grad_itemsize=4)
        >>> t.master_bytes, t.persistent_bytes
        (2020, 4040)
    """
    _check_int("world_size", world_size, 1)
    for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        if ds[key] is None:
            raise ValueError(f"DeepSpeed config: `zero_optimization.{key}` is \"auto\", which the HF Trainer fills "
                             "from the model's hidden_size, but the model's config has none: give the number.")
    numel = {pid: n for pid, n, _ in params}
    part = {pid: _ceil_div(n, world_size) for pid, n in numel.items()}
    trainable = [pid for pid, _, t in params if t]

    persistent, total = set(), 0
    for pid, n, _ in params:  # mark_persistent_parameters: named_parameters order, a running total
        if n + total > ds["stage3_model_persistence_threshold"]:
            continue
        if n <= ds["stage3_param_persistence_threshold"]:
            persistent.add(pid)
            total += n

    sub_groups, current = [], 0  # _create_fp16_sub_groups over the partitions
    for pid in trainable:
        current += part[pid]
        if current >= ds["sub_group_size"]:
            sub_groups.append(current)
            current = 0
    sub_groups.append(current)
    largest_sub_group = max(sub_groups)

    modules = [m for m in modules if m]
    order = modules + modules[::-1]  # the recorded trace: forward, then backward in reverse
    sizes = [sum(numel[pid] for pid in m) for m in order]
    kept: set[int] = set()
    for i in range(len(modules)):  # released after module i's forward unless reused within the distance
        traversed = 0
        seen: set[int] = set()
        for j in range(i + 1, len(order)):
            if traversed >= ds["stage3_max_reuse_distance"]:
                break
            seen.update(order[j])
            traversed += sizes[j]
        kept |= {pid for pid in modules[i] if pid in seen}
        kept -= {pid for pid in modules[i] if pid not in seen}
    kept -= persistent
    everything = set(numel) - persistent
    kept_numel = sum(numel[pid] for pid in kept)
    largest_module = max((sum(numel[pid] for pid in m if pid not in persistent) for m in modules), default=0)
    prefetch = max(0, min(ds["stage3_max_live_parameters"] - kept_numel, ds["stage3_prefetch_bucket_size"]))
    if prefetch:
        prefetch += max((numel[pid] for pid in everything), default=0) - 1  # the loop adds whole parameters
    in_flight = 2 * (largest_module + prefetch)  # gathered, and their all-gather output while it is in flight
    every = sum(numel[pid] for pid in everything)
    gathered = min(every, kept_numel + in_flight)
    first = min(2 * max((sum(numel[pid] for pid in m) for m in modules), default=0), sum(numel.values()))

    trainable_partitions = sum(part[pid] for pid in trainable)
    terms = dict(
        master_bytes=4 * trainable_partitions,
        grad_partition_bytes=grad_itemsize * trainable_partitions,
        init_grad_bytes=4 * largest_sub_group,
        step_grad_bytes=4 * largest_sub_group,
        persistent_bytes=param_itemsize * sum(numel[pid] for pid in persistent),
        first_step_gathered_bytes=param_itemsize * first,
        gathered_bytes=param_itemsize * gathered,
    )
    how = (f"fp32 partition copy {terms['master_bytes']:,} B and gradient partitions "
           f"{terms['grad_partition_bytes']:,} B from construction; {len(persistent)} persistent parameter(s) (<= "
           f"{ds['stage3_param_persistence_threshold']:,} elements) kept whole: {terms['persistent_bytes']:,} B; "
           f"gathered parameters {terms['first_step_gathered_bytes']:,} B in the first step, "
           f"{terms['gathered_bytes']:,} B from the second ({len(kept)} of {len(everything)} non-persistent "
           f"parameter(s) kept from forward to backward within stage3_max_reuse_distance "
           f"{ds['stage3_max_reuse_distance']:,}, prefetch window {prefetch:,} elements; modules in registration "
           f"order); fp32 gradient of the largest sub-group {terms['step_grad_bytes']:,} B in each optimizer step and "
           "until the first")
    return Zero3Terms(**terms, how=how)


def zero3_consolidation(params: list[tuple[int, int]], walk: list[list[int]], *, world_size: int, itemsize: int,
                        keep: bool, staged: bool = False) -> list[tuple[int, int]]:
    """The device allocations and frees of ZeRO-3's 16-bit consolidation of the model, in order, counted from
    DeepSpeed 0.19.8's source: what ``save_16bit_model`` and accelerate's ``get_state_dict`` (the HF Trainer's
    ``save_model``) run when ``stage3_gather_16bit_weights_on_model_save`` is on.

    Args:
        params: every parameter once, as ``(id, numel)``.
        walk: the parameters each module owns directly (``recurse=False``), modules in the order
            ``_zero3_consolidated_16bit_state_dict`` visits them (``named_children``, depth first, the module
            before its children; a module reached twice is visited twice).
        world_size: ranks the parameters are partitioned over.
        itemsize: bytes per element of the parameters as DeepSpeed holds them (2 with bf16 / fp16 enabled).
        keep: the rank keeps what it gathers (rank 0 when the device is the host: ``param.detach().cpu()`` is the
            gathered tensor itself on a CPU); False on the other ranks, and on rank 0 when ``.cpu()`` copies to the
            host.
        staged: the process group stages each all-gather's output in a tensor of its own, freed when the
            collective ends: gloo does (a CPU run; measured here, torch 2.13: ``all_gather_into_tensor`` into an
            8 MiB output allocates an 8 MiB block for the collective), NCCL writes into the output. The stages
            of one module's parameters are counted alive together (its gathers are launched before any is
            waited on; gloo may run them one after the other, so this is an upper bound by all but the largest).

    Returns:
        ``(key, nbytes)`` in order: an allocation (``nbytes > 0``, a key of its own) or the free of the
        allocation with that key (``nbytes < 0``).

    From the source (``engine.py _zero3_consolidated_16bit_state_dict``, ``partition_parameters.py``): each module's
    own parameters are gathered together (``GatheredParameters(module_params, modifier_rank=0)`` ->
    ``_allgather_params_coalesced``), each into a flat tensor of its padded size, ``ceil(numel / world_size) *
    world_size`` elements, that the parameter then views; on leaving the context rank 0 broadcasts them in place
    and every rank partitions them again, freeing the flat tensors (``free_param``), except what a reference still
    holds: rank 0's state dict entry (``.cpu()`` of the view). A parameter shared with a module visited earlier
    (tied weights, the same ``ds_id``) is gathered again and not kept twice. The caller places the prologue and the
    epilogue around these (`preflight._target.deepspeed_save_events`): ``checkpoint_event_prologue`` partitions every
    parameter first, the persistent ones too, and ``checkpoint_event_epilogue`` gathers the persistent ones again.

    Example:
        >>> zero3_consolidation([(1, 10), (2, 3)], [[1], [2, 1]], world_size=2, itemsize=4, keep=True)
        [(0, 40), (1, 16), (2, 40), (2, -40)]
    """
    _check_int("world_size", world_size, 1)
    numel = dict(params)
    out: list[tuple[int, int]] = []
    kept: set[int] = set()
    for module in walk:
        transient, stages = [], []
        for pid in sorted(set(module), key=module.index):  # GatheredParameters: each parameter once
            key, nbytes = len(out), itemsize * world_size * _ceil_div(numel[pid], world_size)
            out.append((key, nbytes))
            if keep and pid not in kept:
                kept.add(pid)
            else:
                transient.append((key, -nbytes))
            if staged:
                stages.append(nbytes)
        first = len(out)
        out.extend((first + i, nbytes) for i, nbytes in enumerate(stages))
        out.extend((first + i, -nbytes) for i, nbytes in enumerate(stages))
        out.extend(transient)
    return [(key, nbytes) for key, nbytes in out if nbytes]


def hf_hidden_size(model: Any) -> int | None:
    """The hidden size the HF Trainer fills a DeepSpeed config's ``"auto"`` values from
    (``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.trainer_config_finalize``), or None."""
    config = getattr(model, "config", None)
    for section in (config, getattr(config, "text_config", None)):
        if section is None:
            continue
        if isinstance(getattr(section, "hidden_size", None), int):
            return section.hidden_size
        if getattr(section, "hidden_sizes", None):
            return max(section.hidden_sizes)
    return None
