"""Fake outputs take the real CPU kernel's memory layout where the fake kernel's differs (issue 9, section 5)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import preflight
from preflight.trace._layouts import LayoutCalibration

aten = torch.ops.aten


def _layer_norm_backward_args(make):
    grad_out = make((2, 16, 8)).transpose(1, 2).contiguous().transpose(1, 2)  # (2, 16, 8), not contiguous
    x, mean, rstd = make((2, 16, 8)), make((2, 16, 1)), make((2, 16, 1))
    weight, bias = make((8,)), make((8,))
    return (grad_out, x, [8], mean, rstd, weight, bias, [True, True, True])


def test_layer_norm_backward_gets_the_kernel_layout():
    real_args = _layer_norm_backward_args(lambda shape: torch.rand(shape))
    real = aten.native_layer_norm_backward.default(*real_args)
    with FakeTensorMode():
        fake_args = _layer_norm_backward_args(lambda shape: torch.rand(shape))
        fake = aten.native_layer_norm_backward.default(*fake_args)
        calibration = LayoutCalibration()
        fixed = calibration.match(aten.native_layer_norm_backward.default, fake_args, {}, fake)
    assert fake[0].stride() != real[0].stride()  # the fake kernel follows grad_output's layout
    assert [t.stride() for t in fixed] == [t.stride() for t in real]
    assert "native_layer_norm_backward" in calibration.note()


@pytest.mark.parametrize("op", ["layer_norm", "group_norm"])
def test_norm_statistics_get_the_kernel_dtype_when_input_and_weights_differ(op):
    # CPU autocast runs LayerNorm with a bf16 input and fp32 weights: the CPU kernel saves fp32 mean and rstd,
    # torch's reference implementation casts them to bf16 (half the bytes of every saved statistic).
    def args(make):
        x, weight, bias = make((2, 16, 8), torch.bfloat16), make((8,), torch.float32), make((8,), torch.float32)
        if op == "layer_norm":
            return aten.native_layer_norm.default, (x, [8], weight, bias, 1e-5)
        return aten.native_group_norm.default, (x.reshape(2, 8, 16), weight, bias, 2, 8, 16, 4, 1e-5)

    func, real_args = args(lambda shape, dtype: torch.rand(shape, dtype=dtype))
    real = func(*real_args)
    with FakeTensorMode():
        _, fake_args = args(lambda shape, dtype: torch.rand(shape, dtype=dtype))
        fake = func(*fake_args)
        calibration = LayoutCalibration()
        fixed = calibration.match(func, fake_args, {}, fake)
    assert [t.dtype for t in real] == [torch.bfloat16, torch.float32, torch.float32]
    assert fake[1].dtype == torch.bfloat16  # the reference implementation's dtype
    assert [(t.dtype, t.stride()) for t in fixed] == [(t.dtype, t.stride()) for t in real]
    assert op in calibration.note()


def test_contiguous_inputs_and_views_are_left_alone():
    calibration = LayoutCalibration()
    with FakeTensorMode():
        x = torch.rand(4, 8)
        out = aten.mul.Tensor(x, x)
        assert calibration.match(aten.mul.Tensor, (x, x), {}, out) is out
        t = x.t()
        view = aten.t.default(x)
        assert calibration.match(aten.t.default, (t,), {}, view) is view
    assert calibration.note() is None


def test_swin_matches_the_measured_peak():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.SwinConfig(image_size=32, patch_size=2, embed_dim=32, depths=[1, 1], num_heads=[2, 2],
                                  window_size=4, num_labels=3)
    model = transformers.SwinForImageClassification(cfg)
    batch = {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 1])}
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch)
    measured = preflight.measure(model, torch.optim.AdamW(model.parameters()), batch)
    assert abs(est.peak_bytes - measured.peak_bytes) / measured.peak_bytes < 0.005  # was +1.1% before
    assert any("native_layer_norm_backward" in n for n in est.coverage.notes)
