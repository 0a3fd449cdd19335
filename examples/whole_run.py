"""Plan the whole run, not one step: the model's loading and the checkpoint save as phases of their own, per rank
under FSDP2, and the reserved memory an epoch of varying lengths reaches on a GPU.

Runs on CPU in about a minute and a half: python examples/whole_run.py (benchmarks/phases.py measures such saves
and replays against real runs).
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import preflight
from preflight import Checkpoint, Loading, ParallelPlan, Run, Target

GPU, RANKS = "A100-40GB", 8
# A small Llama built from its config (random weights, nothing downloaded), and a dataset of varying lengths.
CONFIG = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=4, vocab_size=8192, pad_token_id=0)
torch.manual_seed(0)
model = LlamaForCausalLM(CONFIG)
optimizer = torch.optim.AdamW(model.parameters())
samples = [torch.randint(1, CONFIG.vocab_size, (int(n),)) for n in torch.randint(8, 256, (64,))]


def collate(rows):
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": ids.masked_fill(ids == 0, -100)}


loader = torch.utils.data.DataLoader(samples, batch_size=4, shuffle=True, collate_fn=collate)
worst, _ = preflight.worst_case_batch(loader)  # the longest samples, collated

# 1. The loading: the whole model on each rank's device before FSDP2 shards it, or each rank's shards alone.
for placement in ("device", "meta"):
    run = Run(target=Target(gpu=GPU), parallel=ParallelPlan(RANKS, "fsdp2"), loading=Loading(placement))
    loading = preflight.estimate(model, optimizer, worst, run).phase("loading")
    print(f"loading ({placement}): {loading.peak_bytes:,} B ({preflight.format_bytes(loading.peak_bytes)}) per rank "
          "at its peak")

# 2. The checkpoint save: a full state dict gathered on the device of every rank, then as the trainers save it.
for what, checkpoint in (("kept on every rank's device", Checkpoint(offload_to_cpu=False, rank0_only=False)),
                         ("gathered to rank 0's host memory", Checkpoint())):
    run = Run(target=Target(gpu=GPU), parallel=ParallelPlan(RANKS, "fsdp2"), checkpoint=checkpoint)
    est = preflight.estimate(model, optimizer, worst, run)
    saving = est.phase("saving")
    print(f"full state dict {what}: training peak {preflight.format_bytes(est.peak_bytes)} per rank; the save "
          f"peaks at {preflight.format_bytes(saving.peak_bytes)} on rank {saving.peak_rank}, "
          f"{preflight.format_bytes(min(saving.per_rank_peak_bytes))} on the others")

# 3. Eight steps over batches drawn from the dataset, replayed through the CUDA caching allocator.
batches = preflight.sample_batches(loader, 8)
series = preflight.estimate_steps(model, optimizer, batches, Run(target=Target(gpu=GPU)))
one = preflight.estimate(model, optimizer, worst, Run(target=Target(gpu=GPU)))
print(series)
print(f"the worst-case batch's two steps alone reserve {preflight.format_bytes(one.peak_reserved_bytes)}")
