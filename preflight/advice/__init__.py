"""What to change when a run does not fit: each option is the run's description changed (`Suggestion.run`), plus
what to change in the model, optimizer or batch (`Suggestion.change`), with the peak traced from that set-up.
`_options` holds the single changes (a smaller micro-batch with accumulation, checkpointing, the optimizer step's
implementation, 8-bit optimizer state, LoRA, bf16, ZeRO-Offload, the stronger sharding of a plan, an allocator
setting); `_combine` searches combinations of them when no single change is enough, or when cheaper changes
together fit where a single costly one would; `_evaluation` keeps fewer of the evaluation loop's predictions on the
device where the evaluation is over, or evaluates in smaller batches, and counts the evaluation in each training change's figure. They trace copies or switched-back states, never the user's objects
for good; imports go to `estimate`, `autotune` and `trace`, nothing here is imported by them.
"""

from preflight.advice._evaluation import fewer_kept_batches, moving_every_batch, smaller_eval_batch, with_evaluation
from preflight.advice._options import Suggestion, advise, batch_size_of, ranking, repeated_blocks, resize_batch

__all__ = ["Suggestion", "advise", "batch_size_of", "fewer_kept_batches", "moving_every_batch", "ranking",
           "repeated_blocks", "resize_batch", "smaller_eval_batch", "with_evaluation"]
