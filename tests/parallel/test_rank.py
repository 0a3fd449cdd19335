"""The fake copy every per-rank trace runs on (`preflight.parallel.fake_replica`)."""

from __future__ import annotations

import torch
from torch import nn

from preflight.parallel import fake_replica
from preflight.parallel._rank import MetaTwins


def test_a_forward_replaced_by_a_closure_over_the_module_runs_on_the_copy():
    # transformers' tensor parallelism replaces `module.forward` by a closure over the module and its bound forward.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    linear = model[0]
    original = linear.forward

    def forward(x):
        return original(x) + linear.bias

    linear.forward = forward
    copy = fake_replica(model, MetaTwins())
    out = copy(torch.empty(2, 4, device="meta"))
    assert out.device.type == "meta"  # the copy's meta weights ran, not the user's
    closure = {c.cell_contents for c in copy[0].forward.__closure__ if isinstance(c.cell_contents, nn.Module)}
    assert closure == {copy[0]}
    methods = [c.cell_contents for c in copy[0].forward.__closure__ if hasattr(c.cell_contents, "__self__")]
    assert [m.__self__ for m in methods] == [copy[0]]  # the bound forward, rebound to the copy
    assert linear.forward is forward and original.__self__ is linear  # the user's model as it was


def test_fsdp2s_group_hooks_stay_off_the_copy():
    """``fully_shard`` over several modules at once (transformers' norm and head, torchtitan's output group) hooks
    them with closures over its state, not bound methods of it: the copy gets none, or its forward would run the
    job's FSDP state (a real job then refused its next forward: "FSDP state has already been lazily initialized")."""
    from torch.distributed.fsdp import fully_shard

    from preflight.parallel import fake_world

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    with fake_world(2, 0) as mesh:
        fully_shard([model[1], model[2]], mesh=mesh)
        fully_shard(model, mesh=mesh)

        def fsdp_hooks(module: nn.Module) -> list:
            return [fn for table in ("_forward_pre_hooks", "_forward_hooks") for fn in getattr(module, table).values()
                    if str(getattr(getattr(fn, "func", fn), "__module__", "")).startswith("torch.distributed.fsdp")]

        assert fsdp_hooks(model[1])  # the job's module has them
        copy = fake_replica(model, MetaTwins())
        assert not any(fsdp_hooks(m) for m in copy.modules())
