"""Accuracy and speed of preflight.estimate against the measured peak, beside the alternatives users have today.

For each configuration of a zoo built from transformers configs (random weights, nothing downloaded):
    measured   the peak of two real training steps on CPU (preflight.measure: profiler allocator events)
    preflight  preflight.estimate on fake tensors, its error, and its trace time
    step       wall time of one real training step (no profiler)
    accelerate `accelerate estimate-memory`'s "Training using Adam" figure, computed with its own functions
               (calculate_maximum_sizes + estimate_training_usage, accelerate/commands/estimate.py)
    deepspeed  DeepSpeed's ZeRO-2 model-state estimator at world size 1, no offload: 4P + 16P bytes
               (estimate_zero2_model_states_mem_needs, deepspeed/runtime/zero/stage_1_and_2.py); DeepSpeed is
               not installed here, the formula is applied to the parameter count P
    memtracker PyTorch's MemTracker (torch.distributed._tools) over the same two steps on fake tensors, where it
               runs

Run: python benchmarks/accuracy.py            (about 3 minutes on 2 CPU cores)
Writes benchmarks/results/accuracy.md and prints the same table.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn

import preflight

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore")

BATCH = 8  # sequences (or images) per step
SEQ = 256  # tokens per sequence
VOCAB = 8000
IMAGE = 64  # image side for the vision models
RESULTS = os.path.join(os.path.dirname(__file__), "results", "accuracy.md")


@dataclass
class Case:
    name: str
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer, Any]]
    precision: str | None = None
    step: Callable | None = None
    adam: bool = True  # the accelerate / DeepSpeed formulas assume Adam


def lm_batch(vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def gpt2(**kw: Any) -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0, **kw))


def llama(attn: str = "sdpa") -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB,
                                   max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg._attn_implementation = attn
    return transformers.LlamaForCausalLM(cfg)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def lora(model: nn.Module, targets: list[str]) -> nn.Module:
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets))


def checkpointed(model: nn.Module) -> nn.Module:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def bert() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    m = transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, vocab_size=VOCAB,
        max_position_embeddings=SEQ))
    return m, adamw(m), lm_batch()


def t5() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    m = transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=256, d_ff=1024, num_layers=3, num_heads=4, d_kv=64, vocab_size=VOCAB, decoder_start_token_id=0))
    return m, adamw(m), lm_batch()


def image_batch(n_classes: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(BATCH * 2, 3, IMAGE, IMAGE, generator=gen),
            "labels": torch.randint(0, n_classes, (BATCH * 2,), generator=gen)}


def vit() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    m = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=IMAGE, patch_size=8, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, num_labels=10))
    return m, adamw(m), image_batch(10)


def resnet() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    m = transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=32, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2], layer_type="basic",
        num_labels=10))
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), image_batch(10)


def convnext() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    m = transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        hidden_sizes=[48, 96, 192, 384], depths=[1, 1, 2, 1], num_labels=10))
    return m, adamw(m), image_batch(10)


def bnb_adamw8bit(model: nn.Module) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(model.parameters(), lr=1e-4)


CASES = [
    Case("GPT-2 fp32 AdamW", lambda: (m := gpt2(), adamw(m), lm_batch())),
    Case("GPT-2 bf16-mixed", lambda: (m := gpt2(), adamw(m), lm_batch()), precision="bf16-mixed"),
    Case("GPT-2 checkpointing", lambda: (m := checkpointed(gpt2()), adamw(m), lm_batch())),
    Case("GPT-2 LoRA r=8", lambda: (m := lora(gpt2(), ["c_attn"]), adamw(m), lm_batch())),
    Case("GPT-2 bnb AdamW8bit", lambda: (m := gpt2(), bnb_adamw8bit(m), lm_batch())),
    Case("Llama sdpa AdamW", lambda: (m := llama(), adamw(m), lm_batch())),
    Case("Llama eager bf16-true", lambda: (m := llama("eager"), adamw(m), lm_batch()), precision="bf16-true"),
    Case("Llama LoRA + checkpointing", lambda: (m := lora(checkpointed(llama()), ["q_proj", "v_proj"]),
                                                 adamw(m), lm_batch())),
    Case("BERT masked-LM", bert),
    Case("T5 seq2seq", t5),
    Case("ViT image-cls", vit),
    Case("ResNet-18-like SGD", resnet, adam=False),
    Case("ConvNeXt (depthwise) AdamW", convnext),
]


def accelerate_figure(model: nn.Module, precision: str | None) -> int:
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    total, _ = calculate_maximum_sizes(model)
    dtype = "bfloat16" if precision in ("bf16-mixed", "16-mixed") else "float32"
    return int(max(estimate_training_usage(total, dtype).values()))


def deepspeed_figure(model: nn.Module) -> int:
    params = sum({id(p): p.numel() for p in model.parameters()}.values())
    return 4 * params + 16 * params  # world size 1, no offload


def memtracker_figure(case: Case) -> tuple[int | None, str]:
    """MemTracker over two steps on fake tensors, built under FakeTensorMode as its documentation shows."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    try:
        with FakeTensorMode():
            torch.manual_seed(0)
            model, optimizer, batch = case.build()
            if case.precision in ("bf16-true", "16-true"):  # what Lightning's *-true plugins do to the model
                model.to(torch.bfloat16 if case.precision == "bf16-true" else torch.float16)
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
            with tracker:
                for i in range(2):
                    with preflight_autocast(case.precision):
                        out = case.step(model, batch) if case.step else model(**batch)
                    loss = out if isinstance(out, torch.Tensor) else out.loss
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    if i == 0:
                        tracker.reset_mod_stats()  # as torch's test_mem_tracker does between iterations
            peak = tracker.get_tracker_snapshot("peak")
        return int(sum(dev.get("Total", 0) for dev in peak.values())), ""
    except Exception as err:  # noqa: BLE001 - the benchmark reports what the alternative does
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:60]}"


def preflight_autocast(precision: str | None) -> contextlib.AbstractContextManager:
    from preflight._steps import autocast_for

    return autocast_for(precision, "cpu")


def step_seconds(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, case: Case) -> float:
    from preflight._steps import run_steps

    start = time.perf_counter()
    run_steps(model, optimizer, batch, step=case.step, precision=case.precision, device_type="cpu", steps=1)
    return time.perf_counter() - start


def pct(pred: int | None, measured: int) -> str:
    return "n/a" if pred is None else f"{(pred - measured) / measured:+.1%}"


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f}"


def main() -> None:
    rows = []
    header = ("| configuration | measured MiB | preflight MiB | error | trace s | real step s | accelerate "
              "(error) | DeepSpeed ZeRO-2 (error) | MemTracker (error) |")
    print(header)
    print("|" + "---|" * 9)
    for case in CASES:
        torch.manual_seed(0)
        model, optimizer, batch = case.build()
        with contextlib.redirect_stderr(io.StringIO()):  # the profiler's start/stop lines
            est = preflight.estimate(model, optimizer, batch, run=preflight.Run(precision=case.precision), step=case.step)
            measured = preflight.measure(model, optimizer, batch, run=preflight.Run(precision=case.precision), step=case.step)
        seconds = step_seconds(model, optimizer, batch, case)
        acc = accelerate_figure(model, case.precision) if case.adam else None
        ds = deepspeed_figure(model) if case.adam else None
        mt, mt_error = memtracker_figure(case)
        m = measured.peak_bytes
        mt_cell = f"{mib(mt)} ({pct(mt, m)})" if mt is not None else f"fails: {mt_error}"
        row = (f"| {case.name} | {mib(m)} | {mib(est.peak_bytes)} | {pct(est.peak_bytes, m)} | "
               f"{est.trace_seconds:.2f} | {seconds:.2f} | {mib(acc)} ({pct(acc, m)}) | {mib(ds)} ({pct(ds, m)}) | "
               f"{mt_cell} |")
        rows.append(row)
        print(row, flush=True)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        f.write(f"Command: `python benchmarks/accuracy.py` (torch {torch.__version__}, transformers "
                f"{transformers.__version__}, CPU, batch {BATCH}, seq {SEQ}, images {BATCH * 2}x{IMAGE}px)\n\n")
        f.write(header + "\n|" + "---|" * 9 + "\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    sys.exit(main())
