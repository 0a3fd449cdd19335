"""Cost of a prediction at full scale: a Llama-7B-shaped model built on the meta device, on this machine.

Hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000; batch 1 x 2048 tokens; bf16 parameters
(bf16-true) and AdamW. Reports trace wall time, the process's peak RSS (resource.getrusage), and the
prediction, for a CPU target and for an H100-80GB target (foreach AdamW, 512-byte blocks, allocator).

Run: python benchmarks/scale.py   (about a minute on 2 CPU cores)
Writes benchmarks/results/scale.md and prints the same table.
"""

from __future__ import annotations

import os
import resource
import time

import torch
import transformers

import preflight

transformers.logging.set_verbosity_error()
RESULTS = os.path.join(os.path.dirname(__file__), "results", "scale.md")


def main() -> None:
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                      max_position_embeddings=2048)
    start = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    build = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.zeros(1, 2048, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    rows = []
    for target in ({}, {"gpu": "H100-80GB"}):
        start = time.perf_counter()
        est = preflight.estimate(model, optimizer, batch, precision="bf16-true", **target)
        seconds = time.perf_counter() - start
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        rows.append(f"| {target.get('gpu', 'cpu')} | {params / 1e9:.2f} B | {seconds:.1f} | {rss / 2**30:.2f} | "
                    f"{preflight.format_bytes(est.peak_bytes)} | {est.peak_phase} | "
                    f"{preflight.format_bytes(est.peak_reserved_bytes)} |")
    header = ("| target | parameters | estimate s (total) | peak RSS GiB (process) | predicted peak | phase | "
              "predicted reserved |\n|---|---|---|---|---|---|---|")
    text = (f"Command: `python benchmarks/scale.py` (torch {torch.__version__}, {os.cpu_count()} CPU cores; "
            f"model built on meta in {build:.1f} s)\n\n{header}\n" + "\n".join(rows) + "\n")
    print(text)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
