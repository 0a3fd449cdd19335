"""Benchmark the prediction for quantized base weights (QLoRA's 4-bit, LLM.int8's 8-bit) against the measured peak.

Each model is loaded as users load one for QLoRA or LLM.int8 fine-tuning: a Llama checkpoint (a small config,
random weights, saved to a temporary folder) read back with ``from_pretrained(quantization_config=
BitsAndBytesConfig(...))``, peft's ``prepare_model_for_kbit_training`` (with and without its gradient
checkpointing), LoRA r=16 on every projection, AdamW over the adapters. bitsandbytes runs its 4-bit and 8-bit
layers on CPU, so the peak of two real training steps is measured here (`preflight.measure`, the profiler's
allocator events) and set beside `preflight.estimate`'s.

Run from the repository root: ``python benchmarks/quantized.py`` (about a minute on 2 CPU cores). Prints a
Markdown table and writes it to benchmarks/results/quantized.md.
"""

from __future__ import annotations

import pathlib
import platform
import tempfile
import time

import torch

import preflight

MiB = 2**20
OUT = pathlib.Path(__file__).parent / "results" / "quantized.md"
BATCH, SEQ, VOCAB = 4, 128, 2000
SETUPS = [  # (name, BitsAndBytesConfig arguments)
    ("QLoRA nf4 + double quant", dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)),
    ("QLoRA nf4", dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)),
    ("QLoRA fp4 + double quant", dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)),
    ("QLoRA fp4, fp32 compute", dict(load_in_4bit=True, bnb_4bit_quant_type="fp4")),
    ("LLM.int8 + LoRA", dict(load_in_8bit=True)),
]


def load(folder: str, quantization: dict, checkpointing: bool) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(**quantization),
                                                 device_map={"": "cpu"})
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=16, target_modules=targets, task_type="CAUSAL_LM"))


def main() -> None:
    import bitsandbytes
    import peft
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=VOCAB)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    batch = {"input_ids": ids, "labels": ids}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        for name, quantization in SETUPS:
            for checkpointing in (False, True):
                model = load(folder, quantization, checkpointing)
                optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
                start = time.perf_counter()
                est = preflight.estimate(model, optimizer, batch)
                seconds = time.perf_counter() - start
                measured = preflight.measure(model, optimizer, batch).peak_bytes
                error = (est.peak_bytes - measured) / measured
                covered = "lower bound" if est.coverage.lower_bound else "traced"
                rows.append(f"| {name}{' + checkpointing' if checkpointing else ''} | {measured / MiB:.2f} | "
                            f"{est.peak_bytes / MiB:.2f} | {error:+.2%} | {covered} | {seconds:.1f} |")
                print(rows[-1], flush=True)
    header = (f"Command: `python benchmarks/quantized.py` (torch {torch.__version__}, transformers "
              f"{transformers.__version__}, peft {peft.__version__}, bitsandbytes {bitsandbytes.__version__}, "
              f"{platform.machine()} CPU; Llama 4 layers x 512 hidden, batch {BATCH} x {SEQ}, LoRA r=16 on every "
              "projection, AdamW)\n\n"
              "| set-up | measured MiB | preflight MiB | error | coverage | trace s |\n|---|---|---|---|---|---|\n")
    table = header + "\n".join(rows) + "\n"
    OUT.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
