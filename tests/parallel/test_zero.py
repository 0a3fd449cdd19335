"""`preflight.parallel.read_zero`'s optimizer mapping for DeepSpeed's own optimizer kernels (the end-to-end runs of
read-back models are in tests/integrations/test_hf.py and test_lightning.py, on real DeepSpeed processes)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from preflight.parallel._zero import _rebuilt


def _deepspeeds(name: str, **attrs):
    """An object standing for one of DeepSpeed's optimizer kernels: its class name and module, its param_groups."""
    cls = type(name, (), {"__module__": "deepspeed.ops.adam.fused_adam"})
    inner = cls()
    inner.__dict__.update(attrs)
    return inner


@pytest.mark.parametrize("name, attrs, expected, state", [
    ("FusedAdam", {"adam_w_mode": True}, torch.optim.AdamW, {"exp_avg", "exp_avg_sq", "step"}),
    ("DeepSpeedCPUAdam", {"adam_w_mode": False}, torch.optim.Adam, {"exp_avg", "exp_avg_sq", "step"}),
    ("DeepSpeedCPUAdagrad", {}, torch.optim.Adagrad, {"sum", "step"}),
    ("FusedLion", {}, torch.optim.SGD, {"momentum_buffer"}),
])
def test_deepspeeds_kernels_are_traced_as_the_torch_optimizer_with_the_same_state(name, attrs, expected, state):
    model = nn.Linear(4, 4)
    params = {id(p): nn.Parameter(torch.empty_like(p, device="meta")) for p in model.parameters()}
    inner = _deepspeeds(name, param_groups=[{"params": [], "lr": 0.5, "betas": (0.8, 0.9), "eps": 1e-6,
                                             "weight_decay": 0.1, "bias_correction": True}], **attrs)
    notes: list[str] = []
    rebuilt = _rebuilt(inner, [list(model.parameters())], params, notes)
    assert type(rebuilt) is expected and rebuilt.param_groups[0]["lr"] == 0.5
    assert [id(p) for p in rebuilt.param_groups[0]["params"]] == [id(params[id(p)]) for p in model.parameters()]
    assert notes == [f"DeepSpeed's {name} is traced as torch.optim.{expected.__name__} (the same state per parameter)"]
    # The state it makes for a parameter, as the trace would step it.
    real = [nn.Parameter(torch.zeros(4, 4))]
    accepted = inspect.signature(type(rebuilt)).parameters
    twin = type(rebuilt)(real, **{k: v for k, v in rebuilt.param_groups[0].items() if k in accepted and k != "params"})
    real[0].grad = torch.ones(4, 4)
    twin.step()
    assert set(twin.state[real[0]]) == state


def test_a_tensor_the_optimizer_holds_that_is_no_parameter_is_named():
    model = nn.Linear(4, 4)
    params = {id(p): nn.Parameter(torch.empty_like(p, device="meta")) for p in model.parameters()}
    with pytest.raises(ValueError, match=r"holds 1 tensor\(s\) that are not the model's parameters"):
        _rebuilt(torch.optim.AdamW(model.parameters()), [[*model.parameters(), torch.zeros(3)]], params, [])


def test_stage_3_sub_groups_map_to_their_optimizer_groups():
    # ZeRO-3 lists parameters by sub-group (a group split by sub_group_size or process group, a group without
    # trainable parameters left out: stage3.py _create_fp16_sub_groups), each with its group in
    # sub_group_to_group_id.
    from types import SimpleNamespace

    from preflight.parallel._zero import _groups

    a, b, c = (torch.zeros(2) for _ in range(3))
    ds_opt = SimpleNamespace(fp16_groups=[[a], [b], [c]], sub_group_to_group_id={0: 0, 1: 0, 2: 2})
    assert _groups(ds_opt, 3, 3) == [[a, b], [], [c]]
    with pytest.raises(ValueError, match="does not say which"):
        _groups(SimpleNamespace(fp16_groups=[[a]], sub_group_to_group_id={}), 3, 1)
    assert _groups(SimpleNamespace(bit16_groups=[[a], []]), 2, 2) == [[a], []]
    with pytest.raises(ValueError, match="fp32 gradient accumulation"):
        _groups(SimpleNamespace(bf16_groups=[[a]]), None, 1)


def test_a_torch_inner_optimizer_keeps_its_constructor_options():
    # HF's optim="adamw_bnb_8bit" under DeepSpeed: bitsandbytes' AdamW with optim_bits=8 inside the ZeRO optimizer;
    # rebuilt from its group settings alone it would get 32-bit state.
    bnb = pytest.importorskip("bitsandbytes")
    model = nn.Linear(64, 64)
    params = {id(p): nn.Parameter(torch.empty_like(p, device="meta")) for p in model.parameters()}
    inner = bnb.optim.AdamW(model.parameters(), lr=0.25, optim_bits=8)
    rebuilt = _rebuilt(inner, [list(model.parameters())], params, [])
    assert type(rebuilt) is type(inner) and rebuilt.args.optim_bits == 8 and rebuilt.param_groups[0]["lr"] == 0.25
    assert [id(p) for p in rebuilt.param_groups[0]["params"]] == [id(params[id(p)]) for p in model.parameters()]
