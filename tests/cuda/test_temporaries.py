"""Temporaries CUDA kernels hold inside one call (`preflight.cuda._temporaries`), and the estimate that counts them."""

from __future__ import annotations

import torch
from torch import nn

import preflight
from preflight import Run, Target
from preflight.cuda import ReduceDevice, kernel_temporaries
from preflight.trace import TensorSpec

H200 = ReduceDevice(132, 2048)


def test_softmax_backward_holds_grad_times_output():
    # softmax_backward_cuda_out computes tmp = grad * output first: BERT's (8, 8, 256, 256) fp32 attention probabilities
    # held a 16 MiB block there on an H200, beside the fp16 gradient it returned.
    probs = TensorSpec((8, 8, 256, 256), (524288, 65536, 256, 1), torch.float32)
    op = torch.ops.aten._softmax_backward_data.default
    assert kernel_temporaries(op, [probs, probs, -1, torch.float16], {}, H200) == (16_777_216,)
    half = TensorSpec((8, 8, 256, 256), (524288, 65536, 256, 1), torch.float16)
    assert kernel_temporaries(op, [half, half, -1, torch.float16], {}, H200) == (8_388_608,)
    assert kernel_temporaries(torch.ops.aten._log_softmax_backward_data.default, [probs, probs, -1, torch.float32],
                              {}, H200) is None  # not modelled: the CUDA kernel holds nothing beyond its output


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1536), nn.GELU(), nn.Linear(1536, 256))


def _estimate(target: Target):
    model = _model()
    batch = torch.randn(2048, 256)
    return preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                              Run(target=target), step=lambda m, b: m(b).square().mean())


def test_the_estimate_counts_the_bias_gradients_staging_buffers_on_a_cuda_target_only():
    # The first Linear's bias gradient sums a (2048, 1536) gradient over its rows: on an H200 a 25,165,824-byte
    # staging buffer and 48 bytes of semaphores, freed when the kernel returns (rounded to 512-byte blocks).
    est = _estimate(Target(gpu="H200"))
    transients = [e.nbytes for e in est.events if e.uid < 0 and e.nbytes > 0 and e.op >= 0]
    assert transients.count(25_165_824) == 2  # one per traced step
    assert transients.count(512) >= 2  # the semaphores
    note = next(n for n in est.coverage.notes if n.startswith("temporaries of"))
    assert "H200's 132 multiprocessors" in note
    cpu = _estimate(Target(device="cpu"))
    assert not any(n.startswith("temporaries of") for n in cpu.coverage.notes)
    assert 25_165_824 not in [e.nbytes for e in cpu.events]
