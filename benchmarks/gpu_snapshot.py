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
``--plan FILE...`` plans each saved snapshot's case on this machine (any machine: traced on the CPU for the GPU
that recorded it) and sets its peaks and allocation sizes beside the recording's.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import sys
import time
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


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def _load(path: str) -> dict[str, Any]:
    import gzip

    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        return pickle.load(f)


def compare_plan(path: str, gpu: str = "H200") -> tuple[str, list[str]]:
    """Plan a recorded zoo case on this machine (traced on the CPU for ``gpu``) and set it beside the recording: the
    peak of live bytes (512-byte blocks) against the plan's ``peak_bytes``, the reserved peaks, and every allocation
    size of 1 MiB or more whose count differs. Returns a table row and those lines.

    The recording holds what happened after it started: a cuBLAS workspace made by an earlier case of the same
    process (the handles outlive ``empty_cache``) is not in it. Those are counted (32 MiB blocks the recording
    never frees, against the plan's two) and added to the recorded reserved peak in its own column."""
    snapshot = _load(path)
    name = next((c.name for c in gv.ZOO if _slug(c.name) == os.path.basename(path).split(".")[0]), None)
    if name is None:
        raise SystemExit(f"{path}: no zoo case of gpu_validation.py has this name")
    case = next(c for c in gv.ZOO if c.name == name)
    t0 = time.perf_counter()
    est = gv._plan(case, gpu)
    seconds = time.perf_counter() - t0
    recorded_peak = _rounded_peak(snapshot)
    reserved = replay(snapshot)["recorded_reserved"]
    workspace = gv.get_gpu(gpu).cublas_workspace_bytes
    live: dict[int, int] = {}
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    recorded_workspaces = sum(1 for size in live.values() if size == workspace)
    missing = max(0, 2 - recorded_workspaces) * workspace
    planned = Counter(-(-e.nbytes // 512) * 512 for e in est.events if e.nbytes >= MiB)
    recorded = Counter(-(-e["size"] // 512) * 512 for e in snapshot["device_traces"][0]
                       if e["action"] == "alloc" and e["size"] >= MiB)
    differ = [f"  {size:>13,} B: planned {planned[size]}, recorded {recorded[size]}"
              for size in sorted(set(planned) | set(recorded), reverse=True) if planned[size] != recorded[size]]
    p, r = est.peak_bytes, est.peak_reserved_bytes or 0
    row = (f"| {name} | {recorded_peak / MiB:,.1f} | {reserved / MiB:,.1f} | {missing / MiB:,.0f} | "
           f"{p / MiB:,.1f} | {(p - recorded_peak - missing) / (recorded_peak + missing):+.1%} | {r / MiB:,.1f} | "
           f"{(r - reserved - missing) / (reserved + missing):+.1%} | {len(differ)} | {seconds:.1f} |")
    return row, differ


def _rounded_peak(snapshot: dict[str, Any], device: int = 0) -> int:
    """The peak of the recorded trace's live bytes, each allocation rounded up to the allocator's 512-byte blocks (as
    the plan's ``peak_bytes`` counts them)."""
    live: dict[int, int] = {}
    current = peak = 0
    for e in snapshot["device_traces"][device]:
        if e["action"] == "alloc":
            live[e["addr"]] = -(-e["size"] // 512) * 512
            current += live[e["addr"]]
            peak = max(peak, current)
        elif e["action"] == "free_completed" and e["addr"] in live:
            current -= live.pop(e["addr"])
    return peak


PLAN_HEAD = ("| recorded case | recorded peak MiB | recorded reserved MiB | workspaces made before the recording MiB | "
             "planned peak MiB | error (with them) | planned reserved MiB | error (with them) | sizes differing | "
             "plan s |")


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
    path = os.path.join(out, _slug(name) + ".pickle")
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
    parser.add_argument("--plan", nargs="+", metavar="FILE",
                        help="plan each saved snapshot's case on this machine and compare with the recording")
    parser.add_argument("--gpu", default="H200", help="the GPU the snapshots were recorded on (for --plan)")
    args = parser.parse_args(argv)
    if args.plan:
        print(f"Command: `python benchmarks/gpu_snapshot.py --plan {' '.join(args.plan)}` (torch "
              f"{torch.__version__}, planned on this machine for {args.gpu})\n")
        print(PLAN_HEAD)
        print("|" + "---|" * PLAN_HEAD.count(" |"))
        details = []
        for path in args.plan:
            row, differ = compare_plan(path, args.gpu)
            print(row, flush=True)
            details.append((row.split(" | ")[0].strip("| "), differ))
        for name, differ in details:
            if differ:
                print(f"\n{name}: allocation sizes of 1 MiB or more whose counts differ")
                print("\n".join(differ))
        return 0
    if args.read or args.replay:
        snapshot = _load(args.read or args.replay)
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
