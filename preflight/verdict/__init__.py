"""The decision layer behind every door that gives a verdict: the callbacks, `preflight.check` and the dry runs of
``preflight check``. `predict` (``_predict``) turns the run's description and the user's objects into one rank's
training and evaluation peaks, against the budget, as a `preflight.report.Report`; `decide` (``_decide``) agrees on
the verdict across ranks (``_ranks``), writes and prints the report, and raises, warns or ends a dry run with its
exit status; `VerifySession` (``_session``) measures the first real steps and compares each with the prediction
for its own batch; `Options` (``_options``) says what preflight does with a prediction, while how the run trains
is the `preflight.Run`. Trainer-agnostic: ``preflight.integrations`` translate a trainer's objects into these calls.
An exception inside preflight becomes a warning with the reason (`internal_failures`); the user's own errors are
re-raised. See ``_decide``'s docstring for the policies (verdict, overflow, dry run, failures).
"""

from preflight.verdict._decide import REMEDY_MAX_BATCH_SIZE, check, decide
from preflight.verdict._options import ON_OVERFLOW_CHOICES, Options
from preflight.verdict._predict import (ddp_bucket_bytes, eval_resident, held_module_bytes, lower_bound_report,
                                        options_plan, predict, predict_or_lower_bound)
from preflight.verdict._ranks import internal_failures, is_rank_zero
from preflight.verdict._session import VerifySession, training_state

__all__ = ["ON_OVERFLOW_CHOICES", "REMEDY_MAX_BATCH_SIZE", "Options", "VerifySession", "check", "ddp_bucket_bytes",
           "decide", "eval_resident", "held_module_bytes", "internal_failures", "is_rank_zero", "lower_bound_report",
           "options_plan", "predict", "predict_or_lower_bound", "training_state"]
