"""The CUDA target's allocations, traced on this CPU host, against the allocator histories an H200 recorded.

``benchmarks/gpu_snapshot.py`` recorded ``torch.cuda.memory._record_memory_history`` for zoo cases of
``benchmarks/gpu_validation.py`` on an H200 (torch 2.11, 2026-11-29); the snapshots are kept in
``benchmarks/results/snapshots``. Planned here for an H200, the same cases must make every block of 2 MiB or more the
device made, as many times: the operators' outputs, the reductions' staging buffers, the memory-efficient attention's
backward workspace and softmax's backward product.
"""

from __future__ import annotations

import gzip
import pathlib
import pickle
import sys
from collections import Counter

import pytest

pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / "benchmarks" / "results" / "snapshots"


def _recorded(name: str) -> Counter:
    with gzip.open(SNAPSHOTS / f"{name}.pickle.gz", "rb") as f:
        snapshot = pickle.load(f)
    return Counter(-(-e["size"] // 512) * 512 for e in snapshot["device_traces"][0]
                   if e["action"] == "alloc" and e["size"] >= 2**21)


def _planned(case_name: str) -> Counter:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_validation as gv
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    case = next(c for c in gv.ZOO if c.name == case_name)
    est = gv._plan(case, "H200")
    return Counter(e.nbytes for e in est.events if e.nbytes >= 2**21)


@pytest.mark.parametrize("case, snapshot", [("GPT-2 fp32 AdamW", "GPT_2_fp32_AdamW"),
                                            ("BERT eager 16-mixed GradScaler", "BERT_eager_16_mixed_GradScaler")])
def test_every_large_block_the_device_made_is_planned(case, snapshot):
    assert _planned(case) == _recorded(snapshot)
