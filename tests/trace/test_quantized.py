"""Quantized weights (bitsandbytes' 4-bit and 8-bit layers, as QLoRA and LLM.int8 load them) are traced, not
lower bounds: the quantisation state a weight holds is twinned with it and counted, library operators run as the
target's kernels compose them, and activation checkpointing's RNG snapshots are counted on a CPU target."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

import preflight
from preflight._device import held_tensors
from preflight._result import Category
from preflight.trace._tracker import StorageTracker
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


def _linear8bit(bnb, threshold: float = 0.0) -> nn.Module:
    layer = bnb.nn.Linear8bitLt(64, 128, bias=True, has_fp16_weights=False, threshold=threshold)
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


def test_an_8bit_weight_and_the_cb_it_holds_are_one_block():
    # Int8Params keeps CB on its own storage; its twins share one block, as on the device, from the trace's start
    # (not only once the layer's first forward re-points the weight).
    bnb = pytest.importorskip("bitsandbytes")
    model = _Head(_linear8bit(bnb))
    weight = model.q.weight
    assert weight.untyped_storage().data_ptr() == weight.CB.untyped_storage().data_ptr()
    est = preflight.estimate(model, torch.optim.AdamW(model.inp.parameters()), torch.randn(32, 64), step=_step)
    setup = sum(e.nbytes for e in est.events if e.phase == "setup" and est.categories[e.uid] is Category.PARAMETERS)
    held = [t for p in model.parameters() for _, t in held_tensors(p)]
    blocks = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*model.parameters(), *held]}
    assert setup == sum(blocks.values()) == 16384 + 256 + 8192 + 512 + 512  # inp, q's int8 weight, bias and SCB


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
    model = _Head(_linear8bit(bnb, threshold=6.0))
    est = preflight.estimate(model, optimizer_for(model), batch, run, step=_step)
    assert est.coverage.traced and not est.coverage.lower_bound
    assert any("CUDA training path (MatMul8bitLt" in n for n in est.coverage.notes)
    outliers = "assumption: bitsandbytes' LLM.int8 quantization (threshold 6) found no outlier column"
    assert any(n.startswith(outliers) and "keep its 32 input values" in n and n.endswith("(2 call(s))")  # 2 steps
               for n in est.coverage.notes)


def test_8bit_layers_take_bitsandbytes_cuda_path_for_a_cuda_target_and_nothing_else_changes(caplog):
    # On this host bitsandbytes trains 8-bit layers through MatMul8bitFp; for a CUDA target the trace takes
    # MatMul8bitLt, as a GPU does, without its cast warning, and leaves bitsandbytes and the layer as they were.
    bnb = pytest.importorskip("bitsandbytes")
    model = _Head(_linear8bit(bnb, threshold=6.0))
    matmul, state = bnb.matmul, model.q.state
    before = dict(vars(state))
    taken = []
    real_apply = bnb.autograd._functions.MatMul8bitLt.apply

    def apply(*args):
        taken.append(args[0].shape)
        return real_apply(*args)

    bnb.autograd._functions.MatMul8bitLt.apply = apply
    try:
        with caplog.at_level(logging.WARNING, logger="bitsandbytes"):
            run = preflight.Run(target=preflight.Target(gpu="H100-80GB"))
            preflight.estimate(model, torch.optim.AdamW(model.inp.parameters()), torch.randn(32, 64), run,
                               step=_step)
            preflight.estimate(model, torch.optim.AdamW(model.inp.parameters()), torch.randn(32, 64), step=_step)
    finally:
        del bnb.autograd._functions.MatMul8bitLt.apply
    assert taken == [torch.Size([32, 64])] * 2  # the CUDA target's two steps; the CPU target's never
    assert not [r for r in caplog.records if "MatMul8bitLt" in r.getMessage()]
    assert bnb.matmul is matmul and bnb.autograd._functions.matmul is matmul
    assert model.q.state is state and vars(state) == before


def test_bitsandbytes_matmul_is_its_own_again_after_a_step_that_raises():
    bnb = pytest.importorskip("bitsandbytes")
    model = _Head(_linear8bit(bnb, threshold=6.0))
    matmul = bnb.matmul

    def step(m, batch):
        m(batch)
        raise KeyError("the user's own error")

    run = preflight.Run(target=preflight.Target(gpu="H100-80GB"))
    with pytest.raises(KeyError):
        preflight.estimate(model, torch.optim.AdamW(model.inp.parameters()), torch.randn(32, 64), run, step=step)
    assert bnb.matmul is matmul and bnb.autograd._functions.matmul is matmul


def test_each_pipeline_rank_takes_the_cuda_path_too(tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from preflight._cli import main

    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
                      '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}')
    main(["estimate", "--hf-config", str(config), "--batch", "2", "--seq", "16", "--quantize", "int8", "--lora-r",
          "4", "--gpu", "H100-80GB", "--no-suggest", "--pp", "2", "--world-size", "2"])
    out = capsys.readouterr().out
    assert "rank 1:" in out and "CUDA training path (MatMul8bitLt" in out and "found no outlier column" in out


def _events(op, *args, **kwargs) -> list[int]:
    """The bytes of each allocation (+) and free (-) while ``op`` runs on fake tensors of ``args`` ((dtype, shape)
    pairs) for a CUDA target, its outputs kept: library operators run as a CUDA target composes them."""
    fake_mode = FakeTensorMode()
    tracker = StorageTracker(fake_mode, cuda=True)
    with fake_mode:
        args = [torch.empty(a[1], dtype=a[0]) if isinstance(a, tuple) else a for a in args]
    try:
        with fake_mode, tracker:
            outputs = op(*args, **kwargs)
            made = [e.nbytes for e in tracker.events]  # the outputs alive: their frees are not the operator's
            del outputs
    finally:
        tracker.detach()
    return made


def test_bitsandbytes_int8_cuda_operators_allocate_and_free_what_their_cuda_source_does():
    pytest.importorskip("bitsandbytes")
    ops = torch.ops.bitsandbytes
    f16, i8, i32, f32, bf16 = torch.float16, torch.int8, torch.int32, torch.float32, torch.bfloat16
    rows, cols, out = 32, 64, 128
    n = rows * cols
    # backends/cuda/ops.py int8_vectorwise_quant: fp32 row scales, the int8 copy; with a threshold the fp16 |A|
    # (freed once compared) and the bool mask (held to the return), any(), an empty outlier index, the scalar of
    # out_row[:, cols] = 0.
    quant = [4 * rows, n, 2 * n, n, -2 * n, 1, -1, 0, 1, -1, -n]
    assert _events(ops.int8_vectorwise_quant.default, (f16, (rows, cols)), threshold=6.0) == quant
    assert _events(ops.int8_vectorwise_quant.default, (f16, (rows, cols))) == [4 * rows, n]
    # int8_double_quant: the row quantization, then _get_col_absmax (|A|, its mask, the fp16 amax and its fp32 copy;
    # |A| freed at its return), the masked copy, A * 127 (fp16) / col_stats (fp32), its rounding, the int8 copy.
    assert _events(ops.int8_double_quant.default, (f16, (rows, cols)), threshold=6.0) == quant + [
        2 * n, n, 2 * cols, 4 * cols, -2 * cols, -2 * n, 2 * n, 2 * n, 4 * n, -2 * n, 4 * n, -4 * n, n, -4 * n,
        -2 * n, -n]
    # int8_linear_matmul: the int32 output; an inner size that is not a multiple of 4 goes through fp32 copies of
    # both operands, their product and its int32 copy, copied into the output.
    assert _events(ops.int8_linear_matmul.default, (i8, (rows, cols)), (i8, (out, cols))) == [4 * rows * out]
    assert _events(ops.int8_linear_matmul.default, (i8, (rows, 62)), (i8, (out, 62))) == [
        4 * rows * out, 4 * rows * 62, 4 * out * 62, 4 * rows * out, -4 * rows * 62, -4 * out * 62, 4 * rows * out,
        -4 * rows * out, -4 * rows * out]
    # int8_mixed_scaled_mm (no CUDA kernel: its composite): the empty subA, the int32 product, its fp16
    # dequantization (the bf16 bias added in place), the bf16 cast; fp16 and int32 freed on the way out.
    assert _events(ops.int8_mixed_scaled_mm.default, (bf16, (rows, cols)), (i8, (rows, cols)), (i8, (out, cols)),
                   (f32, (rows,)), (f32, (out,)), (torch.int64, (0,)), (bf16, (out,))) == [
        0, 4 * rows * out, 2 * rows * out, 2 * rows * out, -2 * rows * out, -4 * rows * out]
    assert _events(ops.int8_mm_dequant.default, (i32, (rows, out)), (f32, (rows,)), (f32, (out,)),
                   dtype=f16) == [2 * rows * out]  # fp16 asked: the kernel's own output


class _LtProduct(nn.Module):
    """An 8-bit layer whose product is bitsandbytes' ``MatMul8bitLt`` (the path its ``matmul`` takes on CUDA, and
    on CPU outside training), called as ``Linear8bitLt.forward`` calls it."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        from bitsandbytes.autograd._functions import MatMul8bitLt

        if self.layer.weight.CB is not None:
            self.layer.init_8bit_state()
        return MatMul8bitLt.apply(x, self.layer.weight, None, self.layer.bias, self.layer.state)


@pytest.mark.parametrize("threshold", [0.0, 6.0], ids=["no-threshold", "threshold-6"])
def test_bitsandbytes_cuda_training_path_traces_to_the_measured_byte_where_it_runs_on_cpu(threshold):
    # MatMul8bitLt's Python (the tensors it keeps on ctx, the state it sets) with bitsandbytes' CPU kernels,
    # against the measured step; with a threshold, on activations without outliers (the trace's assumption).
    bnb = pytest.importorskip("bitsandbytes")
    model = _Head(_LtProduct(_linear8bit(bnb, threshold=threshold)))
    optimizer = torch.optim.AdamW(model.inp.parameters(), lr=1e-3)
    batch = torch.randn(32, 64) * 0.01
    with torch.no_grad():
        assert model.inp(batch).abs().max() < threshold or not threshold
    est = preflight.estimate(model, optimizer, batch, step=_step)
    measured = preflight.measure(model, optimizer, batch, step=_step)
    assert est.coverage.traced and not est.coverage.lower_bound
    assert est.peak_bytes == measured.peak_bytes
    assert any("found no outlier column" in n for n in est.coverage.notes) == bool(threshold)


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
    if quantization == "int8":  # a CUDA target takes bitsandbytes' CUDA path, traced with transformers' threshold
        cuda = preflight.estimate(model, optimizer, batch, preflight.Run(target=preflight.Target(gpu="H100-80GB")))
        assert cuda.coverage.traced and not cuda.coverage.lower_bound
        assert any("found no outlier column" in n for n in cuda.coverage.notes)
