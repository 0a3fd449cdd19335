"""Generation traced to its longest (`preflight.trace._generation`): ``model.generate`` predicted against its
measured peak on CPU, greedy, beam search, sampling and beam sampling, decoder-only and encoder-decoder."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import make_gpt2, make_llama  # noqa: E402

import preflight  # noqa: E402
from preflight._device import live_storages  # noqa: E402
from preflight._measure import cpu_profiled_peak  # noqa: E402


def make_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(num_layers=2, d_model=128, d_ff=256, num_heads=4, d_kv=32,
                                               vocab_size=1000, decoder_start_token_id=0, pad_token_id=0,
                                               eos_token_id=1))


def prompts(batch: int = 3, seq: int = 24, vocab: int = 1000) -> dict[str, torch.Tensor]:
    ids = torch.randint(2, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def measured_generation(model, inputs, generation) -> int:
    before = live_storages([list(model.parameters()), list(model.buffers()), inputs], torch.device("cpu"))
    with torch.no_grad():
        peak, _ = cpu_profiled_peak(lambda: model.generate(**inputs, **generation), resident=before)
    return sum(before.values()) + peak


# min_new_tokens = max_new_tokens makes the real run as long as the trace assumes (a random model may otherwise
# pick its end-of-sequence token); the trace runs the same logits processor.
CASES = {
    "gpt2-greedy": (make_gpt2, dict(max_new_tokens=12, min_new_tokens=12, pad_token_id=0)),
    "llama-beams": (make_llama, dict(max_new_tokens=12, min_new_tokens=12, num_beams=4)),
    "llama-sampling": (make_llama, dict(max_new_tokens=12, min_new_tokens=12, do_sample=True,
                                        num_return_sequences=2)),
    "llama-beam-sampling": (make_llama, dict(max_new_tokens=12, min_new_tokens=12, num_beams=3, do_sample=True)),
    "llama-static-cache": (make_llama, dict(max_new_tokens=12, min_new_tokens=12, num_beams=2,
                                            cache_implementation="static")),
    "t5-beams": (make_t5, dict(max_new_tokens=12, min_new_tokens=12, num_beams=3)),
    "t5-sampling": (make_t5, dict(max_new_tokens=12, min_new_tokens=12, do_sample=True, num_return_sequences=2)),
}
SLOW_CASES = {"llama-beam-sampling", "llama-static-cache", "llama-sampling", "t5-beams", "llama-beams",
              "t5-sampling"}  # the fast tier: greedy


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in SLOW_CASES else case
                                  for case in CASES])
def test_generation_is_predicted_to_the_measured_peak(case):
    make, generation = CASES[case]
    model = make().eval()
    inputs = prompts(vocab=model.config.vocab_size)
    est = preflight.estimate_generation(model, inputs, preflight.Run(generation=generation))
    assert est.coverage.traced and not est.coverage.lower_bound and est.peak_phase == "generate"
    measured = measured_generation(model, inputs, generation)
    assert abs(est.peak_bytes - measured) <= 1e-4 * measured, (est.peak_bytes, measured)
    note = next(n for n in est.coverage.notes if n.startswith("generation:"))
    assert "(12 decoding step(s))" in note  # prefill's token and 11 more, each asked whether to stop
    assert ("early-stop heuristic" in note) == (generation.get("num_beams", 1) > 1)


@pytest.mark.slow
def test_without_a_minimum_length_the_trace_runs_to_max_new_tokens():
    # The trace does not know the tokens, so it takes the longest generation: never below a real run, which may stop
    # at its end-of-sequence token, and equal to one that runs the whole length.
    model = make_llama().eval()
    inputs = prompts(seq=4, vocab=model.config.vocab_size)  # a short prompt: the cache of 60 tokens is the peak
    est = preflight.estimate_generation(model, inputs, preflight.Run(generation=dict(max_new_tokens=60)))
    # A real run that cannot meet its end-of-sequence token (one outside the vocabulary) runs the whole length with
    # the same criteria and processors.
    never = model.config.vocab_size + 5
    longest = measured_generation(model, inputs, dict(max_new_tokens=60, eos_token_id=never))
    shorter = measured_generation(model, inputs, dict(max_new_tokens=5, eos_token_id=never))
    assert est.peak_bytes == longest and est.peak_bytes > shorter, (est.peak_bytes, longest, shorter)
    assert "(60 decoding step(s))" in " ".join(est.coverage.notes)


@pytest.mark.slow
def test_generation_inside_an_evaluation_step_is_traced():
    # A validation step that generates (as a LightningModule's may) traces through the same answers.
    model = make_t5().eval()
    inputs = prompts(vocab=1000)
    generation = dict(max_new_tokens=8, min_new_tokens=8, num_beams=2)

    def step(m, batch):
        tokens = m.generate(**batch, **generation)
        return m(**batch, labels=tokens[:, 1:].contiguous()).loss, tokens

    est = preflight.estimate_eval(model, inputs, step=step)
    before = live_storages([list(model.parameters()), list(model.buffers()), inputs], torch.device("cpu"))
    with torch.no_grad():
        peak, _ = cpu_profiled_peak(lambda: step(model, inputs), resident=before)
    measured = sum(before.values()) + peak
    assert est.coverage.traced and abs(est.peak_bytes - measured) <= 1e-4 * measured, (est.peak_bytes, measured)


def test_the_stopping_criteria_are_put_back_and_a_real_generate_is_untouched():
    from transformers.generation.stopping_criteria import StoppingCriteriaList
    from transformers.generation.utils import GenerationMixin

    call, heuristic = StoppingCriteriaList.__call__, GenerationMixin.__dict__["_check_early_stop_heuristic"]
    model = make_gpt2().eval()
    inputs = prompts(vocab=model.config.vocab_size)
    preflight.estimate_generation(model, inputs, preflight.Run(generation=dict(max_new_tokens=4, num_beams=2)))
    assert StoppingCriteriaList.__call__ is call
    assert GenerationMixin.__dict__["_check_early_stop_heuristic"] is heuristic
    # A real run still stops where its criteria say: here after its first token.
    from transformers.generation.stopping_criteria import StoppingCriteria

    class Done(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.ones(input_ids.shape[0], dtype=torch.bool)

    out = model.generate(**inputs, max_new_tokens=6, pad_token_id=0, stopping_criteria=StoppingCriteriaList([Done()]))
    assert out.shape[1] == inputs["input_ids"].shape[1] + 1


def test_sampling_from_a_distribution_counts_multinomials_temporaries():
    # torch.multinomial's kernel draws an exponential tensor of the probabilities' size and, for several samples,
    # a values tensor for topk: the composite traces both (the fake implementation alone returns the output only).
    class Sampler(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.logits = torch.nn.Linear(64, 5000)

        def forward(self, x, n):
            return torch.multinomial(torch.softmax(self.logits(x), -1), n)

    model = Sampler()
    x = torch.randn(16, 64)
    for n in (1, 4):
        est = preflight.estimate_eval(model, x, step=lambda m, b, n=n: m(b, n))
        before = live_storages([list(model.parameters()), x], torch.device("cpu"))
        with torch.no_grad():
            peak, _ = cpu_profiled_peak(lambda n=n: model(x, n), resident=before)
        assert est.peak_bytes == sum(before.values()) + peak, n
