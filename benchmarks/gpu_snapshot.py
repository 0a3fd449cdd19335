"""Record the CUDA caching allocator's history of gpu_validation cases, to compare with the trace (GPU only).

    python benchmarks/gpu_snapshot.py "GPT-2 fp32 AdamW" "GPT-2 greedy" --out DIR

For each named case (a training case of `gpu_validation.ZOO` or a generation of `gpu_validation.GENERATION`) the
allocator's history is recorded from before the model is built (``torch.cuda.memory._record_memory_history``, Python
frames) through two measured training steps or the ``generate`` call; the snapshot is written to DIR (load it at
https://pytorch.org/memory_viz, or read it with ``--read``), and the blocks live at the peak of allocated bytes
are printed, largest first, with the Python line that allocated each. A training case also prints the coverage of
the estimate traced on the device. ``python benchmarks/gpu_snapshot.py --read FILE`` prints a saved snapshot's
peak blocks on any machine (a gzipped one too), and ``--replay FILE`` feeds the recorded allocations and frees to
`preflight.allocator.simulate` and sets its reserved and allocated peaks beside the segments the device recorded:
the check that the allocator model, given the device's own sequence, reserves what the device reserved.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import sys
from collections import Counter
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_validation as gv  # noqa: E402

import preflight  # noqa: E402

MiB = 2**20


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch's own Python files, as file:line name."""
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name and not name.startswith("<"):
            return f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}"
    return "?" if not frames else f"{os.path.basename(frames[0].get('filename', ''))}:{frames[0].get('line')}"


def peak_blocks(snapshot: dict[str, Any], device: int = 0) -> tuple[int, list[tuple[int, str]]]:
    """Replay the recorded trace: the peak of allocated bytes and the (size, where) of each block live there."""
    live: dict[int, tuple[int, str]] = {}
    current = peak = 0
    at_peak: list[tuple[int, str]] = []
    for e in snapshot["device_traces"][device]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
            current += e["size"]
            if current > peak:
                peak, at_peak = current, list(live.values())
        elif e["action"] == "free_completed" and e["addr"] in live:
            current -= live.pop(e["addr"])[0]
    return peak, sorted(at_peak, reverse=True)


def replay(snapshot: dict[str, Any], device: int = 0) -> dict[str, int]:
    """The recorded sequence through `preflight.allocator.simulate`, beside the recorded segments' peak."""
    from preflight._result import Event
    from preflight.allocator import simulate

    live: dict[int, tuple[int, int]] = {}
    events: list[Event] = []
    segments = recorded_peak = count = 0
    for e in snapshot["device_traces"][device]:
        if e["action"] == "alloc":
            count += 1
            live[e["addr"]] = (count, e["size"])
            events.append(Event(count, e["size"], 0, "recorded"))
        elif e["action"] == "free_completed" and e["addr"] in live:
            uid, size = live.pop(e["addr"])
            events.append(Event(uid, -size, 0, "recorded"))
        elif e["action"] == "segment_alloc":
            segments += e["size"]
            recorded_peak = max(recorded_peak, segments)
        elif e["action"] == "segment_free":
            segments -= e["size"]
    sim = simulate(events)
    return {"recorded_reserved": recorded_peak, "simulated_reserved": sim.peak_reserved_bytes,
            "simulated_allocated": sim.peak_allocated_bytes, "simulated_segments": sim.num_segments}


def print_peak(snapshot: dict[str, Any], top: int = 40) -> None:
    peak, blocks = peak_blocks(snapshot)
    print(f"peak of the recorded trace: {peak:,} B ({peak / MiB:,.2f} MiB) in {len(blocks)} blocks")
    grouped = Counter()
    for size, where in blocks:
        grouped[(size, where)] += 1
    for (size, where), n in sorted(grouped.items(), key=lambda kv: -kv[0][0] * kv[1])[:top]:
        print(f"  {n:4d} x {size:>14,} B  {where}")


def record(name: str, out: str) -> None:  # pragma: no cover - needs a GPU
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    cases = {c.name: c for c in gv.ZOO}
    generations = {label: (build, extra) for label, build, extra in gv.GENERATION}
    if name in cases:
        case = cases[name]
        model, opt, batch = case.build("cuda")
        m = preflight.measure(model, opt, batch, case.run())
        print(f"{name}: measured {m.peak_bytes:,} B allocated, {m.peak_reserved_bytes:,} B reserved")
    else:
        build, extra = generations[name]
        model = build("cuda").to(torch.bfloat16).eval()
        prompts = gv._prompts("cuda")
        generation = {"max_new_tokens": gv.GEN_NEW, "min_new_tokens": gv.GEN_NEW, "pad_token_id": 0, **extra}
        with torch.no_grad():
            model.generate(**prompts, **generation, eos_token_id=gv.VOCAB + 5)
        torch.cuda.synchronize()
        print(f"{name}: max_memory_allocated {torch.cuda.max_memory_allocated():,} B")
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    path = os.path.join(out, "".join(ch if ch.isalnum() else "_" for ch in name) + ".pickle")
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    print_peak(snapshot)
    if name in cases:
        est = preflight.estimate(model, opt, batch, cases[name].run(gv.get_gpu(torch.cuda.get_device_name()).name))
        print(f"on-device estimate: {est.peak_bytes:,} B, lower bound {est.coverage.lower_bound}, "
              f"failed op {est.coverage.failed_op}, reason {est.coverage.reason}")
        for note in est.coverage.notes:
            print("  note:", note)
    del model
    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="zoo or generation case names of gpu_validation.py")
    parser.add_argument("--out", default=".", help="folder for the snapshots")
    parser.add_argument("--read", help="print the peak blocks of a saved snapshot instead")
    parser.add_argument("--replay", help="replay a saved snapshot's allocations through preflight's allocator model")
    args = parser.parse_args(argv)
    if args.read or args.replay:
        import gzip

        path = args.read or args.replay
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            snapshot = pickle.load(f)
        if args.read:
            print_peak(snapshot)
        else:
            got = replay(snapshot)
            print(f"recorded segments' peak {got['recorded_reserved']:,} B; simulated on the recorded sequence: "
                  f"reserved {got['simulated_reserved']:,} B in {got['simulated_segments']} segments, allocated "
                  f"{got['simulated_allocated']:,} B")
        return 0
    if not torch.cuda.is_available():
        print("gpu_snapshot records the CUDA allocator: it needs a GPU (use --read FILE to read a snapshot)")
        return 2
    for name in args.cases:  # pragma: no cover - needs a GPU
        record(name, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
