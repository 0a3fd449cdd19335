"""Validate the CUDA-target prediction: planned from a CPU host, traced on the device, and measured on the GPU.

One command:

    python benchmarks/gpu_validation.py            # every zoo case and both published series
    python benchmarks/gpu_validation.py --quick    # two zoo cases, no published series (the CPU-mode test)
    python benchmarks/gpu_validation.py --against benchmarks/results/gpu_validation_h200.md
                                                   # re-plan a GPU run's zoo here, beside its measurements

For each configuration of a zoo built from transformers configs (random weights, nothing downloaded):
    planned    preflight.estimate(..., gpu=<the GPU>) traced on the CPU host with the CUDA target's semantics
               (autocast lists, attention kernel, fused dropout, cuBLAS workspaces, allocator simulation): the
               prediction a user makes from a laptop. On a GPU machine the trace is forced onto the CPU.
    on-device  the same estimate traced on the GPU itself (fake CUDA tensors; GPU machines only)
    measured   two real training steps on the GPU (preflight.measure): torch.cuda.max_memory_allocated and
               max_memory_reserved, and the device total from torch.cuda.mem_get_info (total - free) before the
               model is built and after the steps, CUDA context included (GPU machines only)
On a machine without CUDA only the planned column is filled, and the script says that measurements need a GPU.

Then two series measured and published by others for single-GPU fine-tuning are reproduced from their own
set-up descriptions, each row's prediction beside the published figure:
    1. Hugging Face, "Efficient Training on a Single GPU" (transformers v4.21 docs, Jan 2022):
       https://huggingface.co/docs/transformers/v4.21.0/perf_train_gpu_one -- bert-large-uncased sequence
       classification, 512 random sequences of 512 tokens, HF Trainer defaults (AdamW, max_grad_norm 1.0, and
       `model.zero_grad()` after each step, which kept the gradients allocated before torch 2.0), on a
       Tesla V100-SXM2 16 GB (driver 460.91.03, CUDA 11.2); "GPU memory occupied" from NVML (nvidia-smi's used
       memory, MiB) after training. Their CUDA context (eager module loading) measured 1343 MB.
    2. Hugging Face PEFT README, "High performance on consumer hardware" (2023):
       https://github.com/huggingface/peft#high-performance-on-consumer-hardware -- ought/raft twitter_complaints,
       single A100 80GB, peak torch.cuda.max_memory_allocated of the training loop (the TorchTracemalloc of
       examples/conditional_generation/peft_lora_seq2seq_accelerate_ds_zero3_offload.py): batch 8, LoRA r=8,
       alpha 32, dropout 0.1, torch AdamW, fp32 weights. Inputs are padded to the longest tweet of the batch;
       the tokens per tweet are not published, 64 is assumed here (labels: 3 tokens for the seq2seq models).
Neither series states its torch version; both predate torch 2.0's foreach optimizer default and lazy module
loading, which the prediction (torch of this process) follows. Series 1's nvidia-smi output is dated 11 Jan 2022,
when torch 1.10.1 was the newest release, and torch up to 1.10 saved softmax's input for backward: its rows show
the error with our context figure, with their measured context in its place, and then also with softmax recorded
as their torch did (torch_110_softmax), so what is left is ours.

Writes benchmarks/results/gpu_validation.md and prints the same tables.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn

import preflight
from preflight._gpus import get_gpu

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore")

RESULTS = os.path.join(os.path.dirname(__file__), "results", "gpu_validation.md")
MiB = 2**20
VOCAB = 8000
SEQ = 256
BATCH = 8


@dataclass
class Case:
    """One training configuration: ``build(device)`` returns (model, optimizer, batch) on ``device``."""

    name: str
    build: Callable[[str], tuple[nn.Module, torch.optim.Optimizer, Any]]
    precision: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # the loop's fields (clipping, scaler, ...)

    def run(self, gpu: str | None = None) -> preflight.Run:
        """The case's description, planned for ``gpu`` (a catalog name) or for where the model is."""
        return preflight.Run(precision=self.precision, loop=preflight.Loop(**self.options),
                             target=preflight.Target(gpu=gpu))


# ---- the zoo ------------------------------------------------------------------------------------------------------

def _lm_batch(device: str, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _gpt2(device: str, attn: str = "sdpa", checkpointing: bool = False) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=VOCAB, n_positions=SEQ,
                                  bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = attn
    model = transformers.GPT2LMHeadModel(cfg).to(device)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _llama(device: str, attn: str = "sdpa", checkpointing: bool = False) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB,
                                   max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg._attn_implementation = attn
    model = transformers.LlamaForCausalLM(cfg).to(device)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _bert(device: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                                  intermediate_size=2048, vocab_size=VOCAB, max_position_embeddings=SEQ)
    cfg._attn_implementation = "eager"
    model = transformers.BertForMaskedLM(cfg).to(device)
    return model, _lm_batch(device)


def _vit(device: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=224, patch_size=16, hidden_size=384, num_hidden_layers=6,
                                 num_attention_heads=6, intermediate_size=1536, num_labels=10)
    model = transformers.ViTForImageClassification(cfg).to(device)
    gen = torch.Generator().manual_seed(0)
    batch = {"pixel_values": torch.randn(32, 3, 224, 224, generator=gen).to(device),
             "labels": torch.randint(0, 10, (32,), generator=gen).to(device)}
    return model, batch


def _resnet(device: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
                                     layer_type="basic", num_labels=10)
    model = transformers.ResNetForImageClassification(cfg).to(device)
    gen = torch.Generator().manual_seed(0)
    batch = {"pixel_values": torch.randn(32, 3, 224, 224, generator=gen).to(device),
             "labels": torch.randint(0, 10, (32,), generator=gen).to(device)}
    return model, batch


def _adamw(model: nn.Module, **kw: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, **kw)


def _with_adamw(model: nn.Module, batch: Any) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    return model, _adamw(model), batch


def _bnb(model: nn.Module) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def _lora(model: nn.Module) -> nn.Module:
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj",
                                                                                           "c_fc"]))


# ---- quantized base weights (QLoRA, LLM.int8), loaded as users load them --------------------------------------

_CHECKPOINT: list[str] = []  # a small Llama saved once per process (random weights), read back quantized


def _llama_checkpoint() -> str:
    if not _CHECKPOINT:
        import tempfile

        folder = tempfile.mkdtemp(prefix="gpu_validation_llama_")
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2752, num_hidden_layers=8,
                                       num_attention_heads=16, num_key_value_heads=8, vocab_size=VOCAB,
                                       max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
        _CHECKPOINT.append(folder)
    return _CHECKPOINT[0]


def _quantized_lora(device: str, quantization: dict[str, Any], checkpointing: bool
                    ) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """from_pretrained with a BitsAndBytesConfig on ``device``, prepare_model_for_kbit_training, LoRA r=16."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(
        _llama_checkpoint(), quantization_config=transformers.BitsAndBytesConfig(**quantization),
        device_map={"": device}, attn_implementation="sdpa")
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=targets, task_type="CAUSAL_LM"))
    return model, _adamw(model), _lm_batch(device)


_NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)

ZOO = [
    Case("GPT-2 fp32 AdamW", lambda d: (m := _gpt2(d), _adamw(m), _lm_batch(d))),
    Case("GPT-2 bf16-mixed AdamW", lambda d: (m := _gpt2(d), _adamw(m), _lm_batch(d)), "bf16-mixed"),
    Case("GPT-2 16-mixed GradScaler clip", lambda d: (m := _gpt2(d), _adamw(m), _lm_batch(d)), "16-mixed",
         {"grad_scaler": True, "max_grad_norm": 1.0}),
    Case("GPT-2 fused AdamW", lambda d: (m := _gpt2(d), _adamw(m, fused=True), _lm_batch(d))),
    Case("GPT-2 bnb AdamW8bit", lambda d: (m := _gpt2(d), _bnb(m), _lm_batch(d))),
    Case("GPT-2 LoRA r=8 bf16-mixed", lambda d: (m := _lora(_gpt2(d)), _adamw(m), _lm_batch(d)), "bf16-mixed"),
    Case("GPT-2 checkpointing", lambda d: (m := _gpt2(d, checkpointing=True), _adamw(m), _lm_batch(d))),
    Case("Llama sdpa bf16-mixed", lambda d: (m := _llama(d), _adamw(m), _lm_batch(d)), "bf16-mixed"),
    Case("Llama eager checkpointing", lambda d: (m := _llama(d, "eager", True), _adamw(m), _lm_batch(d))),
    Case("BERT eager 16-mixed GradScaler", lambda d: _with_adamw(*_bert(d)), "16-mixed", {"grad_scaler": True}),
    Case("ViT fp32", lambda d: _with_adamw(*_vit(d))),
    Case("ResNet-18 bf16-mixed", lambda d: _with_adamw(*_resnet(d)), "bf16-mixed"),
    Case("Llama QLoRA nf4 double-quant", lambda d: _quantized_lora(d, _NF4, False)),
    Case("Llama QLoRA nf4 double-quant checkpointing", lambda d: _quantized_lora(d, _NF4, True)),
    Case("Llama QLoRA fp4, fp32 compute", lambda d: _quantized_lora(d, dict(load_in_4bit=True,
                                                                            bnb_4bit_quant_type="fp4"), False)),
    Case("Llama LLM.int8 LoRA", lambda d: _quantized_lora(d, dict(load_in_8bit=True), False)),
]
QUICK = ("GPT-2 fp32 AdamW", "BERT eager 16-mixed GradScaler")


# ---- measuring ----------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _planned_on_cpu() -> Any:
    """Trace on the CPU even where CUDA is present: the prediction a CPU host makes."""
    import preflight._estimate as est

    saved = est.trace_device_for
    est.trace_device_for = lambda target: torch.device("cpu")
    try:
        yield
    finally:
        est.trace_device_for = saved


def _quiet(fn: Callable[[], Any]) -> Any:
    with contextlib.redirect_stderr(io.StringIO()):
        return fn()


def _plan(case: Case, gpu: str) -> preflight.Estimate:
    model, opt, batch = case.build("cpu")
    with _planned_on_cpu():
        return _quiet(lambda: preflight.estimate(model, opt, batch, case.run(gpu)))


def _measure_on_gpu(case: Case, gpu: str) -> dict[str, int]:  # pragma: no cover - needs a GPU
    gc.collect()
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    model, opt, batch = case.build("cuda")
    on_device = _quiet(lambda: preflight.estimate(model, opt, batch, case.run(gpu)))
    # The steps start from an empty cache, so that the reserved peak is theirs (the first H200 run measured without
    # this; the second, with it, read the same reserved peaks but ViT's: docs/cuda-target.md).
    gc.collect()
    torch.cuda.empty_cache()
    m = _quiet(lambda: preflight.measure(model, opt, batch, case.run()))
    free1, _ = torch.cuda.mem_get_info()
    out = {"on_device": on_device.peak_bytes, "on_device_reserved": on_device.peak_reserved_bytes or 0,
           "allocated": m.peak_bytes, "reserved": m.peak_reserved_bytes or 0,
           "used_before": total - free0, "used_after": total - free1}
    del model, opt, batch
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _err(predicted: float, truth: float) -> str:
    return f"{(predicted - truth) / truth:+.1%}" if truth else "n/a"


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MiB:,.1f}"


def run_zoo(cases: list[Case], gpu: str, on_gpu: bool) -> list[str]:
    head = ("| case | planned peak MiB | planned max allocated MiB | planned reserved MiB | planned device total MiB |"
            " plan s |" + (" on-device peak MiB | measured max allocated MiB | error | measured max reserved MiB |"
                           " error | used before / after MiB |" if on_gpu else ""))
    lines = [head, "|" + "---|" * head.count(" |")]
    print("\n".join(lines), flush=True)
    for case in cases:
        row = f"| {case.name} |"
        try:
            start = time.perf_counter()
            est = _plan(case, gpu)
            seconds = time.perf_counter() - start
            row += (f" {_mib(est.peak_bytes)} | {_mib(est.peak_allocated_bytes)} | {_mib(est.peak_reserved_bytes)} | "
                    f"{_mib(est.device_total_bytes)} | {seconds:.1f} |")
            if est.coverage.lower_bound:
                row += f" lower bound: {est.coverage.failed_op} |"
            if on_gpu:  # pragma: no cover - needs a GPU
                got = _measure_on_gpu(case, gpu)
                row += (f" {_mib(got['on_device'])} | {_mib(got['allocated'])} | "
                        f"{_err(est.peak_allocated_bytes or 0, got['allocated'])} | {_mib(got['reserved'])} | "
                        f"{_err(est.peak_reserved_bytes or 0, got['reserved'])} | "
                        f"{_mib(got['used_before'])} / {_mib(got['used_after'])} |")
        except Exception as exc:  # a case that cannot run here (a missing library, a failure) says why
            traceback.print_exc()
            row += f" not run: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''} |"
        lines.append(row)
        print(row, flush=True)
    return lines


# ---- generation ---------------------------------------------------------------------------------------------------

# (label, model builder, generate's arguments): bf16 weights, 16 prompts x 224 tokens, 32 new tokens, every
# sequence generated to its last token (an end-of-sequence id outside the vocabulary, the trace's assumption)
GENERATION = [
    ("GPT-2 greedy", _gpt2, {}),
    ("GPT-2 4 beams", _gpt2, {"num_beams": 4}),
    ("Llama greedy", _llama, {}),
    ("Llama static cache greedy", _llama, {"cache_implementation": "static"}),
    ("Llama static cache greedy, no compile", _llama, {"cache_implementation": "static", "disable_compile": True}),
]
GEN_PROMPTS, GEN_PROMPT, GEN_NEW = 16, 224, 32


def _prompts(device: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (GEN_PROMPTS, GEN_PROMPT), generator=torch.Generator().manual_seed(0)).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _generate_on_gpu(label: str) -> dict[str, int]:  # pragma: no cover - needs a GPU
    """Measure one generation in a fresh process: a process that trained first would still hold the autograd
    thread's cuBLAS workspace, which ``generate`` alone never allocates."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure-generation", label],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measure_generation_here(label: str) -> dict[str, int]:  # pragma: no cover - needs a GPU
    build, extra = next((b, e) for name, b, e in GENERATION if name == label)
    generation = {"max_new_tokens": GEN_NEW, "min_new_tokens": GEN_NEW, "pad_token_id": 0, **extra}
    free0, total = torch.cuda.mem_get_info()
    model = build("cuda").to(torch.bfloat16).eval()
    prompts = _prompts("cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model.generate(**prompts, **generation, eos_token_id=VOCAB + 5)
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
            "used_before": total - free0, "used_after": total - free1}


def run_generation(gpu: str, on_gpu: bool) -> list[str]:
    head = ("| generation | planned peak MiB | planned max allocated MiB | planned reserved MiB | plan s |"
            + (" measured max allocated MiB | error | measured max reserved MiB | error | used before / after MiB |"
               if on_gpu else ""))
    lines = [head, "|" + "---|" * head.count(" |")]
    print("\n".join(lines), flush=True)
    for label, build, extra in GENERATION:
        generation = {"max_new_tokens": GEN_NEW, "min_new_tokens": GEN_NEW, "pad_token_id": 0, **extra}
        row = f"| {label} |"
        try:
            model = build("cpu").to(torch.bfloat16).eval()
            run = preflight.Run(precision="bf16-true", target=preflight.Target(gpu=gpu), generation=generation)
            start = time.perf_counter()
            with _planned_on_cpu():
                est = _quiet(lambda: preflight.estimate_generation(model, _prompts("cpu"), run))
            row += (f" {_mib(est.peak_bytes)} | {_mib(est.peak_allocated_bytes)} | {_mib(est.peak_reserved_bytes)} | "
                    f"{time.perf_counter() - start:.1f} |")
            if est.coverage.lower_bound:
                row += f" lower bound: {est.coverage.failed_op} |"
            if on_gpu:  # pragma: no cover - needs a GPU
                got = _generate_on_gpu(label)
                row += (f" {_mib(got['allocated'])} | {_err(est.peak_allocated_bytes or 0, got['allocated'])} | "
                        f"{_mib(got['reserved'])} | {_err(est.peak_reserved_bytes or 0, got['reserved'])} | "
                        f"{_mib(got['used_before'])} / {_mib(got['used_after'])} |")
        except Exception as exc:  # a case that cannot run here says why
            traceback.print_exc()
            row += f" not run: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''} |"
        lines.append(row)
        print(row, flush=True)
    return lines


# ---- published series ---------------------------------------------------------------------------------------------

def _bert_large(checkpointing: bool) -> nn.Module:
    cfg = transformers.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                  intermediate_size=4096, vocab_size=30522, max_position_embeddings=512,
                                  num_labels=2)
    cfg._attn_implementation = "eager"  # transformers 4.16 (Jan 2022) had no other BERT attention
    with torch.device("meta"):
        model = transformers.BertForSequenceClassification(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _bert_batch(batch: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(100, 30000, (batch, 512), generator=gen),
            "labels": torch.zeros(batch, dtype=torch.long)}


def _hf_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "adamw":  # the Trainer's "adamw_hf" of the time: a per-parameter loop (no foreach)
        return torch.optim.AdamW(params, lr=5e-5, foreach=False)
    if kind == "adafactor":  # Trainer optim="adafactor"
        return transformers.Adafactor(params, lr=5e-5, scale_parameter=False, relative_step=False)
    import bitsandbytes as bnb

    return bnb.optim.Adam8bit(params, lr=5e-5)


# (label, batch, accumulation, checkpointing, fp16, optimizer, published MiB)
HF_SERIES = [
    ("bs4 fp32 AdamW", 4, 1, False, False, "adamw", 14949),
    ("bs1 ga4 fp32 AdamW", 1, 4, False, False, "adamw", 8681),
    ("bs1 ga4 ckpt fp32 AdamW", 1, 4, True, False, "adamw", 6775),
    ("bs4 fp16 AdamW", 4, 1, False, True, "adamw", 13939),
    ("bs1 ga4 ckpt fp16 AdamW", 1, 4, True, True, "adamw", 7275),
    ("bs4 fp32 Adafactor", 4, 1, False, False, "adafactor", 12295),
    ("bs1 ga4 ckpt fp16 Adafactor", 1, 4, True, True, "adafactor", 4847),
    ("bs4 fp32 Adam8bit", 4, 1, False, False, "adam8bit", 13085),
    ("bs1 ga4 ckpt fp16 Adam8bit", 1, 4, True, True, "adam8bit", 5363),
]
# That Trainer zeroed with `model.zero_grad()` after each optimizer step, and torch before 2.0 defaulted to
# set_to_none=False: the gradients stayed allocated, zero-filled, through every later forward.
HF_ZERO_GRAD = "in_place"
HF_THEIR_CONTEXT = 1343 * MiB  # "torch.ones((1, 1)).to('cuda')" -> "GPU memory occupied: 1343 MB"


class _SoftmaxSavingItsInput(torch.autograd.Function):
    """softmax as torch 1.10 and earlier recorded it for backward: its input saved beside its output.

    derivatives.yaml read `_softmax_backward_data(grad, result, dim, self)` until pytorch/pytorch#65242 (first
    released in 1.11; transformers#16043 follows the API change "between 1.10 and 1.11"), so autograd kept the
    attention scores alive until backward, one more (batch, heads, seq, seq) fp32 tensor per layer. Series 1's
    nvidia-smi output is dated 11 Jan 2022, when 1.10.1 was the newest torch.
    """

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, dim: int) -> torch.Tensor:
        probs = torch._softmax(scores, dim, False)
        ctx.save_for_backward(scores, probs)
        ctx.dim = dim
        return probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        scores, probs = ctx.saved_tensors
        return torch._softmax_backward_data(grad, probs, ctx.dim, scores.dtype), None


@contextlib.contextmanager
def torch_110_softmax() -> Any:
    """Within the block, `nn.functional.softmax` records its autograd as torch 1.10 did (see the class above).

    Under autocast the input is cast to fp32 first, as CUDA autocast's fp32 list does before autograd records.
    """
    saved = nn.functional.softmax

    def softmax(scores: torch.Tensor, dim: int | None = None, _stacklevel: int = 3,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        if dtype is not None:
            scores = scores.to(dtype)
        elif torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
            scores = scores.float()
        return _SoftmaxSavingItsInput.apply(scores, scores.dim() - 1 if dim is None else dim)

    nn.functional.softmax = softmax
    try:
        yield
    finally:
        nn.functional.softmax = saved


def _hf_estimate(row: tuple[Any, ...], gpu: str) -> preflight.Estimate:
    _, batch, accumulate, ckpt, fp16, optim, _ = row
    model = _bert_large(ckpt)
    return _quiet(lambda: preflight.estimate(
        model, _hf_optimizer(model, optim), _bert_batch(batch), run=preflight.Run(precision="16-mixed" if fp16 else None, loop=preflight.Loop(accumulate=accumulate, zero_grad=HF_ZERO_GRAD, max_grad_norm=1.0, grad_scaler=fp16), target=preflight.Target(gpu=gpu))))


def run_hf_series() -> list[str]:
    gpu = get_gpu("V100-16GB").name
    lines = ["| row | published MiB | predicted MiB (our context) | error | with their 1343 MB context | error |"
             " and their torch's softmax | error | predicted max allocated MiB |", "|---" * 9 + "|"]
    print("\n".join(lines), flush=True)
    for row in HF_SERIES:
        label, published = row[0], row[-1] * MiB
        est = _hf_estimate(row, gpu)
        with torch_110_softmax():
            old = _hf_estimate(row, gpu)
        bound = next((e for e in (est, old) if e.coverage.lower_bound), None)
        if bound is not None:
            lines.append(f"| {label} | {row[-1]:,} | lower bound ({bound.coverage.failed_op}) | | | | | | |")
            print(lines[-1], flush=True)
            continue
        ours = est.device_total_bytes
        theirs = est.peak_reserved_bytes + HF_THEIR_CONTEXT
        their_torch = old.peak_reserved_bytes + HF_THEIR_CONTEXT
        lines.append(f"| {label} | {row[-1]:,} | {ours / MiB:,.0f} | {_err(ours, published)} | {theirs / MiB:,.0f} | "
                     f"{_err(theirs, published)} | {their_torch / MiB:,.0f} | {_err(their_torch, published)} | "
                     f"{est.peak_bytes / MiB:,.0f} |")
        print(lines[-1], flush=True)
    return lines


def _t0_3b() -> nn.Module:
    cfg = transformers.T5Config(d_model=1024, d_kv=128, d_ff=16384, num_layers=24, num_heads=32,
                                vocab_size=32128, feed_forward_proj="relu", tie_word_embeddings=False,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    with torch.device("meta"):
        return transformers.T5ForConditionalGeneration(cfg)


def _mt0_xxl() -> nn.Module:
    cfg = transformers.MT5Config(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                                 vocab_size=250112, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    with torch.device("meta"):
        return transformers.MT5ForConditionalGeneration(cfg)


def _bloomz_7b1() -> nn.Module:
    cfg = transformers.BloomConfig(hidden_size=4096, n_layer=30, n_head=32, vocab_size=250880)
    with torch.device("meta"):
        return transformers.BloomForCausalLM(cfg)


def _peft_lora(model: nn.Module, task: str) -> nn.Module:
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(task_type=task, inference_mode=False, r=8, lora_alpha=32,
                                                      lora_dropout=0.1))


def _seq2seq_batch(vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (8, 64), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.randint(3, vocab, (8, 3), generator=gen)}


def _clm_batch(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab, (8, 64), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


# (label, model, batch, published "GB" as the README prints it; its unit is not stated, both readings are shown)
# The optimizer keywords: {} is this torch's default (foreach on CUDA); {"foreach": False} is the per-parameter loop
# torch 1.13 (current when the table was published, Feb 2023) ran by default.
PEFT_SERIES = [
    ("T0_3B full fine-tuning", lambda: _t0_3b(), lambda: _seq2seq_batch(32128), {}, 47.14),
    ("T0_3B full fine-tuning, for-loop AdamW", lambda: _t0_3b(), lambda: _seq2seq_batch(32128),
     {"foreach": False}, 47.14),
    ("T0_3B LoRA", lambda: _peft_lora(_t0_3b(), "SEQ_2_SEQ_LM"), lambda: _seq2seq_batch(32128), {}, 14.4),
    ("mt0-xxl LoRA", lambda: _peft_lora(_mt0_xxl(), "SEQ_2_SEQ_LM"), lambda: _seq2seq_batch(250112), {}, 56.0),
    ("bloomz-7b1 LoRA", lambda: _peft_lora(_bloomz_7b1(), "CAUSAL_LM"), lambda: _clm_batch(250880), {}, 32.0),
]


def run_peft_series() -> list[str]:
    lines = ["| row | published GB | predicted max allocated GB | error (GB = 10^9 B) | error (GB = 2^30 B) |",
             "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for label, build, make_batch, optimizer_options, published in PEFT_SERIES:
        model = build()
        est = _quiet(lambda: preflight.estimate(model, _adamw(model, **optimizer_options), make_batch(),
                                                run=preflight.Run(target=preflight.Target(gpu="A100-80GB"))))
        if est.coverage.lower_bound:
            lines.append(f"| {label} | {published} | lower bound ({est.coverage.failed_op}) | | |")
        else:
            lines.append(f"| {label} | {published} | {est.peak_bytes / 1e9:,.2f} | "
                         f"{_err(est.peak_bytes, published * 1e9)} | {_err(est.peak_bytes, published * 2**30)} |")
        print(lines[-1], flush=True)
    return lines


def run_against(path: str) -> list[str]:
    """Re-plan, on this machine, every zoo case of a saved table of GPU measurements (``--out`` of a run on a GPU) for
    the GPU it names, and set the new plan beside those measurements: what a change to the CUDA target does to the
    errors, without a GPU."""
    text = open(path).read()
    named = next((line for line in text.splitlines() if line.startswith("Command:")), "")
    gpu = named.rsplit("planned for ", 1)[-1].rstrip(")").strip() if "planned for " in named else "H100-80GB"
    measured: dict[str, tuple[float, float]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 12 and cells[0] in {c.name for c in ZOO}:  # the zoo table measured on a GPU
            measured[cells[0]] = (float(cells[7].replace(",", "")), float(cells[9].replace(",", "")))
    if not measured:
        raise SystemExit(f"{path}: no zoo table measured on a GPU in it")
    head = ("| case | planned max allocated MiB | measured max allocated MiB | error | planned reserved MiB | "
            "measured max reserved MiB | error | plan s |")
    lines = [f"Measured: `{path}` ({named.split('(', 1)[-1].rstrip(')') if '(' in named else gpu}); planned here "
             f"for {gpu} (torch {torch.__version__}, transformers {transformers.__version__})", "", head,
             "|" + "---|" * head.count(" |")]
    print("\n".join(lines), flush=True)
    for case in ZOO:
        if case.name not in measured:
            continue
        t0 = time.perf_counter()
        est = _plan(case, gpu)
        seconds = time.perf_counter() - t0
        allocated, reserved = est.peak_allocated_bytes / MiB, (est.peak_reserved_bytes or 0) / MiB
        got_allocated, got_reserved = measured[case.name]
        lines.append(f"| {case.name} | {allocated:,.1f} | {got_allocated:,.1f} | "
                     f"{_err(allocated, got_allocated)} | {reserved:,.1f} | {got_reserved:,.1f} | "
                     f"{_err(reserved, got_reserved)} | {seconds:.1f} |")
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", help="catalog GPU to plan for (default: the CUDA device present, else H100-80GB)")
    parser.add_argument("--quick", action="store_true", help="two zoo cases, no published series")
    parser.add_argument("--part", default="all", help="comma-separated parts to run, of zoo, generation, hf and "
                        "peft (default: all; on a GPU `zoo,generation` are the measured ones)")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/gpu_validation.md")
    parser.add_argument("--out", default=RESULTS, help="where to write the tables (default: %(default)s)")
    parser.add_argument("--measure-generation", metavar="LABEL", help=argparse.SUPPRESS)  # the fresh process
    parser.add_argument("--against", metavar="TABLE", help="re-plan the zoo cases of a table measured on a GPU and "
                        "compare with its measurements (no GPU needed); prints, writes nothing")
    args = parser.parse_args(argv)
    if args.against:
        run_against(args.against)
        return 0
    if args.measure_generation:  # pragma: no cover - needs a GPU
        import json

        print(json.dumps(_measure_generation_here(args.measure_generation)))
        return 0
    parts = {"zoo", "generation", "hf", "peft"} if args.part == "all" else set(args.part.split(","))
    if parts - {"zoo", "generation", "hf", "peft"}:
        parser.error(f"--part: unknown {sorted(parts - {'zoo', 'generation', 'hf', 'peft'})}; "
                     "choose from zoo, generation, hf, peft")
    on_gpu = torch.cuda.is_available()
    gpu = args.gpu
    if gpu is None:
        gpu = get_gpu(torch.cuda.get_device_name()).name if on_gpu else "H100-80GB"  # pragma: no cover - GPU
    versions = (f"torch {torch.__version__}, transformers {transformers.__version__}, "
                f"{'GPU ' + torch.cuda.get_device_name() if on_gpu else 'no CUDA device'}")
    print(f"gpu_validation: planning for {gpu} ({versions})", flush=True)
    if not on_gpu:
        print("No CUDA device here: only the CPU-host predictions are computed; the on-device trace and the "
              "measurements need a GPU (run this same command on one).", flush=True)
    cases = [c for c in ZOO if c.name in QUICK] if args.quick else ZOO
    command = "python benchmarks/gpu_validation.py" + ("" if args.part == "all" else f" --part {args.part}")
    out = [f"Command: `{command}` ({versions}; planned for {gpu})", ""]
    if "zoo" in parts:
        out += run_zoo(cases, gpu, on_gpu)
    if not args.quick and "generation" in parts:
        title = (f"Generation (`model.generate`, no gradients): bf16 weights, {GEN_PROMPTS} prompts x {GEN_PROMPT} "
                 f"tokens, {GEN_NEW} new tokens each")
        print("\n" + title, flush=True)
        out += ["", title, ""] + run_generation(gpu, on_gpu)
    if not args.quick and "hf" in parts:
        print("\nPublished series 1: bert-large-uncased on a V100 16 GB (HF docs v4.21), nvidia-smi after training",
              flush=True)
        out += ["", "Published series 1: HF \"Efficient Training on a Single GPU\" (v4.21), bert-large-uncased, "
                "V100-SXM2 16 GB, nvidia-smi after training", ""] + run_hf_series()
    if not args.quick and "peft" in parts:
        print("\nPublished series 2: PEFT README, A100 80GB, peak max_memory_allocated", flush=True)
        out += ["", "Published series 2: PEFT README, A100 80GB, peak torch.cuda.max_memory_allocated", ""]
        out += run_peft_series()
    if not args.no_write:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
