"""NCCL's communication buffers on each rank of a CUDA job: memory outside PyTorch's allocator, modelled from NCCL's
own defaults and environment, or the figure the user measured.

Each NCCL communicator (a process group a rank communicates on) connects, per channel, to the peers its
algorithms need, and holds a buffer per protocol for each connection. NCCL's defaults (``src/init.cc``,
``computeBuffSizes``): ``DEFAULT_BUFFSIZE`` = 4 MiB for the Simple protocol (``NCCL_BUFFSIZE``; 1 MiB on Arm CPUs),
``DEFAULT_LL_BUFFSIZE`` = 8 lines x 512 threads x 8 steps x 16 B = 512 KiB (``NCCL_LL_BUFFSIZE``), and
``DEFAULT_LL128_BUFFSIZE`` = 120 elements x 640 threads x 8 steps x 8 B = 4,915,200 B (``NCCL_LL128_BUFFSIZE``);
``NCCL_PROTO`` can leave protocols out. The channel count is NCCL's choice for the topology (up to
``NCCL_MAX_NCHANNELS``); without the variable, `ASSUMED_CHANNELS` is assumed, and a ring's two connections per
channel (its send and its receive). The model is a stated assumption, not a measurement (no GPU measured it here):
measure the job's own figure (``nvidia-smi`` after the first collectives, minus ``torch.cuda.memory_reserved()`` and
the CUDA context) and give it as ``Target(nccl_buffers=...)``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from preflight._units import format_bytes, parse_bytes

__all__ = ["ASSUMED_CHANNELS", "nccl_buffers", "rank_nccl_buffers"]

_SIMPLE, _SIMPLE_ARM = 1 << 22, 1 << 20  # DEFAULT_BUFFSIZE, DEFAULT_BUFFSIZE_ARM
_LL = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD * NCCL_LL_MAX_NTHREADS * NCCL_STEPS * sizeof(ncclLLFifoLine)
_LL128 = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD * NCCL_LL128_MAX_NTHREADS * NCCL_STEPS * sizeof(uint64_t)
# NCCL picks the channels from the topology; 16 is a ring's count on an 8-GPU NVLink node, assumed when
# NCCL_MAX_NCHANNELS does not say.
ASSUMED_CHANNELS = 16
_CONNECTIONS = 2  # a ring's send and receive per channel


def nccl_buffers(communicators: int, given: int | float | str | None = None,
                 env: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """The bytes of NCCL buffers one rank holds for ``communicators`` process groups, and a note saying how they were
    obtained: ``given`` (bytes per communicator, the user's measurement) or the model of the module docstring read
    from ``env`` (default ``os.environ``). None when the rank communicates with no one."""
    if communicators < 1:
        return None
    if given is not None:
        each = parse_bytes(given, name="nccl_buffers")
        return each * communicators, (f"device total adds NCCL's buffers as given: {format_bytes(each)} for each of "
                                      f"{communicators} communicator(s)")
    env = os.environ if env is None else env
    protocols = {p.strip().lower() for p in env.get("NCCL_PROTO", "simple,ll,ll128").split(",") if p.strip()}
    simple = _size(env, "NCCL_BUFFSIZE", _SIMPLE_ARM if os.uname().machine in ("aarch64", "arm64") else _SIMPLE)
    sizes = {"simple": simple, "ll": _size(env, "NCCL_LL_BUFFSIZE", _LL), "ll128": _size(env, "NCCL_LL128_BUFFSIZE",
                                                                                           _LL128)}
    per_connection = sum(size for name, size in sizes.items() if name in protocols)
    channels = int(env.get("NCCL_MAX_NCHANNELS") or ASSUMED_CHANNELS)
    each = channels * _CONNECTIONS * per_connection
    told = "NCCL_MAX_NCHANNELS" if env.get("NCCL_MAX_NCHANNELS") else "assumed"
    return each * communicators, (
        f"device total adds NCCL's buffers, modelled from its defaults (src/init.cc): {communicators} communicator(s) "
        f"x {channels} channels ({told}) x {_CONNECTIONS} ring connections x {format_bytes(per_connection)} "
        f"(protocols {', '.join(sorted(p for p in sizes if p in protocols))}) = {format_bytes(each * communicators)}; "
        "NCCL chooses its channels for the topology: Target(nccl_buffers=...) / --nccl-buffers gives the figure "
        "measured per communicator")


def rank_nccl_buffers(world_size: int, sharding: str | None,
                      given: int | float | str | None = None) -> tuple[int, str] | None:
    """NCCL's buffers on one rank of a CUDA job of ``world_size`` ranks under ``sharding``: the default group, and one
    more per dim of a mesh of several (tensor or pipeline parallelism with FSDP2, ``"tp2 x fsdp2"``; HSDP beside
    tensor parallelism, ``"tp2 x fsdp2 x replicate2"``: each dim is a process group of its own); None on one rank.
    Hybrid sharding alone (``"fsdp2"`` with a replicate dim) is not told apart from its name, and counts as one
    group. ``given`` is the bytes per communicator the user measured (`nccl_buffers`)."""
    if world_size < 2:
        return None
    dims = sharding.count(" x ") + 1 if sharding is not None and " x " in sharding else 0
    return nccl_buffers(1 + dims, given)


def _size(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    return int(value) if value and value.lstrip("-").isdigit() and int(value) > 0 else default
