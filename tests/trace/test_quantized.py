"""Quantized weights (bitsandbytes' 4-bit and 8-bit layers, as QLoRA and LLM.int8 load them) are traced, not
lower bounds: the quantisation state a weight holds is twinned with it and counted, library operators run as the
target's kernels compose them, and activation checkpointing's RNG snapshots are counted on a CPU target."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import preflight
from preflight._device import held_tensors
from preflight.trace._library_kernels import composite_kernel


def _step(model, batch):
    return model(batch)


class _Head(nn.Module):
    """A trainable layer in fp32, then ``quantized``, then a loss; optionally checkpointed (reentrant)."""

    def __init__(self, quantized: nn.Module, *, checkpointed: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.q = quantized
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.inp(x)
        out = checkpoint(self.q, h, use_reentrant=True) if self.checkpointed else self.q(h)
        return out.float().pow(2).mean()


def _linear4bit(bnb, quant_type: str, double: bool) -> nn.Module:
    layer = bnb.nn.Linear4bit(64, 128, bias=False, compute_dtype=torch.bfloat16, compress_statistics=double,
                              quant_type=quant_type)
    weight = bnb.nn.Params4bit(torch.randn(128, 64), requires_grad=False, compress_statistics=double,
                               quant_type=quant_type)
    layer.weight = weight._quantize("cpu")
    return layer


def _linear8bit(bnb) -> nn.Module:
    layer = bnb.nn.Linear8bitLt(64, 128, bias=True, has_fp16_weights=False)
    return layer.to("cpu")  # quantizes the weight to int8 (CB, SCB) as transformers' load_in_8bit does


def _estimate_and_measure(model):
    optimizer = torch.optim.AdamW(model.inp.parameters(), lr=1e-3)
    batch = torch.randn(32, 64)
    est = preflight.estimate(model, optimizer, batch, step=_step)
    measured = preflight.measure(model, optimizer, batch, step=_step)
    return est, measured


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [False, True], ids=["single", "double-quant"])
def test_4bit_weights_are_traced_to_the_measured_byte(quant_type, double):
    bnb = pytest.importorskip("bitsandbytes")
    model = _Head(_linear4bit(bnb, quant_type, double))
    held = held_tensors(model.q.weight)
    # absmax (uint8 with double quantization, plus its own absmax, code and offset), the 4-bit code
    assert {path for path, _ in held} >= {".quant_state.absmax", ".quant_state.code"}
    assert any(path.startswith(".quant_state.state2") for path, _ in held) == double
    est, measured = _estimate_and_measure(model)
    assert est.coverage.traced and not est.coverage.lower_bound
    assert est.peak_bytes == measured.peak_bytes


def test_8bit_weights_are_traced_not_blamed_on_the_user():
    bnb = pytest.importorskip("bitsandbytes")
    model = _Head(_linear8bit(bnb))
    assert {path for path, _ in held_tensors(model.q.weight)} == {".CB", ".SCB"}
    est, measured = _estimate_and_measure(model)
    assert est.coverage.traced and not est.coverage.lower_bound
    assert abs(est.peak_bytes - measured.peak_bytes) <= 64, (est.peak_bytes, measured.peak_bytes)


def test_the_users_quantized_model_trains_as_without_preflight():
    bnb = pytest.importorskip("bitsandbytes")

    def train(with_estimate: bool):
        torch.manual_seed(0)
        model = _Head(_linear4bit(bnb, "nf4", True))
        optimizer = torch.optim.AdamW(model.inp.parameters(), lr=1e-2)
        batch = torch.randn(32, 64)
        state = {k: v.clone() for k, v in vars(model.q.weight.quant_state).items() if isinstance(v, torch.Tensor)}
        if with_estimate:
            preflight.estimate(model, optimizer, batch, step=_step)
        for _ in range(2):
            model(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        return model, state

    plain, _ = train(False)
    traced, state = train(True)
    for (name, a), b in zip(plain.state_dict().items(), traced.state_dict().values()):
        assert torch.equal(a, b), name
    for name, value in state.items():  # the quantisation state is the user's own, untouched
        assert torch.equal(getattr(traced.q.weight.quant_state, name), value), name


def test_checkpointings_rng_snapshots_are_counted_on_a_cpu_target():
    # The 4-bit layer puts the peak in the recomputation, while the forward's snapshot (5,056 bytes) is alive.
    bnb = pytest.importorskip("bitsandbytes")
    model = _Head(_linear4bit(bnb, "nf4", False), checkpointed=True)
    est, measured = _estimate_and_measure(model)
    assert est.peak_bytes == measured.peak_bytes


def test_library_composites_are_found_from_the_librarys_registrations():
    pytest.importorskip("bitsandbytes")
    gemm = torch.ops.bitsandbytes.gemm_4bit.default
    dequantize = torch.ops.bitsandbytes.dequantize_4bit.default
    assert composite_kernel(gemm, cuda=False) is not None  # no CPU kernel: the default composite runs
    assert composite_kernel(dequantize, cuda=False) is None  # a CPU kernel of its own: its fake output is it
    assert composite_kernel(torch.ops.aten.linear.default, cuda=False) is None  # torch's own: left to fake mode
    run, note = composite_kernel(gemm, cuda=True)
    a = torch.empty(8, 64, dtype=torch.bfloat16, device="meta")
    assert "assumed dequantize + linear" in note(a, None, [128, 64], None, 64)
    assert note(a[:2], None, [128, 64], None, 64) is None  # the fused kernel below 5 rows: no assumption


def test_a_cuda_target_says_what_it_assumed_for_quantized_layers():
    bnb = pytest.importorskip("bitsandbytes")
    run = preflight.Run(target=preflight.Target(gpu="H100-80GB"))
    optimizer_for = lambda model: torch.optim.AdamW(model.inp.parameters())  # noqa: E731
    batch = torch.randn(32, 64)
    model = _Head(_linear4bit(bnb, "nf4", True))
    est = preflight.estimate(model, optimizer_for(model), batch, run, step=_step)
    assert est.coverage.traced and any("4-bit matmul with 32 rows" in n for n in est.coverage.notes)
    model = _Head(_linear8bit(bnb))
    est = preflight.estimate(model, optimizer_for(model), batch, run, step=_step)
    assert any("MatMul8bitLt" in n for n in est.coverage.notes)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["nf4", "fp4-single", "int8"])
def test_a_transformers_model_loaded_for_qlora_or_llm_int8_is_traced_within_1_percent(tmp_path, quantization):
    """As users load them: ``from_pretrained(quantization_config=BitsAndBytesConfig(...))``, peft's
    ``prepare_model_for_kbit_training`` (fp32 norms and head, input grads) and LoRA on the attention."""
    pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=500)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    if quantization == "int8":
        quantization_config = transformers.BitsAndBytesConfig(load_in_8bit=True)
    else:
        quantization_config = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quantization[:3], bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=not quantization.endswith("single"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization_config,
                                                              device_map={"": "cpu"})
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                       task_type="CAUSAL_LM"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, 500, (2, 64))
    batch = {"input_ids": ids, "labels": ids}
    est = preflight.estimate(model, optimizer, batch)
    measured = preflight.measure(model, optimizer, batch)
    assert est.coverage.traced and not est.coverage.lower_bound
    assert abs(est.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes, (est.peak_bytes,
                                                                                       measured.peak_bytes)
