"""Reading tensors' storages on a device (`preflight._device`)."""

from __future__ import annotations

import torch

from preflight._device import live_storages


def test_storages_without_data_are_counted_once_per_storage():
    # Meta storages have no address: views of one storage are one entry, two storages two, whatever Python objects
    # the storages are read through.
    meta = torch.device("meta")
    a, b = torch.empty(4, 8, device=meta), torch.empty(16, device=meta)
    found = live_storages([a, a[1:], a.t(), b, b[:4]], meta)
    assert sorted(found.values()) == [64, 128]
    # Storages with data are keyed by their address, also through views.
    x = torch.zeros(10)
    assert live_storages([x, x[2:], x.view(2, 5)], torch.device("cpu")) == {x.data_ptr(): 40}
