"""Depth-independent traces: the timeline composed from three shallow traces equals the full trace, event for event
(sizes, order, operators, phases, categories, which allocation each free releases), so peak, breakdown, reserved
memory and sharded figures agree to the byte; anything else is traced in full and says so."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import preflight
from preflight.trace import trace_composed, trace_steps
from preflight.trace import _compose
from preflight.trace._stack import find_stack

VOCAB = 1000


@pytest.fixture(autouse=True)
def _compose_small_models(monkeypatch):
    # The tests' models have 6 to 10 blocks; production composes from 10 periods, where it saves time.
    monkeypatch.setattr(_compose, "MIN_PERIODS", 5)


def _llama(layers: int = 6, **kwargs):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, **kwargs)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _gpt2(layers: int = 6):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128))


def _gemma2(layers: int = 10):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128,
                       sliding_window=16, query_pre_attn_scalar=16)
    torch.manual_seed(0)
    return Gemma2ForCausalLM(cfg)


def _batch(batch_size: int = 2, seq: int = 32) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _canonical(events, categories):
    """Events with uids replaced by the position of their allocation."""
    where, out = {}, []
    for i, e in enumerate(events):
        if e.nbytes >= 0:
            where[e.uid] = i
            out.append((e.nbytes, e.op, e.phase, categories.get(e.uid), -1))
        else:
            out.append((e.nbytes, e.op, e.phase, categories.get(e.uid), where[e.uid]))
    return out


def _same(fast: preflight.Estimate, full: preflight.Estimate) -> None:
    assert any(n.startswith("depth-independent trace") for n in fast.coverage.notes), fast.coverage.notes
    assert fast.peak_bytes == full.peak_bytes
    assert fast.breakdown == full.breakdown
    assert fast.peak_phase == full.peak_phase
    assert fast.peak_reserved_bytes == full.peak_reserved_bytes
    assert fast.timeline == full.timeline
    assert fast.num_ops == full.num_ops
    assert _canonical(fast.events, fast.categories) == _canonical(full.events, full.categories)


def _both(model, optimizer, batch, run=None, **kwargs):
    run = run or preflight.Run()
    fast = preflight.estimate(model, optimizer, batch, run.replace(fast=True), **kwargs)
    full = preflight.estimate(model, optimizer, batch, run.replace(fast=False), **kwargs)
    return fast, full


@pytest.mark.slow
def test_llama_foreach_adamw_h100_composes_to_the_byte():
    model = _llama(7)
    fast, full = _both(model, torch.optim.AdamW(model.parameters()), _batch(), run=preflight.Run(precision="bf16-true", target=preflight.Target(gpu="H100-80GB")))
    _same(fast, full)
    assert "model.layers" in fast.coverage.notes[-1] or any("model.layers" in n for n in fast.coverage.notes)


@pytest.mark.parametrize("offload", ["save_on_cpu", "streams"])
def test_offloaded_activations_under_autocast_compose_to_the_byte(offload):
    # The autocast weight cache is cleared in hash-map order at the forward's end; with the saved activations
    # offloaded, the cast weights are freed there (their host copies are what autograd keeps), and the trace
    # settles those simultaneous frees in allocation order, so every depth frees them alike. The stream hooks
    # match a storage saved again only while it lives (a dead storage's address is reused at random in a trace).
    model = _llama(6)
    run = preflight.Run(precision="bf16-mixed", target=preflight.Target(gpu="A100-80GB"),
                        loop=preflight.Loop(offload_activations=offload))
    fast, full = _both(model, torch.optim.AdamW(model.parameters()), _batch(), run=run)
    _same(fast, full)
    # The notes' counts (tensors and bytes moved, attention kernels called) are those of the full depth.
    counted = [n for n in full.coverage.notes if n.startswith(("saved-tensor hooks moved", "CUDA semantics"))]
    assert len(counted) == 2 and all(n in fast.coverage.notes for n in counted)


def test_checkpointed_blocks_with_streamed_offloading_are_traced_in_full_and_say_why():
    # Checkpointed blocks offload about one tensor each, and the stream hooks keep the last 5 offloaded on the
    # device: that lag spans 5 blocks, more than the shallow traces (2 to 4 blocks) hold. Composed anyway, the
    # 6-block timeline would differ from the full trace's in the forward; it is traced in full, with the reason.
    model = _llama(6)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    run = preflight.Run(precision="bf16-true", target=preflight.Target(gpu="H100-80GB"),
                        loop=preflight.Loop(offload_activations="streams"))
    fast, full = _both(model, torch.optim.AdamW(model.parameters()), _batch(), run=run)
    assert any("traced in full (fast=True)" in n and "keep the last 5 offloaded tensors" in n
               for n in fast.coverage.notes), fast.coverage.notes
    assert fast.peak_bytes == full.peak_bytes and fast.events == full.events


def test_numbers_that_grow_by_block_in_the_shallow_notes_are_extrapolated():
    from preflight.trace._run import TraceResult

    def traced(*notes):
        return TraceResult(events=[], categories={}, num_ops=0, seconds=0.0, notes=list(notes))

    traces = [traced(f"moved {n} tensor(s) ({b:,} B), torch 2.13.0, sm_80", f"kernels efficient x{k}, flash x{n}",
                     f"x: {k}.5% at layers.{k}, {k}%", f"{20 - n} left")
              for n, b, k in ((10, 9_000, 4), (13, 10_500, 6), (16, 12_000, 8))]
    # 5 periods more than the shallowest trace: 10 + 5 * 3 tensors, 9,000 + 5 * 1,500 bytes, 4 + 5 * 2 kernels.
    # A note with a changing decimal, percentage or module index, or a count that falls, is the deepest trace's.
    assert _compose.scaled_notes(traces, 5) == ["moved 25 tensor(s) (16,500 B), torch 2.13.0, sm_80",
                                                "kernels efficient x14, flash x25", "x: 8.5% at layers.8, 8%",
                                                "4 left"]
    uneven = [traced(f"moved {n}") for n in (1, 2, 4)]
    assert _compose.scaled_notes(uneven, 5) == ["moved 4"]


@pytest.mark.slow
def test_gpt2_for_loop_adamw_on_cpu():
    model = _gpt2(6)
    _same(*_both(model, torch.optim.AdamW(model.parameters()), _batch()))


@pytest.mark.slow
def test_gemma2_alternating_sliding_and_global_attention_has_period_two():
    model = _gemma2(10)
    optimizer = torch.optim.AdamW(model.parameters())
    stack = find_stack(model, optimizer, min_periods=1)
    assert (stack.name, stack.blocks, stack.period) == ("model.layers", 10, 2)
    _same(*_both(model, optimizer, _batch(), run=preflight.Run(target=preflight.Target(gpu="H100-80GB"))))
    assert model.config.num_hidden_layers == 10 and len(model.config.layer_types) == 10  # put back


@pytest.mark.slow
def test_gradient_checkpointing():
    model = _llama(6)
    model.gradient_checkpointing_enable()
    _same(*_both(model, torch.optim.AdamW(model.parameters()), _batch(), run=preflight.Run(target=preflight.Target(gpu="H100-80GB"))))


@pytest.mark.slow
def test_a_vision_tower_as_deep_as_the_language_model_keeps_its_depth():
    # LLaVA: the language model's stack is truncated for the shallow traces; the vision tower's config also says
    # 6 layers, and must keep saying so (LLaVA reads its feature layer through it).
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                                        num_attention_heads=4, image_size=32, patch_size=8),
                         text_config=LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB),
                         image_token_id=VOCAB - 1, vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    ids = torch.cat([torch.full((2, 16), VOCAB - 1), torch.randint(0, VOCAB - 8, (2, 16))], dim=1)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.masked_fill(ids == VOCAB - 1, -100),
             "pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    seen = []
    model.model.language_model.register_forward_pre_hook(
        lambda *_: seen.append((config.text_config.num_hidden_layers, config.vision_config.num_hidden_layers)))
    fast, full = _both(model, torch.optim.AdamW(model.parameters()), batch)
    assert {text for text, _ in seen} == {2, 3, 4, 6} and {vision for _, vision in seen} == {6}, seen
    assert not any("TypeError" in n for n in fast.coverage.notes), fast.coverage.notes
    assert (fast.peak_bytes, fast.breakdown) == (full.peak_bytes, full.breakdown)


@pytest.mark.slow
def test_selective_activation_checkpointing():
    # torch's selective checkpointing: each block saves its matmuls and recomputes the rest in the backward.
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

        def inner(self, x):
            return x + self.down(torch.relu(self.up(x)).sin())

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, policy))

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = torch.nn.Linear(16, 64), torch.nn.Linear(64, 1)
            self.layers = torch.nn.ModuleList([Block() for _ in range(7)])

        def forward(self, x):
            x = self.inp(x)
            for layer in self.layers:
                x = layer(x)
            return self.out(x).pow(2).mean()

    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    _same(*_both(model, torch.optim.AdamW(model.parameters()), x, step=lambda m, b: m(b)))


@pytest.mark.slow
def test_lora_with_gradient_accumulation_and_lightning_zero_grad():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(6), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    _same(*_both(model, optimizer, _batch(), run=preflight.Run(precision="bf16-mixed", loop=preflight.Loop(accumulate=2, zero_grad="before_backward"), target=preflight.Target(gpu="H100-80GB"))))


@pytest.mark.slow
@pytest.mark.parametrize("target", [{}, {"gpu": "H100-80GB", "precision": "16-mixed", "grad_scaler": True}])
def test_gradient_clipping_whose_norms_grow_with_depth(target):
    run = preflight.Run(precision=target.get("precision"), target=preflight.Target(gpu=target.get("gpu")),
                        loop=preflight.Loop(max_grad_norm=1.0, grad_scaler=target.get("grad_scaler", False)))
    # clip_grad_norm_ stacks one norm per gradient: a storage whose size grows with the number of blocks. At 12
    # blocks it is 148 x 4 B (1,024 B in 512-byte CUDA blocks); at the traced depths of 2 to 4, 112 to 208 B.
    model = _gpt2(12)
    fast, full = _both(model, torch.optim.AdamW(model.parameters()), _batch(), run=run)
    _same(fast, full)
    stacked = 4 * sum(1 for p in model.parameters())
    assert stacked == 592
    if not target:  # (a CUDA target's events are in 512-byte blocks; `_same` compares them with the full trace)
        assert any(e.nbytes == stacked and "optimizer" in e.phase for e in fast.events)


@pytest.mark.slow
def test_parameter_groups_whose_stretches_meet_in_zero_grad():
    # The HF Trainer's groups: weights with decay, then biases and LayerNorm without. zero_grad frees the last
    # block's weight gradients and then the first block's bias gradients: one insertion at that junction would
    # explain one more block but interleave two; it is split in two and each part composed on its own.
    model = _gpt2(7)
    no_decay = [p for n, p in model.named_parameters() if "bias" in n or "ln" in n]
    decay = [p for n, p in model.named_parameters() if not ("bias" in n or "ln" in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    _same(*_both(model, optimizer, _batch(), run=preflight.Run(loop=preflight.Loop(max_grad_norm=1.0))))


@pytest.mark.slow
def test_sharded_rank_and_hf_style_parameter_groups():
    model = _llama(6)
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    _same(*_both(model, optimizer, _batch(), run=preflight.Run(precision="bf16-true", target=preflight.Target(gpu="H100-80GB"), parallel=preflight.ParallelPlan(4, "zero3"))))


def test_a_bitsandbytes_optimizer_keeps_its_own_settings_in_the_shallow_traces():
    # HF's optim="adamw_bnb_8bit" is bnb.optim.AdamW(..., optim_bits=8): the setting lives in the optimizer's
    # ``args``, which the shallow traces' view of the optimizer must keep (copy.copy drops it: 32-bit state, +52%).
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(400, 256), nn.Linear(256, 400)) for _ in range(12)])
    step = lambda m, b: m(b).square().mean()  # noqa: E731
    figures = []
    for fast in (True, False):
        optimizer = bnb.optim.AdamW(model.parameters(), optim_bits=8)
        defaults = dict(optimizer.defaults)
        est = preflight.estimate(model, optimizer, torch.randn(8, 400), preflight.Run(fast=fast), step=step)
        assert optimizer.defaults == defaults  # the shallow traces' view of it added nothing to its dict
        assert any(n.startswith("depth-independent trace") for n in est.coverage.notes) == fast
        figures.append((est.peak_bytes, est.breakdown["optimizer_state"]))
    assert figures[0] == figures[1]
    # uint8 states with one fp32 maximum per 256 elements for the weights; fp32 states for the biases (< 4096)
    weights = 24 * 400 * 256
    assert figures[0][1] == 2 * (weights + 4 * weights // 256) + 2 * 4 * 12 * (256 + 400)


@pytest.mark.slow
def test_composed_deeper_than_the_traced_depths():
    """Compose 10 blocks from traces of 2, 3 and 4 and compare with the 10-block trace."""
    model = _llama(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    options = dict(step=None, precision=None, trace_device=torch.device("cpu"), target_device=torch.device("cuda"),
                   steps=2)
    composed, note = trace_composed(model, optimizer, _batch(), **options)
    full = trace_steps(model, optimizer, _batch(), **options)
    assert note.startswith("depth-independent trace: the 10 blocks of model.layers (period 1) composed from "
                           "traces of 2, 3, 4 blocks"), note
    assert _canonical(composed.events, composed.categories) == _canonical(full.events, full.categories)
    assert composed.num_ops == full.num_ops


@pytest.mark.slow
def test_the_model_is_left_as_it_was():
    model = _llama(6)
    optimizer = torch.optim.AdamW(model.parameters())
    layers = list(model.model.layers)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    preflight.estimate(model, optimizer, _batch(), run=preflight.Run(fast=True))
    assert list(model.model.layers) == layers and len(model.model.layers) == 6
    assert model.config.num_hidden_layers == 6
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert optimizer.state == {} or len(optimizer.state) == 0
    assert len(optimizer.param_groups[0]["params"]) == len(before)


class _Funnel(nn.Module):
    """Not a repetition: each layer narrower than the last."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(64 - 4 * i, 60 - 4 * i) for i in range(12)])

    def forward(self, x):
        return self.layers(x).sum()


def test_a_model_without_a_repeated_stack_is_traced_in_full_and_says_so():
    model = _Funnel()
    optimizer = torch.optim.AdamW(model.parameters())
    fast = preflight.estimate(model, optimizer, torch.randn(8, 64), run=preflight.Run(fast=True))
    full = preflight.estimate(model, optimizer, torch.randn(8, 64))
    assert fast.peak_bytes == full.peak_bytes
    assert [n for n in fast.coverage.notes if n.startswith("traced in full (fast=True)")] == [
        "traced in full (fast=True): layers has 12 blocks repeating with a period of 12: fewer than 5 periods, a "
        "full trace costs less"]


def test_blocks_that_differ_in_an_attribute_are_not_one_period():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Qwen2 uses sliding attention from layer 4 on: the blocks differ in `sliding_window`, so no short period.
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, use_sliding_window=True, sliding_window=16,
                      max_window_layers=4)
    model = Qwen2ForCausalLM(cfg)
    found = find_stack(model, torch.optim.AdamW(model.parameters()), min_periods=2)
    assert isinstance(found, str) and "period of 8" in found, found


def test_an_optimizer_not_in_block_order_is_traced_in_full():
    model = _llama(6)
    params = sorted(model.named_parameters(), key=lambda kv: kv[0].split(".")[-2:])  # grouped by kind, not block
    optimizer = torch.optim.AdamW([p for _, p in params])
    found = find_stack(model, optimizer, min_periods=2)
    assert isinstance(found, str) and ("block order" in found or "mixes" in found), found


@pytest.mark.slow
def test_max_batch_size_with_fast_traces_matches_full_traces():
    model = _llama(6)
    optimizer = torch.optim.AdamW(model.parameters())

    def make_batch(b):
        return _batch(b, 16)

    budget = preflight.estimate(model, optimizer, make_batch(3)).peak_bytes
    fast = preflight.max_batch_size(model, optimizer, make_batch, run=preflight.Run(target=preflight.Target(budget=budget), fast=True), max_batch=4)
    full = preflight.max_batch_size(model, optimizer, make_batch,
                                    run=preflight.Run(target=preflight.Target(budget=budget), fast=False), max_batch=4)
    assert int(fast) == int(full) == 3
    assert fast.predicted_peak_bytes == full.predicted_peak_bytes


@pytest.mark.slow
def test_mixture_of_experts_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                             num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128))
    _same(*_both(model, torch.optim.AdamW(model.parameters()), _batch(), run=preflight.Run(target=preflight.Target(gpu="H100-80GB"))))


@pytest.mark.slow
def test_hybrid_mamba_attention_pattern_jamba_composes_with_its_convolution_scratch():
    """Jamba alternates Mamba and attention layers, and dense and expert MLPs: period 2. Its Mamba convolution
    has kernel scratch measured on the CPU: each shallow trace is calibrated, then composed."""
    from transformers import JambaConfig, JambaForCausalLM

    torch.manual_seed(0)
    model = JambaForCausalLM(JambaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=10, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_expand=2, use_mamba_kernels=False))
    optimizer = torch.optim.AdamW(model.parameters())
    fast, full = _both(model, optimizer, _batch(seq=8))  # the eager Mamba scan loops over the tokens: 8 are enough
    assert any(n.startswith("depth-independent trace: the 10 blocks of model.layers (period 2) composed from "
                            "traces of 4, 6, 8 blocks") for n in fast.coverage.notes), fast.coverage.notes
    _same_figures(fast, full)
    assert set(fast.coverage.calibrated) == set(full.coverage.calibrated)
    assert any("conv" in c for c in fast.coverage.calibrated)


def _same_figures(fast: preflight.Estimate, full: preflight.Estimate) -> None:
    """`_same`, for traces with calibrated scratch (whose events have no category in a full trace)."""
    assert (fast.peak_bytes, fast.breakdown, fast.peak_phase, fast.timeline, fast.num_ops) == \
        (full.peak_bytes, full.breakdown, full.peak_phase, full.timeline, full.num_ops)
    assert [(e.nbytes, e.op, e.phase) for e in fast.events] == [(e.nbytes, e.op, e.phase) for e in full.events]


@pytest.mark.slow
def test_bf16_matmul_scratch_on_the_cpu_and_a_convolution_patch_embedding_compose():
    from transformers import ViTConfig, ViTForImageClassification

    model = _llama(6)
    fast, full = _both(model, torch.optim.AdamW(model.parameters()), _batch(), run=preflight.Run(precision="bf16-mixed"))
    assert any(n.startswith("depth-independent trace") for n in fast.coverage.notes), fast.coverage.notes
    assert fast.coverage.calibrated and set(fast.coverage.calibrated) == set(full.coverage.calibrated)
    _same_figures(fast, full)
    torch.manual_seed(0)
    vit = ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=6,
                                              num_attention_heads=4, intermediate_size=128, num_labels=10))
    images = {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)),
              "labels": torch.tensor([1, 2])}
    fast, full = _both(vit, torch.optim.AdamW(vit.parameters()), images)
    assert any(n.startswith("depth-independent trace") for n in fast.coverage.notes), fast.coverage.notes
    assert any("convolution" in c for c in fast.coverage.calibrated)
    _same_figures(fast, full)
