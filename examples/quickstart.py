"""Predict the training peak of a small GPT-2 before running it, then measure the real peak.

Runs on CPU in a few seconds: python examples/quickstart.py
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import preflight

BATCH_SIZE = 8  # sequences per step
SEQ_LEN = 256  # tokens per sequence
# A small GPT-2 built from its config (random weights, nothing downloaded).
CONFIG = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=SEQ_LEN,
                    bos_token_id=0, eos_token_id=0)

torch.manual_seed(0)
model = GPT2LMHeadModel(CONFIG)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
ids = torch.randint(0, CONFIG.vocab_size, (BATCH_SIZE, SEQ_LEN))
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

est = preflight.estimate(model, optimizer, batch)  # fake tensors: no memory, no change to the model
print(est)

measured = preflight.measure(model, optimizer, batch)  # two real training steps (this trains the model)
error = (est.peak_bytes - measured.peak_bytes) / measured.peak_bytes
print(f"\nmeasured peak: {preflight.format_bytes(measured.peak_bytes)}; prediction error {error:+.3%}")
