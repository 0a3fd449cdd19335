"""A CUDA target traced on the CPU host runs with CUDA's semantics; a CPU target does not."""

from __future__ import annotations

import pytest
import torch

import preflight
from preflight._steps import Loop
from preflight.cuda import CudaTarget
from preflight.trace import trace_steps
from conftest import lm_batch, make_gpt2, make_llama


class _Attention(torch.nn.Module):
    """Eager self-attention without a mask (HF's eager paths add an fp32 mask, which promotes on any device)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        probs = torch.softmax(q @ k.transpose(-1, -2) / 32**0.5, dim=-1)
        return (probs @ v).float().pow(2).mean()


def _softmax_backward_dtypes(cuda: CudaTarget | None, target: str) -> set[torch.dtype]:
    model = _Attention()
    result = trace_steps(model, torch.optim.AdamW(model.parameters()), torch.randn(2, 16, 32), step=None,
                         precision="16-mixed", trace_device=torch.device("cpu"),
                         target_device=torch.device(target), steps=1, schedule=Loop(),
                         record_op=lambda f, args: f is torch.ops.aten._softmax_backward_data.default, cuda=cuda)
    assert result.error is None
    return {args[1].dtype for _, _, _, args, _ in result.op_log}  # (grad_output, output, dim, input_dtype)


def test_eager_attention_probabilities_are_saved_in_fp32_for_a_cuda_target():
    assert _softmax_backward_dtypes(CudaTarget((8, 0), "A100-80GB"), "cuda") == {torch.float32}
    assert _softmax_backward_dtypes(None, "cpu") == {torch.float16}


@pytest.mark.slow
def test_estimate_for_a_gpu_names_what_it_applied():
    model = make_gpt2(attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters())
    batch = lm_batch(2, 32)
    notes = {gpu: [n for n in preflight.estimate(model, opt, batch, run=preflight.Run(precision="bf16-mixed", target=preflight.Target(gpu=gpu))).coverage.notes
                   if n.startswith("CUDA semantics")] for gpu in ("V100-16GB", "H100-80GB")}
    assert "V100-16GB (sm_70)" in notes["V100-16GB"][0] and "attention kernels math x4" in notes["V100-16GB"][0]
    assert "H100-80GB (sm_90)" in notes["H100-80GB"][0] and "attention kernels flash x4" in notes["H100-80GB"][0]
    cpu = preflight.estimate(model, opt, batch, run=preflight.Run(precision="bf16-mixed"))
    assert not any(n.startswith("CUDA semantics") for n in cpu.coverage.notes)


def test_user_model_is_untouched_and_cpu_autocast_restored():
    model = make_gpt2(attn_implementation="eager")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    preflight.estimate(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 32), run=preflight.Run(precision="16-mixed", target=preflight.Target(gpu="A100-80GB")))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    x = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(x @ x, -1).dtype == torch.bfloat16


@pytest.mark.slow
def test_grouped_query_attention_traces_for_every_catalog_architecture():
    model = make_llama()  # 4 query heads, 2 key/value heads, sdpa
    opt = torch.optim.AdamW(model.parameters())
    for gpu in ("V100-16GB", "A100-80GB", "H100-80GB"):
        for precision in (None, "bf16-mixed"):
            est = preflight.estimate(model, opt, lm_batch(2, 32), run=preflight.Run(precision=precision, target=preflight.Target(gpu=gpu)))
            assert not est.coverage.lower_bound, (gpu, precision, est.coverage.reason)
