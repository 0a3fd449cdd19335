"""The unwrapped stand-in of a model FSDP has already wrapped, for what is traced on one device and rescaled: the
evaluation step (FSDP's per-rank training trace has no evaluation counterpart) and the suggestions' options.

`stand_in` copies the wrapped model as `preflight.parallel.fake_replica` copies it for the per-rank trace (each
FSDP2 DTensor parameter at its global shape, each FSDP1 original parameter at its original shape, FSDP's classes and
hooks left out), with meta tensors for parameters and the model's own buffers, so it is a model built on the meta
device, which `preflight.estimate` and `advise` trace; and it rebuilds the user's optimizer over the copy's
parameters, by name (FSDP1's wrapper prefixes removed), or, when it holds FSDP1's flat parameters, as one group over
all of them, as the per-rank trace rebuilds it. The user's model, optimizer and FSDP state are only read.
"""

from __future__ import annotations

import torch
from torch import nn

from preflight.parallel._rank import MetaTwins, ParamTwins, fake_replica
from preflight.trace._twin import clone_optimizer

__all__ = ["stand_in"]


def stand_in(root: nn.Module, optimizer: torch.optim.Optimizer, engine: str) -> tuple[nn.Module,
                                                                                     torch.optim.Optimizer]:
    """The unwrapped meta copy of ``root`` (the FSDP2 model, or FSDP1's outermost wrapper) and ``optimizer`` rebuilt
    over its parameters (module docstring). ``engine`` names the engine in errors.

    Raises:
        ValueError: the optimizer holds tensors that are none of the model's parameters.
    """
    try:
        from torch.distributed.fsdp._common_utils import clean_tensor_name as rename
    except ImportError:  # a build without distributed support: nothing was wrapped
        rename = str
    replica = fake_replica(root, MetaTwins(), keep_buffers=True)
    named = dict(replica.named_parameters())
    flat = any(getattr(p, "_is_flat_param", False) for g in optimizer.param_groups for p in g["params"])
    if flat:  # FSDP1 without use_orig_params: one group, as FSDP1 itself cannot split a flat parameter
        return replica, clone_optimizer(optimizer, ParamTwins(root, {}, engine), foreach=None,
                                        param_groups=[(0, list(replica.parameters()))])
    return replica, clone_optimizer(optimizer, ParamTwins(root, named, engine, rename=rename), foreach=None)
