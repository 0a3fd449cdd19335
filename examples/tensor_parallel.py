"""Plan each rank of a tensor-parallel job, and of tensor parallelism inside FSDP2, beside pipeline stages and
beside a context-parallel ring, before the job exists.

Runs on CPU in about fifteen seconds: python examples/tensor_parallel.py (benchmarks/tensor_parallel.py measures such
runs on real gloo processes against their predictions).
"""

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import LlamaConfig, LlamaForCausalLM

import preflight
from preflight.parallel import CPPlan, PPPlan, TPPlan, causal_lm_loss, split_transformers

BATCH, SEQ = 4, 128
# A small Llama built from its config (random weights, nothing downloaded).
CONFIG = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, vocab_size=8192, attn_implementation="sdpa")
# The plan you would pass to parallelize_module: attention and MLP cut column-wise in, row-wise out.
LAYER = "model.layers.*."
STYLES = {**{f"{LAYER}self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
          **{f"{LAYER}mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
          f"{LAYER}self_attn.o_proj": RowwiseParallel(), f"{LAYER}mlp.down_proj": RowwiseParallel()}

torch.manual_seed(0)
model = LlamaForCausalLM(CONFIG)
ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
batch = {"input_ids": ids, "labels": ids}
optimizer = torch.optim.AdamW(model.parameters())

single = preflight.estimate(model, optimizer, batch)
# A pipeline's batch is (inputs, target); its stages here are cut as transformers' own pipeline parallelism cuts
# them, and each stage is laid out by the tensor-parallel plan (torchtitan's 2-D and 3-D meshes).
pipeline = PPPlan(2, causal_lm_loss, microbatches=2, split=split_transformers)
plans = {
    "tensor parallel over 2 ranks": (preflight.ParallelPlan(2, None, tp=TPPlan(2, STYLES)), batch),
    "the model's own transformers plan over 2 ranks": (preflight.ParallelPlan(2, None, tp=TPPlan(2)), batch),
    "tensor parallel 2 x FSDP2 2 (4 ranks)": (preflight.ParallelPlan(4, "fsdp2", tp=TPPlan(2, STYLES)), batch),
    "pipeline 2 x tensor parallel 2 (4 ranks)": (preflight.ParallelPlan(4, None, pp=pipeline, tp=TPPlan(2, STYLES)),
                                                 (ids, ids)),
    "context parallel 2 x tensor parallel 2 (4 ranks)": (preflight.ParallelPlan(4, None, cp=CPPlan(2),
                                                                                tp=TPPlan(2, STYLES)), batch),
}
print(f"one device: {preflight.format_bytes(single.peak_bytes)}")
for name, (plan, planned) in plans.items():
    est = preflight.estimate(model, optimizer, planned, preflight.Run(parallel=plan))
    ranks = ", ".join(preflight.format_bytes(b) for b in est.per_rank_peak_bytes)
    print(f"{name}: per rank {ranks} (parameters {preflight.format_bytes(est.breakdown['parameters'])})")
