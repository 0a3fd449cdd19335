"""preflight.estimate against the measured peak across many transformers architectures, each case in its own process.

Every architecture is built from a tiny transformers config (random weights, nothing downloaded; 2 layers, hidden
size 32-64, batch 2, 32 tokens, 32x32 images, 4000-sample waveforms) with data made in code, and trained with
AdamW in up to three variants:
    fp32        all parameters trained in fp32
    bf16-mixed  the same under precision="bf16-mixed" (CPU autocast)
    lora        peft LoRA (r=8, target_modules="all-linear"), AdamW on the adapters only

Each case runs in a fresh subprocess (`--case NAME:VARIANT`, one JSON line on stdout), so no cache filled by one
case can help another. In it: preflight.estimate (timed), a scan of the garbage collector for FakeTensors the
trace left alive, preflight.measure (two real CPU steps, peak from the profiler's allocator events) with a fresh
optimizer, then one more real forward and backward whose loss and gradients must be plain tensors.

A case is "traced" when coverage.traced is set and the peak is not a lower bound; "fallback" when estimate
returned a lower bound; "error" when the case raised, timed out, or the FakeTensor check failed; "real run fails"
when the model's own training step raises without preflight (`measure`), or the variant cannot be built at all
(peft refuses the model), so there is nothing to compare with; its note says when `estimate` raised too
(`StepWouldFailError`, or the step's own exception re-raised) instead of returning a peak. An `estimate` that
raises while the real step runs is an "error".

Run: python benchmarks/architectures.py --jobs 2        (all 391 cases, about 11 s each with interpreter start-up:
                                                          about 40 minutes on 2 idle cores; more jobs than free
                                                          cores slow the "estimate s" column, not the errors)
     python benchmarks/architectures.py --only llama --jobs 1
     python benchmarks/architectures.py --check-builders  (build each model, one real forward+backward, no preflight)
Writes benchmarks/results/architectures.md (and .json with the raw rows) and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

B = 2  # sequences, images or clips per step
S = 32  # tokens per sequence
V = 512  # vocabulary
IMG = 32  # image side
DET_IMG = 64  # image side for detection models (their CNN backbones downsample 32x)
AUDIO = 4000  # waveform samples (50 frames at the 80x conv stride below)
RESULTS = os.path.join(os.path.dirname(__file__), "results", "architectures")
VARIANTS = ("fp32", "bf16-mixed", "lora")
FAMILIES = ("causal-LM dense", "causal-LM MoE", "encoder", "seq2seq", "vision", "detection", "audio", "multimodal")

Built = tuple[nn.Module, Any, Callable | None]  # model, batch, step (None: the default model(**batch).loss)


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    build: Callable[[], Built]
    variants: tuple[str, ...] = VARIANTS


CASES: list[Case] = []


def register(name: str, family: str, variants: tuple[str, ...] = VARIANTS):
    assert family in FAMILIES, family

    def wrap(build: Callable[[], Built]) -> Callable[[], Built]:
        CASES.append(Case(name, family, build, variants))
        return build

    return wrap


def tf(name: str) -> Any:
    import transformers

    return getattr(transformers, name)


def make(model_cls: str, **config: Any) -> nn.Module:
    cls = tf(model_cls)
    return cls(cls.config_class(**config))


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def tokens(n: int = S, low: int = 3, high: int = V) -> torch.Tensor:
    return torch.randint(low, high, (B, n), generator=gen())


def lm_batch() -> dict[str, torch.Tensor]:
    ids = tokens()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def seq2seq_batch() -> dict[str, torch.Tensor]:
    ids = tokens()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": tokens(S // 2)}


def image_batch(size: int = IMG, labels: int = 10) -> dict[str, torch.Tensor]:
    g = gen()
    return {"pixel_values": torch.randn(B, 3, size, size, generator=g),
            "labels": torch.randint(0, labels, (B,), generator=g)}


def audio_ctc_batch() -> dict[str, torch.Tensor]:
    g = gen()
    return {"input_values": torch.randn(B, AUDIO, generator=g), "labels": torch.randint(1, 32, (B, 8), generator=g)}


def mean_square(field: str) -> Callable:
    """A step for models without a loss head: the mean square of one output (a stand-in self-supervised loss)."""
    return lambda model, batch: getattr(model(**batch), field).float().pow(2).mean()


# ---------------------------------------------------------------------------------------------------- causal LMs
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=V, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)


def llama_like(model_cls: str, **overrides: Any) -> Callable[[], Built]:
    return lambda: (make(model_cls, **{**LLAMA_LIKE, **overrides}), lm_batch(), None)


DENSE = "causal-LM dense"
for _name, _cls, _kw in [
    ("Llama", "LlamaForCausalLM", {}),
    ("Mistral", "MistralForCausalLM", {"sliding_window": 16}),
    ("Qwen2", "Qwen2ForCausalLM", {}),
    ("Qwen3", "Qwen3ForCausalLM", {"head_dim": 16}),
    ("OLMo", "OlmoForCausalLM", {}),
    ("OLMo2", "Olmo2ForCausalLM", {}),
    ("Gemma", "GemmaForCausalLM", {"head_dim": 16}),
    ("Gemma2", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 16}),
    ("Gemma3-text", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 16}),
    ("Phi", "PhiForCausalLM", {}),
    ("Phi3", "Phi3ForCausalLM", {}),
    ("StableLM", "StableLmForCausalLM", {}),
    ("Starcoder2", "Starcoder2ForCausalLM", {}),
    ("Cohere", "CohereForCausalLM", {}),
    ("Cohere2", "Cohere2ForCausalLM", {"sliding_window": 16}),
    ("Granite", "GraniteForCausalLM", {}),
    ("GLM", "GlmForCausalLM", {"head_dim": 16}),
    ("GLM4", "Glm4ForCausalLM", {"head_dim": 16}),
    ("Helium", "HeliumForCausalLM", {"head_dim": 16}),
    ("SmolLM3", "SmolLM3ForCausalLM", {}),
    ("Nemotron", "NemotronForCausalLM", {"head_dim": 16}),
    ("Persimmon", "PersimmonForCausalLM", {}),
    ("GPT-NeoX", "GPTNeoXForCausalLM", {}),
]:
    register(_name, DENSE)(llama_like(_cls, **_kw))


@register("GPT-2", DENSE)
def _gpt2() -> Built:
    return make("GPT2LMHeadModel", n_layer=2, n_embd=64, n_head=4, vocab_size=V, n_positions=64), lm_batch(), None


@register("GPT-BigCode", DENSE)
def _gpt_bigcode() -> Built:
    return make("GPTBigCodeForCausalLM", n_layer=2, n_embd=64, n_head=4, vocab_size=V, n_positions=64), lm_batch(), None


@register("GPT-Neo", DENSE)
def _gpt_neo() -> Built:
    model = make("GPTNeoForCausalLM", num_layers=2, hidden_size=64, num_heads=4,
                 attention_types=[[["global", "local"], 1]], window_size=16, vocab_size=V, max_position_embeddings=64)
    return model, lm_batch(), None


@register("GPT-J", DENSE)
def _gptj() -> Built:
    model = make("GPTJForCausalLM", n_layer=2, n_embd=64, n_head=4, rotary_dim=8, vocab_size=V, n_positions=64)
    return model, lm_batch(), None


@register("CodeGen", DENSE)
def _codegen() -> Built:
    return make("CodeGenForCausalLM", n_layer=2, n_embd=64, n_head=4, rotary_dim=8, vocab_size=V, n_positions=64,
                n_ctx=64), lm_batch(), None


@register("OPT", DENSE)
def _opt() -> Built:
    return make("OPTForCausalLM", hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                word_embed_proj_dim=64, vocab_size=V, max_position_embeddings=64), lm_batch(), None


@register("BLOOM", DENSE)
def _bloom() -> Built:
    return make("BloomForCausalLM", hidden_size=64, n_layer=2, n_head=4, vocab_size=V), lm_batch(), None


@register("Falcon", DENSE)
def _falcon() -> Built:
    model = make("FalconForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=V)
    return model, lm_batch(), None


@register("MPT", DENSE)
def _mpt() -> Built:
    return make("MptForCausalLM", d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64,
                vocab_size=V), lm_batch(), None


@register("BioGPT", DENSE)
def _biogpt() -> Built:
    return make("BioGptForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                vocab_size=V, max_position_embeddings=64), lm_batch(), None


@register("XGLM", DENSE)
def _xglm() -> Built:
    return make("XGLMForCausalLM", d_model=64, num_layers=2, attention_heads=4, ffn_dim=128, vocab_size=V,
                max_position_embeddings=64), lm_batch(), None


@register("Mamba", DENSE)
def _mamba() -> Built:
    return make("MambaForCausalLM", hidden_size=64, num_hidden_layers=2, state_size=8, vocab_size=V), lm_batch(), None


@register("Mamba2", DENSE)
def _mamba2() -> Built:
    return make("Mamba2ForCausalLM", hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, n_groups=1,
                state_size=16, chunk_size=16, vocab_size=V), lm_batch(), None


@register("FalconMamba", DENSE)
def _falcon_mamba() -> Built:
    model = make("FalconMambaForCausalLM", hidden_size=64, num_hidden_layers=2, state_size=8, vocab_size=V)
    return model, lm_batch(), None


@register("RWKV", DENSE)
def _rwkv() -> Built:
    return make("RwkvForCausalLM", hidden_size=64, num_hidden_layers=2, attention_hidden_size=64, intermediate_size=128,
                vocab_size=V, context_length=64), lm_batch(), None


# ------------------------------------------------------------------------------------------------ MoE causal LMs
MOE = "causal-LM MoE"
for _name, _cls, _kw in [
    ("Mixtral", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("Qwen2-MoE", "Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                          "shared_expert_intermediate_size": 64}),
    ("Qwen3-MoE", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                          "head_dim": 16}),
    ("OLMoE", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    ("GraniteMoE", "GraniteMoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("PhiMoE", "PhimoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("GPT-OSS", "GptOssForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                                      "sliding_window": 16}),
    ("DeepSeek-V2", "DeepseekV2ForCausalLM", {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                                              "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
                                              "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
                                              "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}),
    ("DeepSeek-V3", "DeepseekV3ForCausalLM", {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                                              "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
                                              "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
                                              "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}),
    ("GLM4-MoE", "Glm4MoeForCausalLM", {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                                        "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
                                        "topk_group": 1, "head_dim": 16}),
    ("JetMoE", "JetMoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "kv_channels": 16,
                                     "num_key_value_heads": 4}),
    ("Qwen3-Next", "Qwen3NextForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                            "shared_expert_intermediate_size": 32, "head_dim": 16,
                                            "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                                            "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                            "layer_types": ["linear_attention", "full_attention"]}),
    ("Jamba", "JambaForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "expert_layer_period": 2,
                                   "expert_layer_offset": 1, "attn_layer_period": 2, "attn_layer_offset": 1,
                                   "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2,
                                   "use_mamba_kernels": False}),
]:
    register(_name, MOE)(llama_like(_cls, **_kw))


@register("DBRX", MOE)
def _dbrx() -> Built:
    return make("DbrxForCausalLM", d_model=64, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=V,
                attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}), lm_batch(), None


# ------------------------------------------------------------------------------------------------------ encoders
ENC = "encoder"
BERT_LIKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=V,
                 max_position_embeddings=64)


def mlm(model_cls: str, **overrides: Any) -> Callable[[], Built]:
    return lambda: (make(model_cls, **{**BERT_LIKE, **overrides}), lm_batch(), None)


for _name, _cls, _kw in [
    ("BERT", "BertForMaskedLM", {}),
    ("RoBERTa", "RobertaForMaskedLM", {"max_position_embeddings": 80}),
    ("XLM-RoBERTa", "XLMRobertaForMaskedLM", {"max_position_embeddings": 80}),
    ("ALBERT", "AlbertForMaskedLM", {"embedding_size": 32}),
    ("ELECTRA", "ElectraForMaskedLM", {"embedding_size": 32}),
    ("DeBERTa", "DebertaForMaskedLM", {}),
    ("DeBERTa-v2", "DebertaV2ForMaskedLM", {}),
    ("MPNet", "MPNetForMaskedLM", {"max_position_embeddings": 80}),
    ("ModernBERT", "ModernBertForMaskedLM", {"global_attn_every_n_layers": 2, "local_attention": 16,
                                             "pad_token_id": 0}),
    ("ConvBERT", "ConvBertForMaskedLM", {"embedding_size": 64}),
    ("RoFormer", "RoFormerForMaskedLM", {"embedding_size": 64}),
    ("ERNIE", "ErnieForMaskedLM", {}),
    ("Megatron-BERT", "MegatronBertForMaskedLM", {}),
    ("Data2Vec-text", "Data2VecTextForMaskedLM", {"max_position_embeddings": 80}),
    ("Longformer", "LongformerForMaskedLM", {"attention_window": 8, "max_position_embeddings": 80}),
    ("BigBird", "BigBirdForMaskedLM", {"attention_type": "original_full"}),
    ("EuroBERT", "EuroBertForMaskedLM", {"num_key_value_heads": 4, "pad_token_id": 0}),
]:
    register(_name, ENC)(mlm(_cls, **_kw))


@register("DistilBERT", ENC)
def _distilbert() -> Built:
    return make("DistilBertForMaskedLM", dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=V,
                max_position_embeddings=64), lm_batch(), None


@register("Funnel", ENC)
def _funnel() -> Built:
    return make("FunnelForMaskedLM", block_sizes=[1, 1], d_model=64, n_head=4, d_head=16, d_inner=128,
                vocab_size=V), lm_batch(), None


# ------------------------------------------------------------------------------------------------------- seq2seq
S2S = "seq2seq"
BART_LIKE = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=V, max_position_embeddings=64)
T5_LIKE = dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=V, decoder_start_token_id=0)


def s2s(model_cls: str, base: dict, **overrides: Any) -> Callable[[], Built]:
    return lambda: (make(model_cls, **{**base, **overrides}), seq2seq_batch(), None)


for _name, _cls, _base, _kw in [
    ("T5", "T5ForConditionalGeneration", T5_LIKE, {}),
    ("mT5", "MT5ForConditionalGeneration", T5_LIKE, {}),
    ("UMT5", "UMT5ForConditionalGeneration", T5_LIKE, {}),
    ("LongT5", "LongT5ForConditionalGeneration", T5_LIKE, {"local_radius": 8}),
    ("Switch-Transformers", "SwitchTransformersForConditionalGeneration", T5_LIKE,
     {"num_experts": 4, "expert_capacity": 16, "num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1}),
    ("BART", "BartForConditionalGeneration", BART_LIKE, {}),
    ("mBART", "MBartForConditionalGeneration", BART_LIKE, {}),
    ("Pegasus", "PegasusForConditionalGeneration", BART_LIKE, {}),
    ("Marian", "MarianMTModel", BART_LIKE, {"decoder_start_token_id": 0, "pad_token_id": 0}),
    ("Blenderbot", "BlenderbotForConditionalGeneration", BART_LIKE, {}),
    ("BlenderbotSmall", "BlenderbotSmallForConditionalGeneration", BART_LIKE, {}),
    ("M2M100", "M2M100ForConditionalGeneration", BART_LIKE, {}),
    ("PLBart", "PLBartForConditionalGeneration", BART_LIKE, {}),
    ("NLLB-MoE", "NllbMoeForConditionalGeneration", BART_LIKE, {"num_experts": 4, "expert_capacity": 16,
                                                                 "encoder_sparse_step": 2, "decoder_sparse_step": 2}),
    ("LED", "LEDForConditionalGeneration", {k: v for k, v in BART_LIKE.items() if k != "max_position_embeddings"},
     {"max_encoder_position_embeddings": 64, "max_decoder_position_embeddings": 64, "attention_window": 8}),
]:
    register(_name, S2S)(s2s(_cls, _base, **_kw))


# -------------------------------------------------------------------------------------------------------- vision
VIS = "vision"
VIT_LIKE = dict(image_size=IMG, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, num_labels=10)
CNN = ("fp32", "bf16-mixed")  # LoRA on a CNN would adapt only its classifier


def classifier(model_cls: str, base: dict, **overrides: Any) -> Callable[[], Built]:
    return lambda: (make(model_cls, **{**base, **overrides}), image_batch(), None)


for _name, _cls, _base, _kw, _variants in [
    ("ViT", "ViTForImageClassification", VIT_LIKE, {}, VARIANTS),
    ("DeiT", "DeiTForImageClassification", VIT_LIKE, {}, VARIANTS),
    ("BEiT", "BeitForImageClassification", VIT_LIKE, {"use_relative_position_bias": True}, VARIANTS),
    ("Data2Vec-vision", "Data2VecVisionForImageClassification", VIT_LIKE, {}, VARIANTS),
    ("DINOv2", "Dinov2ForImageClassification", VIT_LIKE, {}, VARIANTS),
    ("IJepa", "IJepaForImageClassification", VIT_LIKE, {}, VARIANTS),
    ("Swin", "SwinForImageClassification", {}, dict(image_size=IMG, patch_size=2, embed_dim=16, depths=[1, 1],
                                                    num_heads=[2, 2], window_size=4, num_labels=10), VARIANTS),
    ("Swinv2", "Swinv2ForImageClassification", {}, dict(image_size=IMG, patch_size=2, embed_dim=16, depths=[1, 1],
                                                        num_heads=[2, 2], window_size=4, num_labels=10), VARIANTS),
    ("FocalNet", "FocalNetForImageClassification", {}, dict(image_size=IMG, patch_size=4, embed_dim=16, depths=[1, 1],
                                                            num_labels=10), VARIANTS),
    ("PVT", "PvtForImageClassification", {}, dict(image_size=IMG, num_encoder_blocks=2, depths=[1, 1],
                                                  sequence_reduction_ratios=[2, 1], hidden_sizes=[16, 32],
                                                  patch_sizes=[4, 2], strides=[4, 2], num_attention_heads=[1, 2],
                                                  mlp_ratios=[2, 2], num_labels=10), VARIANTS),
    ("ConvNeXt", "ConvNextForImageClassification", {}, dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                                                            num_labels=10), CNN),
    ("ConvNeXt-v2", "ConvNextV2ForImageClassification", {}, dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                                                                  num_labels=10), CNN),
    ("ResNet", "ResNetForImageClassification", {}, dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                        layer_type="basic", num_labels=10), CNN),
    ("RegNet", "RegNetForImageClassification", {}, dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                        groups_width=8, num_labels=10), CNN),
    ("MobileNetV2", "MobileNetV2ForImageClassification", {}, dict(image_size=IMG, depth_multiplier=0.35,
                                                                  num_labels=10), CNN),
]:
    register(_name, VIS, _variants)(classifier(_cls, _base, **_kw))


@register("DINOv3", VIS)
def _dinov3() -> Built:
    model = make("DINOv3ViTModel", image_size=IMG, patch_size=8, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=128, num_register_tokens=2)
    return model, {"pixel_values": image_batch()["pixel_values"]}, mean_square("pooler_output")


@register("ViT-MAE", VIS)
def _vit_mae() -> Built:
    model = make("ViTMAEForPreTraining", **{k: v for k, v in VIT_LIKE.items() if k != "num_labels"},
                 decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=4,
                 decoder_intermediate_size=64)
    return model, {"pixel_values": image_batch()["pixel_values"]}, None


@register("SegFormer", VIS)
def _segformer() -> Built:
    model = make("SegformerForSemanticSegmentation", num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                 hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                 mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=3)
    g = gen()
    return model, {"pixel_values": torch.randn(B, 3, IMG, IMG, generator=g),
                   "labels": torch.randint(0, 3, (B, IMG, IMG), generator=g)}, None


# ----------------------------------------------------------------------------------------------------- detection
DET = "detection"


def det_batch() -> dict[str, Any]:
    g = gen()
    labels = [{"class_labels": torch.randint(0, 3, (2,), generator=g),
               "boxes": torch.rand(2, 4, generator=g) * 0.5 + 0.25} for _ in range(B)]
    return {"pixel_values": torch.randn(B, 3, DET_IMG, DET_IMG, generator=g), "labels": labels}


def tiny_resnet(out_features: list[str]) -> Any:
    return tf("ResNetConfig")(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                              layer_type="basic", out_features=out_features)


DETR_LIKE = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=8, num_labels=3, use_timm_backbone=False,
                 use_pretrained_backbone=False)


@register("DETR", DET)
def _detr() -> Built:
    return make("DetrForObjectDetection", **DETR_LIKE, backbone_config=tiny_resnet(["stage4"])), det_batch(), None


@register("Conditional-DETR", DET)
def _conditional_detr() -> Built:
    return (make("ConditionalDetrForObjectDetection", **DETR_LIKE, backbone_config=tiny_resnet(["stage4"])),
            det_batch(), None)


@register("Table-Transformer", DET)
def _table_transformer() -> Built:
    return (make("TableTransformerForObjectDetection", **DETR_LIKE, backbone_config=tiny_resnet(["stage4"])),
            det_batch(), None)


@register("Deformable-DETR", DET)
def _deformable_detr() -> Built:
    return (make("DeformableDetrForObjectDetection", **{**DETR_LIKE, "decoder_layers": 2},
                 backbone_config=tiny_resnet(["stage3", "stage4"]),
                 num_feature_levels=2, encoder_n_points=2, decoder_n_points=2), det_batch(), None)


@register("YOLOS", DET)
def _yolos() -> Built:
    return (make("YolosForObjectDetection", **{**VIT_LIKE, "image_size": [DET_IMG, DET_IMG], "num_labels": 3},
                 num_detection_tokens=8), det_batch(), None)


# --------------------------------------------------------------------------------------------------------- audio
AUD = "audio"
W2V_LIKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                conv_dim=(32, 32, 32), conv_stride=(5, 4, 4), conv_kernel=(10, 4, 4), num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=4, vocab_size=32, pad_token_id=0)


def ctc(model_cls: str, **overrides: Any) -> Callable[[], Built]:
    return lambda: (make(model_cls, **{**W2V_LIKE, **overrides}), audio_ctc_batch(), None)


for _name, _cls, _kw in [
    ("wav2vec2", "Wav2Vec2ForCTC", {}),
    ("wav2vec2-Conformer", "Wav2Vec2ConformerForCTC", {"conv_depthwise_kernel_size": 7}),
    ("HuBERT", "HubertForCTC", {}),
    ("WavLM", "WavLMForCTC", {"num_buckets": 32, "max_bucket_distance": 64}),
    ("Data2Vec-audio", "Data2VecAudioForCTC", {}),
    ("UniSpeech", "UniSpeechForCTC", {}),
    ("UniSpeech-SAT", "UniSpeechSatForCTC", {}),
    ("SEW", "SEWForCTC", {"squeeze_factor": 2}),
    ("SEW-D", "SEWDForCTC", {"squeeze_factor": 2, "position_buckets": 16, "max_position_embeddings": 64}),
]:
    register(_name, AUD)(ctc(_cls, **_kw))


@register("Whisper", AUD)
def _whisper() -> Built:
    model = make("WhisperForConditionalGeneration", d_model=64, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                 num_mel_bins=16, max_source_positions=16, max_target_positions=32, vocab_size=V, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    g = gen()
    return model, {"input_features": torch.randn(B, 16, 32, generator=g), "labels": tokens(S // 2)}, None


@register("Speech2Text", AUD)
def _speech2text() -> Built:
    model = make("Speech2TextForConditionalGeneration", d_model=64, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                 input_feat_per_channel=16, num_conv_layers=2, conv_channels=32, max_source_positions=64,
                 max_target_positions=32, vocab_size=V)
    g = gen()
    return model, {"input_features": torch.randn(B, 64, 16, generator=g), "labels": tokens(S // 2)}, None


@register("SpeechT5-ASR", AUD)
def _speecht5() -> Built:
    model = make("SpeechT5ForSpeechToText", hidden_size=64, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                 conv_dim=(32, 32, 32), conv_stride=(5, 4, 4), conv_kernel=(10, 4, 4), num_conv_pos_embeddings=16,
                 num_conv_pos_embedding_groups=4, vocab_size=V, max_text_positions=64, max_speech_positions=256)
    return model, {"input_values": audio_ctc_batch()["input_values"], "labels": tokens(S // 2)}, None


@register("AST", AUD)
def _ast() -> Built:
    model = make("ASTForAudioClassification", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, num_mel_bins=16, max_length=32, patch_size=8, frequency_stride=4,
                 time_stride=4, num_labels=10)
    g = gen()
    return model, {"input_values": torch.randn(B, 32, 16, generator=g),
                   "labels": torch.randint(0, 10, (B,), generator=g)}, None


@register("Moonshine", AUD)
def _moonshine() -> Built:
    model = make("MoonshineForConditionalGeneration", hidden_size=64, intermediate_size=128,
                 encoder_num_hidden_layers=2, decoder_num_hidden_layers=2, encoder_num_attention_heads=4,
                 decoder_num_attention_heads=4,
                 vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return model, {"input_values": audio_ctc_batch()["input_values"], "labels": tokens(S // 2)}, None


# ---------------------------------------------------------------------------------------------------- multimodal
MM = "multimodal"
CLIP_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=V,
                 max_position_embeddings=64)
CLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IMG,
                   patch_size=8)


def contrastive_batch() -> dict[str, torch.Tensor]:
    ids = tokens()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": image_batch()["pixel_values"],
            "return_loss": True}


for _name, _cls in [("CLIP", "CLIPModel"), ("SigLIP", "SiglipModel"), ("Chinese-CLIP", "ChineseCLIPModel"),
                    ("AltCLIP", "AltCLIPModel")]:
    register(_name, MM)(lambda c=_cls: (make(c, text_config=CLIP_TEXT, vision_config=CLIP_VISION),
                                        contrastive_batch(), None))


def image_text_lm_batch(image_tokens: int, image_token_id: int) -> dict[str, torch.Tensor]:
    """Image placeholder tokens, then text; the labels ignore the placeholders."""
    ids = torch.cat([torch.full((B, image_tokens), image_token_id), tokens(S, 3, V - 8)], dim=1)
    labels = ids.masked_fill(ids == image_token_id, -100)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
            "pixel_values": image_batch()["pixel_values"]}


@register("LLaVA", MM)
def _llava() -> Built:
    config = tf("LlavaConfig")(vision_config=tf("CLIPVisionConfig")(**CLIP_VISION),
                               text_config=tf("LlamaConfig")(**LLAMA_LIKE), image_token_id=V - 1,
                               vision_feature_layer=-1, vision_feature_select_strategy="default")
    model = tf("LlavaForConditionalGeneration")(config)
    return model, image_text_lm_batch((IMG // 8) ** 2, V - 1), None


@register("PaliGemma", MM)
def _paligemma() -> Built:
    config = tf("PaliGemmaConfig")(vision_config=tf("SiglipVisionConfig")(**CLIP_VISION),
                                   text_config=tf("GemmaConfig")(**LLAMA_LIKE, head_dim=16), image_token_id=V - 1,
                                   projection_dim=64)
    model = tf("PaliGemmaForConditionalGeneration")(config)
    batch = image_text_lm_batch((IMG // 8) ** 2, V - 1)
    batch["token_type_ids"] = (batch["input_ids"] != V - 1).long()
    return model, batch, None


@register("BLIP", MM)
def _blip() -> Built:
    model = make("BlipForConditionalGeneration", text_config={**CLIP_TEXT, "encoder_hidden_size": 32},
                 vision_config=CLIP_VISION)
    ids = tokens()
    return model, {"input_ids": ids, "pixel_values": image_batch()["pixel_values"], "labels": ids}, None


@register("GIT", MM)
def _git() -> Built:
    model = make("GitForCausalLM", vision_config=CLIP_VISION, **BERT_LIKE)
    ids = tokens()
    return model, {"input_ids": ids, "pixel_values": image_batch()["pixel_values"], "labels": ids}, None


@register("Vision-Encoder-Decoder", MM)
def _vision_encoder_decoder() -> Built:
    encoder = tf("ViTConfig")(**{k: v for k, v in VIT_LIKE.items() if k != "num_labels"})
    decoder = tf("GPT2Config")(n_layer=2, n_embd=64, n_head=4, vocab_size=V, n_positions=64, add_cross_attention=True,
                               is_decoder=True)
    config = tf("VisionEncoderDecoderConfig").from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    model = tf("VisionEncoderDecoderModel")(config)
    return model, {"pixel_values": image_batch()["pixel_values"], "labels": tokens(S // 2)}, None


# ---------------------------------------------------------------------------------------------------- one case
def apply_variant(model: nn.Module, variant: str) -> tuple[nn.Module, str | None]:
    """The model to train and the precision for ``variant``."""
    if variant == "lora":
        import peft

        # peft refuses LoRA on a Mamba mixer's out_proj and conv1d ("all-linear" includes out_proj): adapt the
        # mixer's input-side projections there.
        mamba = getattr(model.config, "model_type", "") in ("mamba", "mamba2", "falcon_mamba")
        targets = ["in_proj", "x_proj", "dt_proj"] if mamba else "all-linear"
        return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets)), None
    return model, ("bf16-mixed" if variant == "bf16-mixed" else None)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def live_fake_tensors() -> int:
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, FakeTensor))


class TopOfRangeDraws(torch.overrides.TorchFunctionMode):
    """Real kernels, but ``torch.rand`` / ``rand_like`` of at most 64 elements (LayerDrop's ``torch.rand([])``)
    return the largest value below 1: the run that keeps every layer. A function mode, not a dispatch mode, so
    autograd's in-place gradient accumulation is as in a plain run."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.rand, torch.rand_like) and isinstance(out, torch.Tensor) and out.numel() <= 64:
            top = torch.nextafter(torch.tensor(1.0, dtype=out.dtype), torch.tensor(0.0, dtype=out.dtype))
            out = out.fill_(top.item())
        return out


def find_case(spec: str) -> tuple[Case, str]:
    name, _, variant = spec.rpartition(":")
    by_name = {c.name: c for c in CASES}
    if name not in by_name or variant not in by_name[name].variants:
        raise SystemExit(f"unknown case {spec!r}; `--list` shows the NAME:VARIANT pairs")
    return by_name[name], variant


def run_case(spec: str) -> dict[str, Any]:
    """Estimate, then measure, one case in this process; the row for the table."""
    import preflight
    from preflight._steps import compute_loss
    from torch._subclasses.fake_tensor import FakeTensor

    case, variant = find_case(spec)
    row: dict[str, Any] = {"case": spec, "name": case.name, "family": case.family, "variant": variant}
    torch.manual_seed(0)
    model, batch, step = case.build()
    try:
        model, precision = apply_variant(model, variant)
    except Exception as err:  # noqa: BLE001 - e.g. peft cannot wrap the model: no training run exists to predict
        row["real_run_error"] = (f"building the {variant} model fails without preflight: {type(err).__name__}: "
                                 f"{' '.join(str(err).split())[:160]}")
        return row
    row["params"] = sum(p.numel() for p in model.parameters())
    fakes_before = live_fake_tensors()
    start = time.perf_counter()
    try:
        est = preflight.estimate(model, adamw(model), batch, step=step, run=preflight.Run(precision=precision))
    except Exception as err:  # noqa: BLE001 - StepWouldFailError, or the step's own error re-raised: then the
        # real step must fail too, else it is preflight's error
        row["estimate_s"] = time.perf_counter() - start
        row["predicted_failure"] = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                preflight.measure(model, adamw(model), batch, step=step, run=preflight.Run(precision=precision))
        except Exception as real:  # noqa: BLE001 - the model's own failure, as predicted
            row["real_run_error"] = f"{type(real).__name__}: {' '.join(str(real).split())[:200]}"
            return row
        row["exception"] = f"preflight predicted a failure, but the real step ran: {row['predicted_failure']}"
        return row
    row["estimate_s"] = time.perf_counter() - start
    row.update(estimate=est.peak_bytes, traced=est.coverage.traced and not est.coverage.lower_bound,
               lower_bound=est.coverage.lower_bound, failed_op=est.coverage.failed_op, reason=est.coverage.reason)
    row["fakes_left"] = live_fake_tensors() - fakes_before
    # preflight predicts the worst case of a random branch (every LayerDrop layer kept): the like-for-like reference
    # is a real run whose small uniform draws are at the top of their range. The random run is measured in a
    # process of its own (a second measurement in one process can miss one-time allocations, e.g. oneDNN's caches).
    worst_case = any(n.startswith("layerdrop/random branch") for n in est.coverage.notes)
    try:
        with contextlib.redirect_stderr(io.StringIO()), TopOfRangeDraws() if worst_case else contextlib.nullcontext():
            measured = preflight.measure(model, adamw(model), batch, step=step, run=preflight.Run(precision=precision))
    except Exception as err:  # noqa: BLE001 - the model cannot train in this configuration, with or without us
        row["real_run_error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
        return row
    row["measured"] = measured.peak_bytes
    if worst_case:
        done = subprocess.run([sys.executable, __file__, "--measure-only", spec], capture_output=True, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        row["measured_random"] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    row["error"] = (est.peak_bytes - row["measured"]) / row["measured"]
    # The real run after the trace computes on real tensors: loss and every gradient are plain tensors.
    from preflight._steps import autocast_for

    with autocast_for(precision, "cpu"):
        loss = compute_loss(model, batch, step)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    row["real_after_estimate"] = (not isinstance(loss, FakeTensor) and bool(torch.isfinite(loss))
                                  and bool(grads) and not any(isinstance(g, FakeTensor) for g in grads))
    return row


def measure_only(spec: str) -> int:
    """The measured peak of one case's plain training steps (random draws as they come), nothing else."""
    import preflight

    case, variant = find_case(spec)
    torch.manual_seed(0)
    model, batch, step = case.build()
    model, precision = apply_variant(model, variant)
    with contextlib.redirect_stderr(io.StringIO()):
        return preflight.measure(model, adamw(model), batch, step=step, run=preflight.Run(precision=precision)).peak_bytes


def check_builders(only: str) -> int:
    """Build every case's model and batch and run one real forward and backward, without preflight."""
    from preflight._steps import compute_loss

    broken = 0
    for case in selected(only, cases_only=True):
        start = time.perf_counter()
        try:
            torch.manual_seed(0)
            model, batch, step = case.build()
            loss = compute_loss(model, batch, step)
            loss.backward()
            msg = f"ok    {time.perf_counter() - start:5.1f}s  {sum(p.numel() for p in model.parameters()):>9,} params"
        except Exception as err:  # noqa: BLE001 - report every broken builder, not only the first
            broken += 1
            msg = f"FAIL  {type(err).__name__}: {str(err).strip().splitlines()[0][:150] if str(err).strip() else ''}"
        print(f"{case.family:16} {case.name:22} {msg}", flush=True)
    print(f"{broken} of {len(selected(only, cases_only=True))} builders failed", flush=True)
    return 1 if broken else 0


# ------------------------------------------------------------------------------------------------------- driver
def selected(only: str, cases_only: bool = False) -> list:
    """The cases (or NAME:VARIANT specs) whose name, spec or family contains one of ``only``'s comma-separated
    substrings (case-insensitive); a substring that is a whole NAME or NAME:VARIANT selects only that. All cases
    for an empty ``only``."""
    wanted = [w.strip().lower() for w in only.split(",")]
    whole = {t.lower() for c in CASES for t in [c.name, *(f"{c.name}:{v}" for v in c.variants)]}

    def hit(name: str, *texts: str) -> bool:
        return any(any(w == t.lower() for t in (name, *texts)) if w in whole else any(w in t.lower() for t in texts)
                   for w in wanted)

    if cases_only:
        return [c for c in CASES if hit(c.name, c.name, c.family)]
    return [f"{c.name}:{v}" for c in CASES for v in c.variants if hit(c.name, f"{c.name}:{v}", c.family)]


def spawn(spec: str, timeout: float) -> dict[str, Any]:
    case, variant = find_case(spec)
    base = {"case": spec, "name": case.name, "family": case.family, "variant": variant}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--case", spec], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return {**base, "exception": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {**base, "exception": f"exit {proc.returncode}: {tail[:300]}"}
    row = json.loads(lines[-1])
    row["case_s"] = time.perf_counter() - start
    return row


def status(row: dict[str, Any]) -> str:
    if row.get("real_run_error"):
        return "real run fails"  # the model's own step raises: nothing to compare with
    if row.get("exception"):
        return "error"
    if row["fakes_left"] or not row["real_after_estimate"]:
        return "error"  # a run after the estimate that saw a FakeTensor makes the comparison meaningless
    return "traced" if row["traced"] else "fallback"


def summary_row(label: str, rows: list[dict[str, Any]]) -> str:
    """One line of the summary: counts, cases traced within 0.5% and 1% (of all cases), traced errors, times."""
    n = len(rows)
    counts = {s: sum(status(r) == s for r in rows) for s in ("traced", "fallback", "error", "real run fails")}
    errors = sorted(abs(r["error"]) for r in rows if status(r) == "traced")
    times = [r["estimate_s"] for r in rows if r.get("estimate_s") is not None]
    within = [f"{k} ({k / n:.1%})" for k in (sum(e <= tol for e in errors) for tol in (0.005, 0.01))]
    stats = [f"{statistics.median(errors):.3%}", f"{max(errors):.3%}"] if errors else ["", ""]
    med_time = f"{statistics.median(times):.2f}" if times else ""
    return (f"| {label} | {n} | {len({r['name'] for r in rows})} | {counts['traced']} | {counts['fallback']} | "
            f"{counts['error']} | {counts['real run fails']} | {' | '.join(within)} | {' | '.join(stats)} | "
            f"{med_time} |")


def render(rows: list[dict[str, Any]], command: str) -> str:
    """The markdown: a summary (all cases, then per family) and the per-case table."""
    import transformers

    lines = [
        f"Command: `{command}` (torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{os.cpu_count()} CPU cores; batch {B}, {S} tokens, {IMG}px images ({DET_IMG}px for detection), "
        f"{AUDIO}-sample audio; AdamW; each case in its own process)",
        "",
        "| family | cases | architectures | traced | fallback (lower bound) | error | real run fails | "
        "traced within 0.5% | traced within 1% | median abs error (traced) | max abs error (traced) | "
        "median estimate s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        summary_row("all", rows),
        *(summary_row(f, [r for r in rows if r["family"] == f]) for f in FAMILIES
          if any(r["family"] == f for r in rows)),
        "",
        "| family | architecture | variant | params | measured MiB | estimate MiB | error | status | estimate s "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {f: i for i, f in enumerate(FAMILIES)}
    for r in sorted(rows, key=lambda r: (order[r["family"]], r["name"], VARIANTS.index(r["variant"]))):
        st = status(r)
        note = r.get("exception") or r.get("real_run_error") or ""
        if r.get("real_run_error") and r.get("predicted_failure"):
            note = f"estimate raised it too ({r['predicted_failure'].split(':')[0]}); real run: {note}"
        if not note and r.get("measured_random") is not None:
            note = (f"LayerDrop: measured with every layer kept (the predicted worst case); the random run peaked "
                    f"at {r['measured_random'] / 2**20:.2f} MiB ({(r['estimate'] - r['measured_random']) / r['measured_random']:+.1%})")
        if not note and st == "fallback":
            note = f"{r.get('failed_op') or ''}: {r.get('reason') or ''}"
        if not r.get("exception") and not r.get("real_run_error") and (r["fakes_left"] or
                                                                       not r["real_after_estimate"]):
            note = f"FakeTensor check failed: {r['fakes_left']} left alive, real run ok={r['real_after_estimate']}"
        note = note.replace("|", "\\|").replace("\n", " ")[:160]
        mib = (lambda k: f"{r[k] / 2**20:.2f}" if r.get(k) is not None else "")
        lines.append(
            f"| {r['family']} | {r['name']} | {r['variant']} | {r.get('params', 0):,} | {mib('measured')} | "
            f"{mib('estimate')} | {'' if r.get('error') is None else format(r['error'], '+.3%')} | {st} | "
            f"{'' if r.get('estimate_s') is None else format(r['estimate_s'], '.2f')} | {note} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once, each in its own process")
    parser.add_argument("--only", default="", help="comma-separated substrings of NAME:VARIANT or family "
                        "(a whole NAME or NAME:VARIANT selects just that)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a case counts as an error")
    parser.add_argument("--out", default=RESULTS, help="write OUT.md and OUT.json (default: %(default)s)")
    parser.add_argument("--case", help="run one NAME:VARIANT in this process and print its JSON row")
    parser.add_argument("--measure-only", metavar="CASE", help="print the measured peak of one NAME:VARIANT's "
                        "plain training steps (no estimate), as JSON")
    parser.add_argument("--list", action="store_true", help="print the NAME:VARIANT pairs and exit")
    parser.add_argument("--update", action="store_true",
                        help="rerun only the cases --only selects and replace their rows in OUT.json; the table is "
                        "rendered from all rows")
    parser.add_argument("--check-builders", action="store_true",
                        help="build each model and run one real forward+backward, without preflight")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    if args.measure_only:
        print(json.dumps(measure_only(args.measure_only)))
        return 0
    if args.case:
        try:
            row = run_case(args.case)
        except Exception as err:  # noqa: BLE001 - the benchmark reports the failure as a row
            case, variant = find_case(args.case)
            row = {"case": args.case, "name": case.name, "family": case.family, "variant": variant,
                   "exception": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"}
            traceback.print_exc()
        print(json.dumps(row), flush=True)
        return 0
    if args.check_builders:
        return check_builders(args.only)
    specs = selected(args.only)
    if args.list:
        print("\n".join(specs))
        return 0
    rows = []
    with ThreadPoolExecutor(args.jobs) as pool:
        for i, row in enumerate(pool.map(lambda s: spawn(s, args.timeout), specs), 1):
            rows.append(row)
            err = "" if row.get("error") is None else f" {row['error']:+.3%}"
            print(f"[{i}/{len(specs)}] {row['case']}: {status(row)}{err} {row.get('exception') or ''}",
                  file=sys.stderr, flush=True)
    command = "python benchmarks/architectures.py " + " ".join(sys.argv[1:])
    if args.update:  # the earlier run's rows, with the rerun cases replaced (order kept)
        with open(args.out + ".json") as f:
            earlier = json.load(f)
        rerun = {row["case"]: row for row in rows}
        rows = [rerun.pop(row["case"], row) for row in earlier] + list(rerun.values())
        with open(args.out + ".md") as f:
            first = f.readline()
        if first.startswith("Command: `") and "` (torch " in first:  # every earlier command, in order
            command = first[len("Command: `"):first.rindex("` (torch ")] + "`, then `" + command
    text = render(rows, command.strip())
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    with open(args.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
