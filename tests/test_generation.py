"""`preflight.estimate_generation`'s description and its closed-form cross-check (`preflight._generation`)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import make_llama  # noqa: E402

import preflight  # noqa: E402
from preflight._generation import kv_cache_bytes  # noqa: E402


def test_the_closed_form_is_the_one_users_compute():
    # Llama-3-8B: 32 layers, 8 KV heads of 128 dims, bf16: 2 x 32 x 8 x 128 x 2 B = 128 KiB per token and sequence.
    config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                      num_hidden_layers=32, intermediate_size=14336, vocab_size=128256)
    assert kv_cache_bytes(config, sequences=1, tokens=1, itemsize=2) == 128 * 1024
    assert kv_cache_bytes(config, sequences=4, tokens=8192, itemsize=2) == 4 * 8192 * 128 * 1024
    # GPT-2 names its sizes differently and has as many KV heads as heads: 2 x 12 x 768 x 4 B per token.
    gpt2 = transformers.GPT2Config()
    assert kv_cache_bytes(gpt2, sequences=1, tokens=1, itemsize=4) == 2 * 12 * 768 * 4
    # An encoder-decoder adds its cross-attention over the encoder's tokens (T5-small: 6 layers, 8 x 64).
    t5 = transformers.T5Config.from_dict({"num_layers": 6, "num_heads": 8, "d_kv": 64, "d_model": 512})
    assert kv_cache_bytes(t5, sequences=2, tokens=10, source_tokens=30, itemsize=4) == 2 * 6 * 8 * 64 * 2 * 4 * 40


@pytest.mark.slow
def test_the_note_sets_the_formula_beside_the_traced_peak():
    model = make_llama().eval()  # 2 layers, 2 KV heads of 32 dims, fp32
    ids = torch.randint(1, 100, (3, 24), generator=torch.Generator().manual_seed(0))
    est = preflight.estimate_generation(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                        preflight.Run(generation={"max_new_tokens": 16, "num_beams": 2}))
    note = next(n for n in est.coverage.notes if n.startswith("KV cache by the closed form"))
    # 6 sequences (3 prompts x 2 beams) of 24 + 16 tokens: 2 x 2 x 2 x 32 x 4 B x 6 x 40 = 240 KiB.
    assert "240.00 KiB for 6 sequence(s) of 40 token(s) in float32" in note
    held = sum(est.breakdown[k] for k in ("parameters", "buffers", "inputs"))
    # bf16-true casts the fp32 weights, so the cache is bf16: half the bytes.
    from preflight._generation import kv_cache_note

    cast = kv_cache_note(model, {"input_ids": ids}, {"max_new_tokens": 16, "num_beams": 2}, "bf16-true")
    assert cast[0] == 120 * 1024 and "in bfloat16" in cast[1]
    assert f"({preflight.format_bytes(est.peak_bytes - held - 240 * 1024)} beyond the formula's cache)" in note


def test_the_generation_section_is_checked_and_laid_over_the_trainers():
    with pytest.raises(TypeError, match="dict of model.generate keyword arguments"):
        preflight.Run(generation=[("max_new_tokens", 4)])
    with pytest.raises(ValueError, match=r"generation\['num_beams'\]` should be a positive whole number"):
        preflight.Run(generation={"num_beams": 0})
    with pytest.raises(ValueError, match="max_new_tokens"):
        preflight.Run(generation={"max_new_tokens": 2.5})
    trainer_said = preflight.Run(generation={"max_length": 64, "num_beams": 4})
    user_said = preflight.Run(generation={"num_beams": 1, "do_sample": True})
    assert user_said.over(trainer_said).generation == {"max_length": 64, "num_beams": 1, "do_sample": True}
    assert preflight.Run().over(trainer_said).generation == {"max_length": 64, "num_beams": 4}
    assert trainer_said.cli_flags() == []  # a training run's flags: evaluation's generation is read off the trainer
    assert trainer_said.to_dict()["generation"] == {"max_length": 64, "num_beams": 4}


def test_a_model_without_generate_is_refused_with_the_fix():
    with pytest.raises(TypeError, match="estimate_eval"):
        preflight.estimate_generation(torch.nn.Linear(4, 4), torch.zeros(2, 4))


@pytest.mark.slow
def test_the_generation_example_runs():
    from conftest import example_output

    stdout = example_output("generation.py", timeout=600)
    assert "at generate" in stdout and "(48 decoding step(s))" in stdout


def test_a_static_cache_on_a_cuda_target_says_transformers_compiles_its_decoding():
    # On a CUDA device generate compiles the decoding forward for a static cache (measured on an H200: 17% above
    # the eager figure; with disable_compile=True within 0.4%): the trace runs it eager and says so.
    model = make_llama().eval()
    ids = torch.randint(3, 1000, (2, 8))
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    static = {"max_new_tokens": 2, "cache_implementation": "static", "pad_token_id": 0}

    def notes(generation, target):
        est = preflight.estimate_generation(model, prompts, preflight.Run(target=target, generation=generation))
        return [n for n in est.coverage.notes if "transformers compiles the decoding forward" in n]

    h200 = preflight.Target(gpu="H200")
    [note] = notes(static, h200)
    assert note.startswith("cache_implementation='static' on a CUDA device") and "disable_compile=True" in note
    assert notes({**static, "disable_compile": True}, h200) == []
    assert notes(static, preflight.Target()) == []  # a CPU target: generate does not compile there
    assert notes({"max_new_tokens": 2, "pad_token_id": 0}, h200) == []  # the dynamic cache is not compiled
