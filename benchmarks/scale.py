"""Cost of a prediction at full scale: Llama-shaped models built on the meta device, on this machine.

Part 1 (the 7B shape, full trace): hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000; batch
1 x 2048 tokens; bf16 parameters (bf16-true) and AdamW, for a CPU target and for an H100-80GB target (foreach
AdamW, 512-byte blocks, allocator).

Part 2 (depth-independent traces, ``fast=True``): Llama-3.2-1B, Llama-2-7B, Llama-3-70B and Llama-3.1-405B shapes,
and Mixtral-8x7B and Gemma-2-9B (`OTHERS`), same batch and precision, H100-80GB target; each configuration runs in its own process so that its peak RSS is
its own. The full trace runs too where it finishes within `FULL_LIMIT_S`, and the predictions are compared.

Part 3: `advise(..., fast=True)` on the 7B and 70B shapes (80 GiB budget): time for all suggestions.

Run: python benchmarks/scale.py   (several minutes on 2 CPU cores)
Writes benchmarks/results/scale.md and prints the same tables.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import torch
import transformers

import preflight

transformers.logging.set_verbosity_error()
RESULTS = os.path.join(os.path.dirname(__file__), "results", "scale.md")
FULL_LIMIT_S = 900  # the full trace of a configuration is skipped past this

# name: (hidden, intermediate, layers, heads, kv heads, vocab)
SHAPES = {
    "1B": (2048, 8192, 16, 32, 8, 128256),
    "7B": (4096, 11008, 32, 32, 32, 32000),
    "70B": (8192, 28672, 80, 64, 8, 128256),
    "405B": (16384, 53248, 126, 128, 8, 128256),
}


# Other layer patterns, from the published configs: a mixture of experts (Mixtral-8x7B) and sliding and global
# attention alternating (Gemma-2-9B: period 2). A hybrid Mamba/attention stack (Jamba's pattern, period 8) composes
# in `tests/trace/test_compose.py` at a small size; at Jamba-v0.1's size its Mamba layers run transformers' slow
# path on a CPU host, a sequential scan with one step per token, and a single trace took over 10 minutes here.
OTHERS = {
    "Mixtral-8x7B": lambda: transformers.MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=2048),
    "Gemma-2-9B": lambda: transformers.Gemma2Config(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=256000, sliding_window=4096, max_position_embeddings=2048),
}
SEQ: dict[str, int] = {}


def _config(shape: str) -> transformers.PretrainedConfig:
    if shape in OTHERS:
        return OTHERS[shape]()
    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    return transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                    num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                    max_position_embeddings=2048)


def _model(shape: str) -> tuple[torch.nn.Module, float]:
    config = _config(shape)
    start = time.perf_counter()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model, time.perf_counter() - start


def _layers(shape: str) -> int:
    return _config(shape).num_hidden_layers


def _batch(seq: int = 2048) -> dict[str, torch.Tensor]:
    ids = torch.zeros(1, seq, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def one(shape: str, fast: bool) -> dict:
    """Plan one configuration in this process; its numbers as a dict."""
    model, build = _model(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start, cpu = time.perf_counter(), time.process_time()
    est = preflight.estimate(model, optimizer, _batch(SEQ.get(shape, 2048)), run=preflight.Run(precision="bf16-true", target=preflight.Target(gpu="H100-80GB"), fast=fast))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"shape": shape, "fast": fast, "build_s": build, "seconds": seconds, "cpu": cpu,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
            "params": sum(p.numel() for p in model.parameters()), "peak": est.peak_bytes,
            "breakdown": est.breakdown, "reserved": est.peak_reserved_bytes, "phase": est.peak_phase,
            "composed": any(n.startswith("depth-independent") for n in est.coverage.notes),
            "note": next((n for n in est.coverage.notes if n.startswith(("depth-independent", "traced in full"))), "")}


def _run(shape: str, fast: bool, timeout: float) -> dict | None:
    cmd = [sys.executable, __file__, "--one", shape, "fast" if fast else "full"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def advise_one(shape: str) -> dict:
    """`advise(..., fast=True)` on one shape in this process: time and suggestions."""
    model, _ = _model(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start, cpu = time.perf_counter(), time.process_time()
    suggestions = preflight.advise(model, optimizer, _batch(), run=preflight.Run(precision="bf16-true", target=preflight.Target(device="cuda", budget="80GiB"), fast=True))
    return {"shape": shape, "seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu,
            "suggestions": [s.change for s in suggestions]}


def part3() -> str:
    rows = []
    for shape in ("7B", "70B"):
        cmd = [sys.executable, __file__, "--advise", shape]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=FULL_LIMIT_S, check=True)
            found = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(f"| {shape} | {found['seconds']:.1f} s ({found['cpu']:.1f} s CPU) | "
                        f"{len(found['suggestions'])} | {', '.join(map(str, found['suggestions']))} |")
        except subprocess.TimeoutExpired:
            rows.append(f"| {shape} | over {FULL_LIMIT_S} s | | |")
    return ("`advise(model, optimizer, batch, Run(precision=\"bf16-true\", target=Target(device=\"cuda\", "
            "budget=\"80GiB\")))` (fast=True, the default), every suggestion "
            "traced (time = the whole call, wall clock and CPU)\n\n| shape | advise time | suggestions | changes |\n"
            "|---|---|---|---|\n" + "\n".join(rows) + "\n")


def part1() -> str:
    model, build = _model("7B")
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = []
    for target in ({}, {"gpu": "H100-80GB"}):
        start = time.perf_counter()
        est = preflight.estimate(model, optimizer, _batch(),
                                 preflight.Run(precision="bf16-true", target=preflight.Target(**target),
                                               fast=False))  # part 1 times the full trace; part 2 compares both
        seconds = time.perf_counter() - start
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        rows.append(f"| {target.get('gpu', 'cpu')} | {params / 1e9:.2f} B | {seconds:.1f} | {rss / 2**30:.2f} | "
                    f"{preflight.format_bytes(est.peak_bytes)} | {est.peak_phase} | "
                    f"{preflight.format_bytes(est.peak_reserved_bytes)} |")
    header = ("| target | parameters | estimate s (total) | peak RSS GiB (process) | predicted peak | phase | "
              "predicted reserved |\n|---|---|---|---|---|---|---|")
    return (f"Command: `python benchmarks/scale.py` (torch {torch.__version__}, {os.cpu_count()} CPU cores; "
            f"model built on meta in {build:.1f} s)\n\n{header}\n" + "\n".join(rows) + "\n")


def part2() -> str:
    rows = []
    for shape in (*SHAPES, *OTHERS):
        fast = _run(shape, True, FULL_LIMIT_S)
        full = _run(shape, False, FULL_LIMIT_S)
        layers = _layers(shape)
        fast_cell = "not run" if fast is None else (f"{fast['seconds']:.1f} s ({fast['cpu']:.1f} s CPU), "
                                                     f"{fast['rss'] / 2**30:.2f} GiB"
                                                     + ("" if fast["composed"] else " (traced in full)"))
        full_cell = (f"over {FULL_LIMIT_S} s" if full is None
                     else f"{full['seconds']:.1f} s ({full['cpu']:.1f} s CPU), {full['rss'] / 2**30:.2f} GiB")
        if fast is not None and full is not None:
            same = ("yes" if (fast["peak"], fast["breakdown"], fast["reserved"]) ==
                    (full["peak"], full["breakdown"], full["reserved"]) else "**no**")
        else:
            same = "n/a"
        ref = fast or full
        rows.append(f"| {shape} | {layers} | {ref['params'] / 1e9:.2f} B | {fast_cell} | {full_cell} | "
                    f"{preflight.format_bytes(ref['peak'])} | {preflight.format_bytes(ref['reserved'])} | "
                    f"{ref['phase']} | {same} |")
    header = ("| shape | layers | parameters | fast=True: wall (CPU) time, peak RSS | full trace: wall (CPU) time, "
              "peak RSS | "
              "predicted peak | predicted reserved | phase | composed = full (peak, breakdown, reserved) |\n"
              "|---|---|---|---|---|---|---|---|---|")
    return ("Llama shapes and two other layer patterns, bf16-true AdamW, batch 1 x 2048, "
            "H100-80GB target; each run in its own process "
            "(time = the `estimate` call, wall clock and the process's CPU time; RSS = the process's peak, model "
            f"construction included; {os.cpu_count()} CPU cores{_load()})\n\n"
            f"{header}\n" + "\n".join(rows) + "\n")


def _load() -> str:
    try:
        return f", load average {os.getloadavg()[0]:.1f} at the end"
    except OSError:
        return ""


def main() -> None:
    text = part1() + "\n" + part2() + "\n" + part3()
    print(text)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        f.write(text)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2], sys.argv[3] == "fast")))
    elif len(sys.argv) == 3 and sys.argv[1] == "--advise":
        print(json.dumps(advise_one(sys.argv[2]), default=str))
    else:
        main()
