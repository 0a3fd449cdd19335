"""Fine-tune a small Llama with LoRA in the Hugging Face Trainer, with preflight attached.

Samples vary in length: preflight predicts the worst-case batch (the longest samples, padded by the Trainer's
collator), while the first steps measured draw random batches: a step holding the longest sample measures the
predicted peak, the others less (see the per-step peaks). Runs on CPU in under a minute:
python examples/hf_trainer_lora.py
"""

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from preflight import Run, Target, format_bytes
from preflight.integrations.hf import attach

BATCH_SIZE = 4  # per-device micro-batch
ACCUMULATION = 2  # gradient accumulation steps
MAX_LEN = 384  # the longest sample in the dataset
BUDGET = "2GiB"  # memory the run may use; on a GPU leave it out to use the device's capacity
# How the run trains, beyond what the trainer says: here only the target. Target(gpu="H100-80GB") plans
# for a GPU you don't have (its memory becomes the budget).
RUN = Run(target=Target(budget=BUDGET))
LORA_RANK = 16
# A small Llama from its config (random weights, nothing downloaded); LoRA trains the adapters only.
CONFIG = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=8000, max_position_embeddings=MAX_LEN, pad_token_id=0)


class Instructions(torch.utils.data.Dataset):
    """Tokenised samples of 32 to MAX_LEN tokens (lists: the collator pads them)."""

    def __len__(self):
        return 128

    def __getitem__(self, i):
        length = MAX_LEN if i == 127 else 32 + (i * 37) % (MAX_LEN // 2)
        ids = torch.randint(1, CONFIG.vocab_size, (length,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids.tolist()}


class Pad:
    """What a tokenizer's collator does, without a tokenizer: pad with 0 and mask the padding out of the loss."""

    def __call__(self, samples):
        n = max(len(s["input_ids"]) for s in samples)
        ids = torch.zeros(len(samples), n, dtype=torch.long)
        for j, s in enumerate(samples):
            ids[j, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
        mask = (ids != 0).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


torch.manual_seed(0)
model = get_peft_model(LlamaForCausalLM(CONFIG), LoraConfig(r=LORA_RANK, target_modules="all-linear",
                                                            task_type="CAUSAL_LM"))
args = TrainingArguments(output_dir="out/hf_trainer_lora", max_steps=4, per_device_train_batch_size=BATCH_SIZE,
                         gradient_accumulation_steps=ACCUMULATION, use_cpu=True, report_to=[], save_strategy="no",
                         logging_strategy="no", disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=Instructions(), data_collator=Pad())
callback = attach(trainer, RUN, report_path="out/hf_trainer_lora.json")
trainer.train()

r = callback.report
print(f"\npredicted worst case {format_bytes(r.predicted_peak_bytes)} for a batch of "
      f"{r.worst_case_batch_shape['input_ids']} tokens ({r.worst_case_batch['note']})")
print(f"measured over the first {r.steps_measured} steps: {format_bytes(r.measured_peak_bytes)} "
      f"(error {r.relative_error:+.2%}; per step {', '.join(format_bytes(p) for p in r.measured_step_peaks)})")
