"""Models whose forward stores what it computes (for tests/test_leftovers.py), and a script that trains them.

``python tests/leftover_models.py [--estimate-first] [--same-model]`` builds each model, optionally runs
`preflight.estimate` on it first, then trains a model (a new one, or with ``--same-model`` the estimated one)
for real and prints one JSON line per model: the losses, whether anything was a FakeTensor, a digest of the
trained weights, and the measured peak. Run in a fresh process each time, so no cache hides anything.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys

import torch
from torch import nn

_TABLES: dict[tuple[int, int], torch.Tensor] = {}  # a module-level dict used as a cache
_POSITIONS = None  # a global rebound on first use


@functools.lru_cache(maxsize=8)
def rotary_table(seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A module-level functools cache returning a tuple of tensors."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(seq).float(), inv)
    return angles.cos(), angles.sin()


def scale_table(seq: int, dim: int) -> torch.Tensor:
    key = (seq, dim)
    if key not in _TABLES:
        _TABLES[key] = torch.linspace(0.5, 1.5, seq).unsqueeze(-1).expand(seq, dim).contiguous()
    return _TABLES[key]


def positions(seq: int) -> torch.Tensor:
    global _POSITIONS
    if _POSITIONS is None or _POSITIONS.shape[0] != seq:
        _POSITIONS = torch.arange(seq)
    return _POSITIONS


class CachingBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mask = None  # a causal mask built on the first forward and kept on self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        if self.mask is None or self.mask.shape[0] != s:
            self.mask = torch.triu(torch.full((s, s), float("-inf")), diagonal=1)
        cos, sin = rotary_table(s, d)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q1, q2 = q.chunk(2, dim=-1)
        q = torch.cat([q1 * cos - q2 * sin, q1 * sin + q2 * cos], dim=-1) * scale_table(s, d)
        att = (q @ k.transpose(-1, -2) / d ** 0.5 + self.mask).softmax(-1)
        return x + self.out(att @ v)


class CachingLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(128, dim)
        self.blocks = nn.ModuleList(CachingBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids) + self.pos(positions(input_ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def make(name: str) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "caching":
        ids = torch.randint(0, 256, (2, 32), generator=gen)
        return CachingLM(), {"input_ids": ids, "labels": ids}
    pixels = {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen)}
    if name == "beit":
        from transformers import BeitConfig, BeitForImageClassification

        cfg = BeitConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                         image_size=32, patch_size=8, use_relative_position_bias=True, num_labels=3)
        return BeitForImageClassification(cfg), {**pixels, "labels": torch.tensor([0, 2])}
    if name == "dinov3":
        from transformers import DINOv3ViTConfig, DINOv3ViTModel

        cfg = DINOv3ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                              image_size=32, patch_size=8, num_register_tokens=2)
        return DINOv3ViTModel(cfg), pixels
    raise ValueError(name)


def step(model: nn.Module, batch: dict) -> torch.Tensor:
    out = model(**batch)
    if isinstance(out, torch.Tensor):
        return out
    return out.loss if getattr(out, "loss", None) is not None else out.last_hidden_state.float().pow(2).mean()


MODELS = ("caching", "beit", "dinov3")


def main(argv: list[str]) -> None:
    import preflight
    from torch._subclasses.fake_tensor import FakeTensor

    for name in MODELS:
        model, batch = make(name)
        notes: list[str] = []
        if "--estimate-first" in argv:
            est = preflight.estimate(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch, step=step)
            notes = list(est.coverage.notes)
            if "--same-model" not in argv:
                model, batch = make(name)
        torch.manual_seed(3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, fake = [], False
        for _ in range(3):
            loss = step(model, batch)
            fake |= isinstance(loss, FakeTensor)
            loss.backward()
            fake |= any(isinstance(p.grad, FakeTensor) for p in model.parameters() if p.grad is not None)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        peak = preflight.measure(model, opt, batch, step=step).peak_bytes
        print(json.dumps({"model": name, "losses": losses, "fake": fake, "digest": digest, "peak": peak,
                          "notes": notes}))


if __name__ == "__main__":
    main(sys.argv[1:])
