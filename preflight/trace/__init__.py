"""The trace engine: the user's real training step run on fake tensors, every storage allocation and free recorded.

`trace_steps` (and `FakeRun`, the fake world one trace runs in) swap the model's parameters, buffers and batch
for fake twins (`_twin`), run the user's code under a `FakeTensorMode` with a `StorageTracker` dispatch mode on
top (`_tracker`), which records allocation events and answers data-dependent questions from value shadows, with
stated assumptions where no value exists (mixture-of-experts routing: `_routing`; random branches), kernels
whose fake implementations disagree with the real ones (`_fake_kernels`, `_layouts`; packed sequences, whose sizes
follow the lengths' values: `_packed`; sparse gradients, whose entries follow the ids': `_sparse`), backward formulas that write in place in the plain run (`_in_place`) and
libraries' real-run code paths (`_compat`). Afterwards the model is put back exactly (`_restore`), the process around it too (`_process`:
random streams, global hooks and flags) and whatever the user's code kept of the
trace is repaired (`_leftovers`). An exception of the user's own code is re-raised, not reported as a limit of
the trace (`_blame`). `trace_composed` gives a deep stack's trace composed from traces of its first blocks
(`_stack` finds the stack, `_compose` composes). Nothing here knows about estimates, budgets or trainers:
`preflight._estimate` and `preflight._eval` turn a `TraceResult` into a prediction.
"""

from preflight.trace._blame import blamed_on_user, is_user_error, mark_user_error
from preflight.trace._compose import trace_composed
from preflight.trace._leftovers import Sweep, fake_region, swept
from preflight.trace._process import isolated_process, isolated_rng
from preflight.trace._restore import NotRestoredError, restored_module
from preflight.trace._routing import ROUTINGS, check_routing
from preflight.trace._run import FakeRun, TensorSpec, TraceResult, trace_steps
from preflight.trace._step_checks import device_mismatch
from preflight.trace._twin import float_dtype_for, gradients_held_by

__all__ = [
    "ROUTINGS",
    "FakeRun",
    "NotRestoredError",
    "Sweep",
    "TensorSpec",
    "TraceResult",
    "blamed_on_user",
    "check_routing",
    "device_mismatch",
    "fake_region",
    "float_dtype_for",
    "gradients_held_by",
    "is_user_error",
    "isolated_process",
    "isolated_rng",
    "mark_user_error",
    "restored_module",
    "swept",
    "trace_composed",
    "trace_steps",
]
