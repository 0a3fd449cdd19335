"""The trace engine: the user's real training step run on fake tensors, every storage allocation and free recorded.

`trace_steps` (and `FakeRun`, the fake world one trace runs in) swap the model's parameters, buffers and batch
for fake twins (`_twin`), run the user's code under a `FakeTensorMode` with a `StorageTracker` dispatch mode on
top (`_tracker`), which records allocation events and answers data-dependent questions from value shadows, with
stated assumptions where no value exists (mixture-of-experts routing: `_routing`; random branches), kernels
whose fake implementations disagree with the real ones (`_fake_kernels`, `_layouts`) and libraries' real-run code
paths (`_compat`). Afterwards the model is put back exactly (`_restore`) and whatever the user's code kept of the
trace is repaired (`_leftovers`). `trace_composed` gives a deep stack's trace composed from traces of its first
blocks (`_stack` finds the stack, `_compose` composes). Nothing here knows about estimates, budgets or trainers:
`preflight._estimate` and `preflight._eval` turn a `TraceResult` into a prediction.
"""

from preflight.trace._compose import trace_composed
from preflight.trace._leftovers import Sweep, swept
from preflight.trace._restore import NotRestoredError, isolated_rng, restored_module
from preflight.trace._routing import ROUTINGS, check_routing
from preflight.trace._run import FakeRun, TensorSpec, TraceResult, trace_steps
from preflight.trace._twin import float_dtype_for

__all__ = [
    "ROUTINGS",
    "FakeRun",
    "NotRestoredError",
    "Sweep",
    "TensorSpec",
    "TraceResult",
    "check_routing",
    "float_dtype_for",
    "isolated_rng",
    "restored_module",
    "swept",
    "trace_composed",
    "trace_steps",
]
