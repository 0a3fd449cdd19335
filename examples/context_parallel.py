"""Plan each rank of a context-parallel job (ring attention over long sequences), alone and inside FSDP2, before the
job exists, and see what each rank holds of one long sequence.

Runs on CPU in about twenty seconds: python examples/context_parallel.py (benchmarks/context_parallel.py measures
such runs on real gloo processes against their predictions).
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import preflight
from preflight.parallel import CPPlan

BATCH, SEQ = 1, 1024
# A small Llama built from its config (random weights, nothing downloaded), attending through SDPA, which torch's
# ring replaces under context parallelism.
CONFIG = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, vocab_size=8192, max_position_embeddings=SEQ, attn_implementation="sdpa")

torch.manual_seed(0)
model = LlamaForCausalLM(CONFIG)
ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
# No attention mask: torch's ring attends causally. The labels are a tensor of their own, sharded with the inputs.
batch = {"input_ids": ids, "labels": ids.clone()}
optimizer = torch.optim.AdamW(model.parameters())

single = preflight.estimate(model, optimizer, batch)
plans = {
    "one ring of 2 ranks": preflight.ParallelPlan(2, None, cp=CPPlan(2)),
    "one ring of 4 ranks, keys and values passed by all-to-all": preflight.ParallelPlan(4, None,
                                                                                      cp=CPPlan(4, "alltoall")),
    "rings of 2 inside FSDP2 over 4 ranks (torchtitan's dp_shard_cp)": preflight.ParallelPlan(4, "fsdp2",
                                                                                             cp=CPPlan(2)),
}
print(f"one device: {preflight.format_bytes(single.peak_bytes)} "
      f"(activations {preflight.format_bytes(single.breakdown['activations'])})")
for name, plan in plans.items():
    est = preflight.estimate(model, optimizer, batch, preflight.Run(parallel=plan))
    ranks = ", ".join(preflight.format_bytes(b) for b in est.per_rank_peak_bytes)
    print(f"{name}: per rank {ranks} (activations {preflight.format_bytes(est.breakdown['activations'])}, "
          f"parameters {preflight.format_bytes(est.breakdown['parameters'])})")
