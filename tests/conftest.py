"""Shared fixtures: tiny models built from configs (random weights, nothing downloaded) and their batches."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

VOCAB = 1000


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    try:
        import transformers
    except ImportError:
        yield
        return
    transformers.logging.set_verbosity_error()
    yield


def predicted_and_measured(build, make_optimizer, batch, run=None, *, step=None):
    """`preflight.estimate` for a model from ``build()`` and the peak `preflight.measure` reads for a fresh one from the
    same seed, each with its own ``make_optimizer(parameters)``: the prediction and what it must match."""
    import preflight

    torch.manual_seed(0)
    model = build()
    est = preflight.estimate(model, make_optimizer(model.parameters()), batch, run, step=step)
    torch.manual_seed(0)
    fresh = build()
    return est, preflight.measure(fresh, make_optimizer(fresh.parameters()), batch, run, step=step).peak_bytes


def sgd(parameters):
    return torch.optim.SGD(parameters, lr=0.1)


def make_gpt2(n_layer: int = 2, n_embd: int = 128, n_positions: int = 256, **kwargs):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=VOCAB, n_positions=n_positions,
                     bos_token_id=0, eos_token_id=0, **kwargs)
    return GPT2LMHeadModel(cfg)


def make_llama(attn: str = "sdpa", **kwargs):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, **kwargs)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg)


def lm_batch(batch_size: int = 4, seq: int = 128, pad: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch_size, seq), generator=gen)
    mask = torch.ones_like(ids)
    if pad:
        mask[0, :pad] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


class DepthwiseBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.BatchNorm2d(c)
        self.pw = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw(torch.relu(self.norm(self.dw(x))))


def make_depthwise_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 64, 4, stride=4), DepthwiseBlock(64), DepthwiseBlock(64),
                         nn.Conv2d(64, 128, 2, stride=2), DepthwiseBlock(128), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(128, 10))


def make_resnet_like() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 64, 7, stride=2, padding=3), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))


def image_batch(batch_size: int = 8, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return torch.randn(batch_size, 3, size, size, generator=gen), torch.randint(0, 10, (batch_size,), generator=gen)


def classify_step(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


class Stack(nn.Module):
    """``depth`` Linear(width, width) blocks in a ModuleList (the default FSDP units) and a Linear(width, 1) head (dim
    0 of 1: under FSDP2 one rank holds it). The default width, 66, is not a multiple of 4 ranks: FSDP2 pads each
    rank's shard of a block to ceil(66 / 4) = 17 rows, FSDP1 a block's flat parameter (4422 elements) to 4424."""

    def __init__(self, depth: int = 3, width: int = 66) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x).sum()


class VariableTokens(torch.utils.data.Dataset):
    """Token sequences as lists; with ``fixed`` all of that length, else varying, with the longest (96) last.
    ``key`` wraps each sample as ``{key: tokens}`` (the HF Trainer drops dataset columns it cannot name)."""

    def __init__(self, n: int = 24, fixed: int | None = None, key: str | None = None) -> None:
        self.n, self.fixed, self.key = n, fixed, key

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        length = self.fixed or (96 if i == self.n - 1 else 12 + (i * 7) % 40)
        tokens = torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(i)).tolist()
        return {self.key: tokens} if self.key else tokens


def pad_tokens(samples: list) -> dict[str, torch.Tensor]:
    """Right-pad token lists (or ``{"input_ids": list}`` samples) with 0; labels ignore the padding."""
    samples = [s["input_ids"] if isinstance(s, dict) else s for s in samples]
    ids = torch.zeros(len(samples), max(len(s) for s in samples), dtype=torch.long)
    for j, s in enumerate(samples):
        ids[j, : len(s)] = torch.tensor(s)
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@contextlib.contextmanager
def gloo_rank(rank: int, world_size: int, port: int, timeout_s: float | None = None) -> Iterator[None]:
    """This process as one rank of a real gloo job on localhost (the real-run tests' spawned workers): one thread,
    since the ranks share the machine's cores; the group is destroyed on the way out. ``timeout_s``: the group's
    timeout (torch's default, 30 minutes, without one), for tests that a rank is never left waiting."""
    import datetime

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", rank=rank, world_size=world_size, **timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_processes(args: list[str], *, timeout: float, **kwargs):
    """``subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)`` for a launch that starts
    processes of its own (torchrun's ranks, Lightning's DDP launcher): past ``timeout`` every process it started is
    killed, not only the launcher (`benchmarks/deepspeed_trainers.py`'s ``run_killing_group``), so a hung rank does
    not hold its port and CPU through the tests that follow."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from deepspeed_trainers import run_killing_group

    return run_killing_group(args, timeout=timeout, **kwargs)


def example_output(name: str, timeout: int = 600, args: tuple[str, ...] = ()) -> str:
    """What ``examples/<name>`` prints, run as a user runs it (its own process, with ``args``); its exit code must
    be 0."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "examples" / name
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def spawned(worker, world: int, *args) -> dict:
    """Run ``worker(rank, world, port, queue, *args)`` in ``world`` fresh processes on a free localhost port; each
    puts ``(rank, result)``: the results by rank."""
    import socket

    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(world, port, queue, *args), nprocs=world, start_method="spawn")
    return dict(queue.get() for _ in range(world))


def only_options(monkeypatch: pytest.MonkeyPatch, *names: str, combination: bool = False) -> None:
    """Let `preflight.advise` trace only the single options named (as in `preflight.advice._options.OPTIONS`), and
    no combination unless asked: for tests whose assertions are about how a plan, a door or the CLI carries
    suggestions, not about every option (`tests/advice/test_options.py` traces each, `tests/advice/test_combine.py`
    the combination search)."""
    from preflight.advice import _options

    known = [name for name, _ in _options.OPTIONS]
    assert set(names) <= set(known), (names, known)
    monkeypatch.setattr(_options, "OPTIONS", tuple(o for o in _options.OPTIONS if o[0] in names))
    if not combination:
        monkeypatch.setattr(_options, "_combination", lambda setup, singles: [])


def spy_all_reduce(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record ``(elements, group size)`` of every ``torch.distributed.all_reduce`` from now on (it still runs)."""
    import torch.distributed as dist

    calls: list[tuple[int, int]] = []
    all_reduce = dist.all_reduce

    def spy(tensor: torch.Tensor, *args, group=None, **kwargs):
        calls.append((tensor.numel(), dist.get_world_size(group)))
        return all_reduce(tensor, *args, group=group, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", spy)
    return calls


def call_end_peak(run_steps_with_phases, teardown=None) -> int:
    """The peak of ``run_steps_with_phases(on_phase)`` (a real multi-process step on gloo) with the frees gloo's
    worker threads make, which the profiler loses, placed at the end of the phase that allocated the block, as
    ``benchmarks/distributed.py`` places them (`preflight._measure.lost_free_peaks`), or of the synchronous collective
    that allocated it (`preflight._measure.collective_calls`): the figure the per-rank 3% rule is stated against.
    The repaired figure alone (every lost free kept until its address is reused) is an upper
    bound that swings by a collective's buffer from run to run on small models.

    ``teardown()``: drops what holds blocks no Python tensor shows at the end (a pipeline schedule keeps its
    zero-bubble weight-gradient graphs in autograd's nodes); the blocks it frees were alive at the end, not lost."""
    import gc

    from torch.profiler import ProfilerActivity, profile, record_function

    from preflight._device import live_storages
    from preflight._measure import collective_calls, lost_free_peaks
    from preflight._quiet import StderrFilter

    prefix, current = "## ", []

    def on_phase(step: int, phase: str) -> None:
        while current:
            current.pop().__exit__(None, None, None)
        if phase != "end":
            current.append(record_function(prefix + phase))
            current[-1].__enter__()

    with StderrFilter(), collective_calls(prefix), profile(activities=[ProfilerActivity.CPU],
                                                            profile_memory=True) as prof:
        run_steps_with_phases(on_phase)
        on_phase(0, "end")
    gc.collect()
    alive = set(live_storages([o for o in gc.get_objects() if isinstance(o, torch.Tensor)], torch.device("cpu")))
    if teardown is not None:
        from preflight._measure import freed_addresses

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as dropped:
            teardown()
            gc.collect()
        alive |= freed_addresses(dropped)
    return lost_free_peaks(prof, alive, prefix)[1]


def evaluation_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> int:
    """This rank's measured peak of an evaluation forward (eval mode, no gradients) after real training steps on
    gloo: the bytes alive before (its local shards, buffers, optimizer state and the evaluation batch; the steps
    left no gradients) plus the profiled rise (`call_end_peak`)."""
    from preflight._device import live_storage_bytes

    def evaluate(on_phase):
        on_phase(0, "forward")
        model.eval()
        with torch.no_grad():
            model(**batch)
        model.train()

    assert all(p.grad is None for p in model.parameters())
    before = live_storage_bytes([list(model.parameters()), list(model.buffers()), optimizer.state, batch],
                                torch.device("cpu"))
    torch.distributed.barrier()
    return before + call_end_peak(evaluate)


def assert_suggested_on_the_layout(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict,
                                   inside: tuple[int, ...], *, micro_batch: bool = False) -> None:
    """Inside a job whose model is laid out (tensor or expert parallelism), over a budget of 80% of the largest
    rank's peak: the callbacks' prediction suggests, each option traced on the model as it is laid out, bf16-true at
    exactly `estimate`'s figure under bf16-true (and, with ``micro_batch``, a smaller micro-batch that fits), and no
    LoRA over the layout."""
    import preflight
    from preflight.verdict import Options, predict

    tight = preflight.Run(target=preflight.Target(budget=int(max(inside) * 0.8)))
    over = predict(model, optimizer, batch, tight, options=Options())
    assert over.fits is False and over.suggestions, over.warnings
    bf16 = next(s for s in over.suggestions if s["change"] == {"precision": "bf16-true"})
    assert bf16["predicted_peak_bytes"] == preflight.estimate(
        model, optimizer, batch, preflight.Run(precision="bf16-true")).peak_bytes < max(inside)
    assert not micro_batch or any(s["fits"] and "micro_batch_size" in s["change"] for s in over.suggestions)
    assert not any("peft" in s["change"] for s in over.suggestions)  # not over a layout
