"""preflight.estimate against the measured peak for models built from torch.nn's own layers, over optimizers and loops.

The architecture sweep (`benchmarks/architectures.py`) covers transformers' models; this one covers what a user
writes with torch.nn alone: an MLP, a CNN (BatchNorm, GroupNorm, pooling), recurrent taggers (``nn.LSTM``, oneDNN's
kernel on CPU, and ``nn.GRU``, bidirectional, 2 layers; both again over packed sequences of unsorted lengths,
``pack_padded_sequence`` in and ``pad_packed_sequence`` out), a language-model head whose loss gathers the chosen
tokens' log-probabilities or is a multi-label ``BCEWithLogitsLoss`` over the vocabulary, a ``TransformerEncoder``
(pre-norm, batch-first) and a batch-first ``nn.MultiheadAttention`` block. Each is trained with six optimizers (SGD with Nesterov momentum, AdamW
as the CPU runs it, AdamW foreach and fused, RMSprop centred with momentum, Adafactor) under four loops (plain,
gradient clipping at 1.0, two micro-batches accumulated, bf16-mixed). Predicted: `preflight.estimate`; measured:
`preflight.measure` (two real CPU steps, the profiler's allocator events) on a fresh model and optimizer from the
same seed.

Run: python benchmarks/torch_modules.py          (240 cases, about 10 minutes on 2 CPU cores)
Writes benchmarks/results/torch_modules.md and prints the same table.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import preflight
from preflight import Loop, Run

RESULTS = os.path.join(os.path.dirname(__file__), "results", "torch_modules.md")
VOCAB = 100


class MLP(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(256, 512), nn.GELU(), nn.LayerNorm(512), nn.Linear(512, 10))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3), nn.GroupNorm(4, 32), nn.SiLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Tagger(nn.Module):
    def __init__(self, kind: type[nn.RNNBase]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.rnn = kind(64, 128, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(256, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])


class PackedTagger(Tagger):
    """The tagger over a packed batch: ``pack_padded_sequence`` (unsorted lengths) into the RNN, padded back."""

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, lengths = inputs
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(tokens), lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=tokens.size(1))
        return self.head(out)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(self.attn(h, h, h, need_weights=False)[0])


class TokenScores(nn.Module):
    """A language-model head over a 4,096-token vocabulary: the log-probability of each chosen token (``gather``, as
    preference and policy-gradient losses take it) or a multi-label ``BCEWithLogitsLoss`` over the vocabulary."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.loss = loss
        self.embed = nn.Embedding(VOCAB, 64)
        self.head = nn.Linear(64, 4096)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def _token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return -logits.float().log_softmax(-1).gather(-1, labels[..., None]).mean()


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (4, 32)), torch.randint(0, VOCAB, (4, 32))


def _lengths() -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    tokens, labels = _tokens()
    return (tokens, torch.tensor([32, 9, 21, 5])), labels


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any]]] = {
    "MLP": (MLP, lambda: (torch.randn(64, 256), torch.randint(0, 10, (64,)))),
    "CNN (BatchNorm, GroupNorm)": (CNN, _images),
    "LSTM tagger (2 layers, bidirectional)": (lambda: Tagger(nn.LSTM), _tokens),
    "GRU tagger (2 layers, bidirectional)": (lambda: Tagger(nn.GRU), _tokens),
    "LSTM tagger, packed sequences": (lambda: PackedTagger(nn.LSTM), _lengths),
    "GRU tagger, packed sequences": (lambda: PackedTagger(nn.GRU), _lengths),
    "Token log-probs (gather over a 4,096 vocabulary)": (lambda: TokenScores("gather"), _tokens),
    "Multi-label BCEWithLogits (4,096 labels)": (lambda: TokenScores("bce"), _tokens),
    "TransformerEncoder (pre-norm, batch-first)": (Encoder, _tokens),
    "MultiheadAttention (batch-first)": (Attention, _tokens),
}
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "SGD nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "AdamW": lambda p: torch.optim.AdamW(p),
    "AdamW foreach": lambda p: torch.optim.AdamW(p, foreach=True),
    "AdamW fused": lambda p: torch.optim.AdamW(p, fused=True),
    "RMSprop centred": lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True),
    "Adafactor": lambda p: torch.optim.Adafactor(p),
}
LOOPS: dict[str, Run] = {
    "plain": Run(),
    "clip 1.0": Run(loop=Loop(max_grad_norm=1.0)),
    "accumulate 2": Run(loop=Loop(accumulate=2)),
    "bf16-mixed": Run(precision="bf16-mixed"),
}


def _step(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    out = model(inputs)
    if isinstance(model, TokenScores):
        if model.loss == "gather":
            return _token_log_probs(out, labels)
        return nn.functional.binary_cross_entropy_with_logits(out, nn.functional.one_hot(labels, 4096).to(out.dtype))
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1))


def _case(model_name: str, optimizer_name: str, loop_name: str) -> tuple[int, int, float, bool]:
    build, data = MODELS[model_name]
    run = LOOPS[loop_name]
    torch.manual_seed(0)
    batch = data()
    model = build()
    start = time.perf_counter()
    est = preflight.estimate(model, OPTIMIZERS[optimizer_name](model.parameters()), batch, run, step=_step)
    seconds = time.perf_counter() - start
    torch.manual_seed(0)
    data()
    fresh = build()
    measured = preflight.measure(fresh, OPTIMIZERS[optimizer_name](fresh.parameters()), batch, run, step=_step)
    return est.peak_bytes, measured.peak_bytes, seconds, est.coverage.lower_bound


def report_table(cases: Any, header: tuple[str, ...], script: str, path: str) -> None:
    """Print each case as it comes and write the table to ``path``: ``cases`` yields ``(label cells, predicted,
    measured, estimate seconds, lower bound)``; ``header`` names the label columns."""
    rows, errors = [], []
    for cells, predicted, measured, seconds, bound in cases:
        error = (predicted - measured) / measured * 100
        errors.append((abs(error), bound, ", ".join(cells), error))
        rows.append("| " + " | ".join(cells) + f" | {measured:,} | {predicted:,} | {error:+.3f}% | "
                    f"{'lower bound' if bound else 'traced'} | {seconds:.2f} |")
        print(rows[-1], flush=True)
    exact = sum(1 for e in errors if e[0] == 0 and not e[1])
    within = sum(1 for e in errors if e[0] <= 0.5 and not e[1])
    worst = max(errors)
    summary = (f"{len(errors)} cases: {exact} predicted to the byte, {within} within 0.5%, "
               f"{sum(1 for e in errors if e[1])} lower bounds; largest error {worst[3]:+.3f}% ({worst[2]})")
    columns = (*header, "measured B", "predicted B", "error", "status", "estimate s")
    table = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)
    text = (f"Command: `python benchmarks/{script}` (torch {torch.__version__}, CPU, 2 cores)\n\n{summary}\n\n"
            + table + "\n" + "\n".join(rows) + "\n")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(summary)


def main() -> None:
    warnings.filterwarnings("ignore")
    cases = (((model_name, optimizer_name, loop_name), *_case(model_name, optimizer_name, loop_name))
             for model_name in MODELS for optimizer_name in OPTIMIZERS for loop_name in LOOPS)
    report_table(cases, ("model", "optimizer", "loop"), "torch_modules.py", RESULTS)


if __name__ == "__main__":
    main()
