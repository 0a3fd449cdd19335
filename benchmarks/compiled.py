"""torch.compile'd models: preflight's prediction against the measured peak of real compiled runs, beside eager.

    python benchmarks/compiled.py            # prints a markdown table (CPU, inductor; a few minutes)

For each model: the measured peak of two real training steps eager and compiled with inductor
(`preflight.measure`: profiler allocator events on CPU), and `preflight.estimate` of the same model eager and
compiled. Each real run is warmed up first (one forward and backward, gradients dropped) so Dynamo and inductor
compile outside the measured window, as in a long training run. Models are built from configs (random weights,
nothing downloaded); the optimizer is SGD without momentum, so the peaks are weights, gradients and the step's
activations and temporaries: the part compilation changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import preflight

VOCAB = 1000


class PointwiseChain(nn.Module):
    """A linear layer and a chain of pointwise operators: eager saves every intermediate, inductor recomputes."""

    def __init__(self, width: int = 512, depth: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.depth = depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        for _ in range(self.depth):
            y = torch.sin(y) * 1.5 + 0.1
        return y.square().mean()


class GeluMlp(nn.Module):
    """Four Linear-GELU-LayerNorm blocks, a common compiled pattern."""

    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
                                      for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).square().mean()


def gpt2(use_cache: bool = True) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=256, bos_token_id=0,
                     eos_token_id=0, use_cache=use_cache, loss_type="ForCausalLM")
    return GPT2LMHeadModel(cfg)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0, use_cache=False)
    return LlamaForCausalLM(cfg)


def lm_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (4, 128), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def scalar_step(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(batch)


CASES: list[tuple[str, Callable[[], nn.Module], Callable[[], Any], Any]] = [
    ("pointwise chain (512x512, 8 sin-mul-add)", PointwiseChain, lambda: torch.randn(1024, 512), scalar_step),
    ("GELU MLP (4 x Linear-GELU-LayerNorm, 512)", GeluMlp, lambda: torch.randn(1024, 512), scalar_step),
    ("GPT-2 (2 layers, 256 wide, 4x128 tokens, use_cache=False)", lambda: gpt2(use_cache=False), lm_batch, None),
    ("Llama (2 layers, 256 wide, 4x128 tokens, use_cache=False)", llama, lm_batch, None),
    # The output holds a DynamicCache, which is not a pytree of tensors: AOTAutograd cannot capture it on its own.
    ("GPT-2 as above, use_cache=True", gpt2, lm_batch, None),
]


def build(make: Callable[[], nn.Module], compiled: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = make()
    if compiled:
        model = torch.compile(model)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def measured(make: Callable[[], nn.Module], batch: Any, step: Any, compiled: bool) -> int:
    model, optimizer = build(make, compiled)
    run = step or (lambda m, b: m(**b).loss)
    run(model, batch).backward()  # warm-up: compile outside the measured window
    model.zero_grad(set_to_none=True)
    return preflight.measure(model, optimizer, batch, step=step).peak_bytes


def predicted(make: Callable[[], nn.Module], batch: Any, step: Any, compiled: bool) -> preflight.Estimate:
    model, optimizer = build(make, compiled)
    return preflight.estimate(model, optimizer, batch, step=step)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    print(f"torch {torch.__version__}, CPU, inductor\n")
    print("| model | eager measured MiB | eager predicted | compiled measured MiB | compiled predicted | error "
          "| eager figure vs compiled run |")
    print("|---|---|---|---|---|---|---|")
    for name, make, make_batch, step in CASES:
        batch = make_batch()
        start = time.perf_counter()
        eager_m = measured(make, batch, step, compiled=False)
        eager_p = predicted(make, batch, step, compiled=False).peak_bytes
        comp_m = measured(make, batch, step, compiled=True)
        est = predicted(make, batch, step, compiled=True)
        comp_p = est.peak_bytes
        partitioned = any("inductor's partitioner" in n for n in est.coverage.notes)
        print(f"| {name} | {mib(eager_m)} | {mib(eager_p)} ({(eager_p - eager_m) / eager_m:+.1%}) | {mib(comp_m)} | "
              f"{mib(comp_p)}{'' if partitioned else ' (eager trace)'} | {(comp_p - comp_m) / comp_m:+.1%} | "
              f"{(eager_p - comp_m) / comp_m:+.1%} |", flush=True)
        _ = time.perf_counter() - start


if __name__ == "__main__":
    main()
