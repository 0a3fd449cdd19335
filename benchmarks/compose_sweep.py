"""Composed traces (`estimate(..., fast=True)`) against full traces on the architecture sweep's models, byte for byte.

Each architecture of `benchmarks/architectures.py` is rebuilt from its own config with every layer count of 1 to
4 (``num_hidden_layers``, ``n_layer``, ``encoder_layers``, ...; sub-configs included; ``layer_types`` patterns
repeated) set to 12, so that its stack is deep enough to compose (`preflight.trace._compose.MIN_PERIODS`).
Then `estimate` runs twice on the same model, optimizer and batch: ``fast=True`` and the full trace. A case is

    composed   the composed prediction was used; it must equal the full one (peak, breakdown, reserved peak,
               phase of the peak, events)
    full       ``fast=True`` traced in full, with the reason in its coverage notes (no repeated stack found,
               shallow traces that did not compose, kernel scratch to calibrate)
    error      the deepened model could not be built or traced (the note says why)

Variants: ``fp32`` on the CPU target, ``bf16-mixed`` planned for an H100 (`gpu="H100-80GB"`: CUDA autocast and
the allocator; on the CPU target a bf16 matmul's kernel scratch is calibrated per call, which is not composed),
``lora`` (peft, r=8, all-linear) on the CPU target. Each case runs in its own process.

Run: python benchmarks/compose_sweep.py --jobs 2                 (all cases; about an hour on 2 idle cores)
     python benchmarks/compose_sweep.py --only fp32 --jobs 2
     python benchmarks/compose_sweep.py --render          (the table from the cases finished so far)
Cases run with the families interleaved; each finished case is written to the .json at once.
Writes benchmarks/results/compose_sweep.md (and .json) and prints the table.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import architectures as arch  # noqa: E402

DEPTH = 12
RESULTS = os.path.join(os.path.dirname(__file__), "results", "compose_sweep")
DEPTH_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
              "num_decoder_layers", "encoder_num_hidden_layers", "decoder_num_hidden_layers")


def deepen(config: Any, depth: int = DEPTH) -> list[str]:
    """Set ``config``'s layer counts of 1 to 4 (and its sub-configs') to ``depth``, in place; the keys changed."""
    from transformers import PretrainedConfig

    changed = []
    for key in DEPTH_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4:
            old = value
            setattr(config, key, depth)
            changed.append(key)
            types = getattr(config, "layer_types", None)
            if isinstance(types, list) and len(types) == old:
                config.layer_types = [types[i % len(types)] for i in range(depth)]
    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            changed += [f"{key}.{k}" for k in deepen(value, depth)]
    return changed


def run_case(spec: str) -> dict[str, Any]:
    import preflight

    case, variant = arch.find_case(spec)
    row: dict[str, Any] = {"case": spec, "name": case.name, "family": case.family, "variant": variant}
    torch.manual_seed(0)
    model, batch, step = case.build()
    config = model.config
    row["deepened"] = deepen(config)
    if not row["deepened"]:
        row["error"] = "no layer count of 1 to 4 in the config"
        return row
    torch.manual_seed(0)
    model = type(model)(config)
    run = preflight.Run()
    if variant == "bf16-mixed":
        run = preflight.Run(precision="bf16-mixed", target=preflight.Target(gpu="H100-80GB"))
    elif variant == "lora":
        model, _ = arch.apply_variant(model, "lora")
    optimizer = arch.adamw(model)
    row["params"] = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    fast = preflight.estimate(model, optimizer, batch, run.replace(fast=True), step=step)
    row["fast_s"] = time.perf_counter() - start
    start = time.perf_counter()
    full = preflight.estimate(model, optimizer, batch, run.replace(fast=False), step=step)
    row["full_s"] = time.perf_counter() - start
    note = next((n for n in fast.coverage.notes if n.startswith(("depth-independent", "traced in full (fast=True)"))),
                "")
    row["composed"] = note.startswith("depth-independent")
    row["note"] = note
    row["lower_bound"] = full.coverage.lower_bound
    row["peak"], row["full_peak"] = fast.peak_bytes, full.peak_bytes
    row["same"] = (fast.peak_bytes == full.peak_bytes and fast.breakdown == full.breakdown
                   and fast.peak_reserved_bytes == full.peak_reserved_bytes and fast.peak_phase == full.peak_phase
                   and _canonical(fast) == _canonical(full))
    return row


def _canonical(est: Any) -> list[tuple]:
    """Events with uids replaced by the position of their allocation; an event without a category (measured
    kernel scratch in a full trace) is a temporary, as the breakdown counts it."""
    from preflight._result import Category

    where, out = {}, []
    for i, e in enumerate(est.events):
        if e.nbytes >= 0:
            where[e.uid] = i
        out.append((e.nbytes, e.op, e.phase, est.categories.get(e.uid, Category.TEMPORARIES),
                    where.get(e.uid) if e.nbytes < 0 else -1))
    return out


def spawn(spec: str, timeout: float) -> dict[str, Any]:
    case, variant = arch.find_case(spec)
    base = {"case": spec, "name": case.name, "family": case.family, "variant": variant}
    try:
        proc = subprocess.run([sys.executable, __file__, "--case", spec], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return {**base, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {**base, "error": f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:200]}"}
    return json.loads(lines[-1])


def status(row: dict[str, Any]) -> str:
    if row.get("error"):
        return "error"
    if not row["composed"]:
        return "full"
    return "composed, equal" if row["same"] else "composed, DIFFERENT"


def render(rows: list[dict[str, Any]], command: str) -> str:
    import transformers

    reasons = collections.Counter(_reason(r) for r in rows if status(r) == "full")
    lines = [f"Command: `{command}` (torch {torch.__version__}, transformers {transformers.__version__}; "
             f"layer counts set to {DEPTH})", "",
             "| variant | cases | composed, equal to the full trace | composed, different | traced in full (labelled) "
             "| error |", "|---|---|---|---|---|---|"]
    for variant in (*arch.VARIANTS, "all"):
        sel = [r for r in rows if variant in ("all", r["variant"])]
        if not sel:
            continue
        c = collections.Counter(status(r) for r in sel)
        lines.append(f"| {variant} | {len(sel)} | {c['composed, equal']} | {c['composed, DIFFERENT']} | {c['full']} | "
                     f"{c['error']} |")
    lines += ["", "Why `fast=True` traced in full (count):", ""]
    lines += [f"- {n} x {reason}" for reason, n in reasons.most_common()]
    lines += ["", "| family | architecture | variant | status | fast s | full s | note |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (arch.FAMILIES.index(r["family"]), r["name"], r["variant"])):
        t = (lambda k: f"{r[k]:.1f}" if r.get(k) is not None else "")
        note = (r.get("error") or ("" if r.get("composed") else _reason(r))).replace("|", "\\|")[:150]
        lines.append(f"| {r['family']} | {r['name']} | {r['variant']} | {status(r)} | {t('fast_s')} | {t('full_s')} | "
                     f"{note} |")
    return "\n".join(lines) + "\n"


def _reason(row: dict[str, Any]) -> str:
    note = row.get("note") or ""
    for head in ("traced in full (fast=True): ",):
        note = note.removeprefix(head)
    if "did not compose: " in note:
        return "shallow traces did not compose: " + note.split("did not compose: ", 1)[1]
    return note


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--only", default="", help="as for benchmarks/architectures.py")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--case", help="run one NAME:VARIANT in this process and print its JSON row")
    parser.add_argument("--render", action="store_true", help="write the table from the rows written so far")
    parser.add_argument("--update", default="", metavar="ONLY",
                        help="run the cases ONLY selects (as --only), replace or add their rows, write the table")
    parser.add_argument("--remaining", action="store_true",
                        help="with --only: run the selected cases that have no row yet, add them, write the table")
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    if args.case:
        try:
            row = run_case(args.case)
        except Exception as err:  # noqa: BLE001 - reported as a row
            case, variant = arch.find_case(args.case)
            row = {"case": args.case, "name": case.name, "family": case.family, "variant": variant,
                   "error": f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"}
            traceback.print_exc()
        print(json.dumps(row, default=str), flush=True)
        return 0
    command = "python benchmarks/compose_sweep.py " + " ".join(sys.argv[1:])
    if args.remaining:
        with open(RESULTS + ".json") as f:
            done = {r["case"] for r in json.load(f)}
        args.update = ",".join(spec for spec in arch.selected(args.only) if spec not in done)
        if not args.update:
            args.render = True
    if args.render or args.update:  # the rows written so far (a run stopped early), some of them rerun
        with open(RESULTS + ".json") as f:
            rows = json.load(f)
        if args.update:
            specs = arch.selected(args.update)
            with ThreadPoolExecutor(args.jobs) as pool:  # each finished case is written at once
                for i, row in enumerate(pool.map(lambda s: spawn(s, args.timeout), specs), 1):
                    print(f"[{i}/{len(specs)}] {row['case']}: {status(row)}", file=sys.stderr, flush=True)
                    at = next((n for n, r in enumerate(rows) if r["case"] == row["case"]), None)
                    if at is None:
                        rows.append(row)
                    else:
                        rows[at] = row
                    with open(RESULTS + ".json", "w") as f:
                        json.dump(rows, f, indent=1, default=str)
        text = render(rows, f"{command} ({len(rows)} cases)")
        print(text)
        with open(RESULTS + ".md", "w") as f:
            f.write(text)
        return 0
    # Families interleaved, so that a run stopped early (`--render`) has covered every family.
    by_family = [[s for s in arch.selected(args.only) if arch.find_case(s)[0].family == f] for f in arch.FAMILIES]
    specs = [s for group in itertools.zip_longest(*by_family) for s in group if s is not None]
    rows = []
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        for i, row in enumerate(pool.map(lambda s: spawn(s, args.timeout), specs), 1):
            rows.append(row)
            print(f"[{i}/{len(specs)}] {row['case']}: {status(row)} {row.get('error') or _reason(row)[:100]}",
                  file=sys.stderr, flush=True)
            with open(RESULTS + ".json", "w") as f:
                json.dump(rows, f, indent=1, default=str)
    text = render(rows, command)
    print(text)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS + ".md", "w") as f:
        f.write(text)
    with open(RESULTS + ".json", "w") as f:
        json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
