"""A model built on meta and quantized by `preflight._quantize` is the model `from_pretrained` loads quantized:
the same trace, to the byte (bitsandbytes runs its 4-bit and 8-bit layers on CPU here)."""

import copy
import tempfile

import pytest
import torch

import preflight

pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB = 512
CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)


def _qlora(model, checkpointing):
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))


def _estimate(model):
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return preflight.estimate(model, optimizer, {"input_ids": ids, "labels": ids})


@pytest.mark.slow
@pytest.mark.parametrize("scheme, double_quant, checkpointing", [
    ("nf4", True, False), ("fp4", False, True), ("int8", False, False)])
def test_a_model_quantized_on_meta_traces_as_the_loaded_one(scheme, double_quant, checkpointing):
    from preflight._quantize import bnb_config, quantize_on_meta

    config = transformers.LlamaConfig(**CONFIG)
    quantization = bnb_config(scheme, compute_dtype=torch.bfloat16, double_quant=double_quant)
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=copy.deepcopy(quantization), device_map={"": "cpu"}, dtype=torch.float32)
    with torch.device("meta"):
        planned = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    quantize_on_meta(planned, quantization)
    shapes = {n: (p.shape, p.dtype, type(p).__name__) for n, p in loaded.named_parameters()}
    assert {n: (p.shape, p.dtype, type(p).__name__) for n, p in planned.named_parameters()} == shapes
    assert any(name == "Params4bit" if scheme != "int8" else name == "Int8Params" for *_, name in shapes.values())
    loaded_est, planned_est = _estimate(_qlora(loaded, checkpointing)), _estimate(_qlora(planned, checkpointing))
    assert not planned_est.coverage.lower_bound
    assert planned_est.peak_bytes == loaded_est.peak_bytes
    assert planned_est.breakdown == loaded_est.breakdown


def test_quantizing_on_meta_leaves_bitsandbytes_able_to_quantize_real_weights():
    """bitsandbytes caches its double-quantization map on the device of the first call: made on meta, it would
    break the user's next real load."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    from preflight._quantize import bnb_config, quantize_on_meta

    F.name2qmap.clear()  # the state of a process that has not quantized yet
    with torch.device("meta"):
        planned = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG))
    quantize_on_meta(planned, bnb_config("nf4", double_quant=True))
    real = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, compress_statistics=True)._quantize("cpu")
    assert real.quant_state.state2.code.device.type == "cpu"


def test_only_a_model_on_meta_is_quantized_here():
    from preflight._quantize import bnb_config, quantize_on_meta

    with pytest.raises(ValueError, match="meta device"):
        quantize_on_meta(torch.nn.Linear(4, 4), bnb_config("nf4"))
