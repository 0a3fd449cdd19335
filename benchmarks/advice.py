"""Advice on the questions users ask most: a published model that does not fit a GPU, as typed.

For each case, `preflight estimate` on the published config (bf16-mixed, as the HF Trainer's ``bf16=True`` and
Lightning's ``precision="bf16-mixed"`` run it), then the first suggestion that fits run again as the command it
printed; where one GPU cannot train the model as it is, the fewest GPUs offered are run again too, and half of
them. Writes `benchmarks/results/advice.md`, quoted in docs/advice-and-autotune.md.

    python benchmarks/advice.py            # about 30 minutes on 2 cores
    python benchmarks/advice.py --case 0   # one case
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "advice.md")
CASES = [  # (name, published config, batch, seq, GPU)
    ("Llama-3-8B", "llama-3-8b.json", 1, 4096, "H100-80GB"),
    ("Mistral-7B", "mistral-7b.json", 1, 2048, "RTX-4090"),
    ("Llama-2-13B", "llama-2-13b.json", 2, 2048, "A100-40GB"),
    ("Llama-3-70B", "llama-3-70b.json", 1, 2048, "H100-80GB"),  # full fine-tuning needs more GPUs
]


def run_case(name: str, config: str, batch: int, seq: int, gpu: str) -> dict:
    from preflight._cli import main

    flags = ["--hf-config", os.path.relpath(os.path.join(HERE, "configs", config)), "--batch", str(batch), "--seq", str(seq),
             "--precision", "bf16-mixed", "--gpu", gpu]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            status = main(["estimate", *flags, "--json", out])
        seconds = time.perf_counter() - start
        report = json.load(open(out))
        first = next((s for s in report["suggestions"] if s["fits"]), None)
        rerun = None
        if first is not None and first.get("command"):
            with contextlib.redirect_stdout(io.StringIO()):
                rerun = main([*first["command"][1:], "--json", out])
            rerun_report = json.load(open(out))
        more = next((s for s in report["suggestions"] if "more_gpus" in s["changes"]), None)
        more_exits = None
        if more is not None and more.get("command"):
            n = more["change"]["world_size"]
            half = list(more["command"][1:])
            half[half.index("--world-size") + 1] = str(n // 2)
            with contextlib.redirect_stdout(io.StringIO()):
                more_exits = (main(more["command"][1:]), main(half))
    row = {"name": name, "more": more, "more_exits": more_exits,
           "gpu": gpu, "shape": f"{batch} x {seq}", "status": status,
           "required": report["required_bytes"], "seconds": seconds, "printed": printed.getvalue(),
           "first": first, "rank": None if first is None else report["suggestions"].index(first) + 1,
           "rerun": rerun, "rerun_required": None if rerun is None else rerun_report["required_bytes"],
           "usable": report.get("usable_bytes")}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", type=int, action="append", help="run only these cases (index)")
    args = parser.parse_args(argv)
    import torch

    from preflight._units import format_bytes

    picked = [CASES[i] for i in args.case] if args.case else CASES
    rows = []
    for case in picked:
        print(f"{case[0]} on {case[4]}...", file=sys.stderr)
        rows.append(run_case(*case))
    lines = [f"Command: `python benchmarks/advice.py` (torch {torch.__version__}, {os.cpu_count()} CPU cores; "
             "published configs in `benchmarks/configs/`, bf16-mixed with fp32 master weights and torch's AdamW as "
             "typed, default headroom 10%)", "",
             "| model | GPU | batch x seq | exit | needs as typed | first set-up that fits (rank) | its figure | "
             "rerun exit | estimate + advice time | fewest GPUs training it as it is (rerun exit; half as many) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        first = r["first"]
        what = "none" if first is None else f"{' + '.join(first['changes'])} ({r['rank']})"
        figure = "" if first is None else format_bytes(first["predicted_peak_bytes"])
        lines.append(f"| {r['name']} | {r['gpu']} | {r['shape']} | {r['status']} | {format_bytes(r['required'])} | "
                     f"{what} | {figure} | {r['rerun']} | {r['seconds']:.0f} s | {_more(r, format_bytes)} |")
    lines.append("")
    for r in rows:
        for s in (r["first"], r["more"]):
            if s is not None and s.get("command"):
                lines += [f"{r['name']}: `{' '.join(s['command'])}`", "", f"> {s['description']}", ""]
    text = "\n".join(lines)
    print(text)
    if not args.case:
        with open(RESULTS, "w") as f:
            f.write(text + "\n")
    for r in rows:
        with open(os.path.join(HERE, "results", f"advice-{r['name']}.txt"), "w") as f:
            f.write(r["printed"])
    return 0


def _more(row: dict, format_bytes) -> str:
    more = row["more"]
    if more is None:
        return "not offered (a set-up that keeps full fine-tuning fits one GPU)"
    n = more["change"]["world_size"]
    state = "fits" if more["fits"] else "over"
    exits = "" if row["more_exits"] is None else f" ({row['more_exits'][0]}; {n // 2} GPUs: {row['more_exits'][1]})"
    figure = format_bytes(more["predicted_peak_bytes"])
    return f"{n} GPUs: {' + '.join(more['changes'])}, {figure} per GPU, {state}{exits}"


if __name__ == "__main__":
    sys.exit(main())
