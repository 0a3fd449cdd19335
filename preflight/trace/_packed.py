"""Packed sequences (``nn.utils.rnn.pack_padded_sequence`` into an RNN) traced with their real sizes.

A `PackedSequence` holds the time steps of a padded batch without their padding: ``data`` has ``sum(lengths)``
rows, and ``batch_sizes`` (a host tensor of int64, always on the CPU) says how many sequences are still running
at each step. Both sizes depend on the lengths' values, which the fake trace knows from their shadow (the
lengths come from the batch). Three ATen kernels read or write ``batch_sizes`` through a raw pointer, where a
fake tensor has no data (``aten/src/ATen/native/PackedSequence.cpp``, ``RNN.cpp``, torch 2.13):

- ``_pack_padded_sequence`` (reaches the trace as one operator): it checks the lengths, fills ``batch_sizes``
  and returns ``cat`` of the steps' slices, a new contiguous ``(sum(lengths), *input.shape[2:])`` tensor. Here the
  real kernel runs on a one-byte stand-in of the input's first two dimensions with the lengths' shadow: its checks
  raise as the real step's would, its ``batch_sizes`` is the real one, and ``data`` is made in the fake mode with
  the real kernel's shape. ``batch_sizes`` stays a real tensor, so that the kernels below can read it.
- ``lstm``/``gru``/``rnn_*`` on packed data and ``_pack_padded_sequence_backward`` (composites of traced operators
  in C++) read ``batch_sizes`` only: with the real tensor they run as in the real step.
- ``_pad_packed_sequence`` (a composite in C++ too) writes the lengths it returns into a new host int64 tensor
  through its pointer: that ``empty``, asked for by ``nn.utils.rnn.pad_packed_sequence``'s call into the kernel,
  is made real (`host_lengths`) so that the kernel can write it; its padded output is made in the fake mode.

Both real tensors are host memory in the real run too: on a CUDA target they are taken off the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["EMPTY", "PACK", "host_lengths", "pack_padded_sequence", "packed_sizes"]

PACK = torch.ops.aten._pack_padded_sequence.default
EMPTY = torch.ops.aten.empty.memory_format


def packed_sizes(input: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> tuple[int, torch.Tensor]:
    """The real ``_pack_padded_sequence`` on a one-byte stand-in of ``input``'s first two dimensions with the real
    ``lengths``: the packed row count and the real ``batch_sizes``. Raises what the real kernel raises for these
    lengths (unsorted with ``enforce_sorted``, a zero length, one length per sequence missing): its checks read the
    lengths and the first two sizes only, and an empty stand-in is an empty input."""
    with _disable_current_modes():
        stand_in = torch.zeros(tuple(input.shape[:2]), dtype=torch.uint8)
        packed, batch_sizes = PACK(stand_in, lengths, batch_first)
    return packed.size(0), batch_sizes


def pack_padded_sequence(input: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """``aten._pack_padded_sequence`` for a fake ``input`` and the real ``lengths`` (its shadow): a fake ``data``
    of the real kernel's shape (``cat``'s contiguous output) and the real ``batch_sizes``. Called with the tracker's
    mode off, inside the fake mode."""
    rows, batch_sizes = packed_sizes(input, lengths, batch_first)
    return input.new_empty((rows, *input.shape[2:])), batch_sizes


def host_lengths(args: Any, kwargs: dict, caller: Callable[[], Any]) -> torch.Tensor | None:
    """For an ``EMPTY`` call (``args``, ``kwargs``): a real tensor if it is the one ``_pad_packed_sequence`` writes
    its lengths into, else None. That is a 1-D host int64 ``empty`` asked for while ``caller()`` (the code of the
    innermost Python frame; the kernel has none of its own) is ``nn.utils.rnn.pad_packed_sequence``'s."""
    if kwargs.get("dtype") is not torch.int64 or len(args[0]) != 1:
        return None
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return None
    if caller() is not torch.nn.utils.rnn.pad_packed_sequence.__code__:
        return None
    with _disable_current_modes():
        return torch.empty(args[0], dtype=torch.int64)
