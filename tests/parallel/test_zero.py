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
