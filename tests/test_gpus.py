"""The GPU catalog: lookups, aliases, figures and error texts."""

from __future__ import annotations

import dataclasses

import pytest

from preflight._gpus import GPU, get_gpu, known_gpus

REQUIRED = (
    "A100-40GB", "A100-80GB", "H100-80GB", "H200", "L4", "L40S", "A10G",
    "RTX-3090", "RTX-4090", "V100-16GB", "V100-32GB", "T4",
)
# The size on the box, in GB (10^9 B), for a sanity check on each catalog figure.
LABEL_GB = {
    "A100-40GB": 40, "A100-80GB": 80, "H100-80GB": 80, "H200": 141, "L4": 24, "L40S": 48, "A10G": 24,
    "RTX-3090": 24, "RTX-4090": 24, "V100-16GB": 16, "V100-32GB": 32, "T4": 16,
}


def test_catalog_has_every_required_gpu():
    assert set(REQUIRED) <= set(known_gpus())
    assert all(isinstance(get_gpu(name), GPU) and get_gpu(name).name == name for name in known_gpus())


@pytest.mark.parametrize("name", REQUIRED)
def test_memory_is_near_the_size_on_the_box(name):
    # torch's total_memory sits between ~2% under and ~7% over the label (GB vs GiB, driver reservation).
    ratio = get_gpu(name).memory_bytes / (LABEL_GB[name] * 10**9)
    assert 0.95 < ratio < 1.08, ratio


def test_sourced_memory_figures():
    assert get_gpu("A100-80GB").memory_bytes == 85_094_825_984
    assert get_gpu("A100-40GB").memory_bytes == 42_298_834_944
    assert get_gpu("H100-80GB").memory_bytes == 85_028_896_768
    assert get_gpu("H200").memory_bytes == 143_156 * 2**20
    assert get_gpu("T4").memory_bytes == 15_642_329_088


@pytest.mark.parametrize(
    "alias, name",
    [
        ("h100", "H100-80GB"),
        ("H100-80GB", "H100-80GB"),
        ("h100_80gb", "H100-80GB"),
        ("H100 80G", "H100-80GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("a100-80", "A100-80GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("nvidia h200", "H200"),
        ("l4", "L4"),
        ("L40s", "L40S"),
        ("NVIDIA A10G", "A10G"),
        ("rtx 3090", "RTX-3090"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("4090", "RTX-4090"),
        ("Tesla V100-SXM2-16GB", "V100-16GB"),
        ("v100_32gb", "V100-32GB"),
        ("Tesla T4", "T4"),
    ],
)
def test_aliases(alias, name):
    assert get_gpu(alias).name == name


def test_capabilities_and_bf16():
    assert get_gpu("A100-80GB").compute_capability == (8, 0)
    assert get_gpu("H100-80GB").compute_capability == (9, 0)
    assert get_gpu("L4").compute_capability == (8, 9)
    assert get_gpu("A10G").compute_capability == (8, 6)
    assert get_gpu("T4").compute_capability == (7, 5)
    assert get_gpu("V100-16GB").compute_capability == (7, 0)
    assert {n for n in known_gpus() if not get_gpu(n).bf16} == {"V100-16GB", "V100-32GB", "T4"}
    assert {get_gpu(n).arch for n in known_gpus()} == {"volta", "turing", "ampere", "ada", "hopper"}


def test_cublas_workspace_follows_torch_defaults():
    # parseChosenWorkspaceSize (aten/src/ATen/cuda/CublasHandlePool.cpp): ":4096:2:16:8", 32 MiB on Hopper.
    for name in known_gpus():
        expected = 32 * 2**20 if name in ("H100-80GB", "H200") else 4096 * 1024 * 2 + 16 * 1024 * 8
        assert get_gpu(name).cublas_workspace_bytes == expected


def test_context_is_a_few_hundred_mib():
    for name in known_gpus():
        assert 200 * 2**20 <= get_gpu(name).context_bytes <= 800 * 2**20
    # Hopper's is the H200 measurement after two training steps (benchmarks/results/gpu_validation_h200.md:
    # 2,058.8 MiB in use, 1,308.0 MiB reserved)
    assert get_gpu("H200").context_bytes == get_gpu("H100-80GB").context_bytes == 751 * 2**20


def test_gpu_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_gpu("T4").memory_bytes = 1


@pytest.mark.parametrize("name, variants", [("A100", ("A100-40GB", "A100-80GB")), ("v100", ("V100-16GB", "V100-32GB"))])
def test_ambiguous_name_lists_the_variants(name, variants):
    with pytest.raises(ValueError) as err:
        get_gpu(name)
    message = str(err.value)
    assert "ambiguous" in message and repr(name) in message
    assert all(v in message for v in variants)
    assert "T4" not in message


@pytest.mark.parametrize("name", ["B200", "", "H100-40GB", "mi300x"])
def test_unknown_name_lists_every_known_gpu(name):
    with pytest.raises(ValueError) as err:
        get_gpu(name)
    message = str(err.value)
    assert message.startswith(f"Unknown GPU {name!r}.")
    assert all(known in message for known in known_gpus())


def test_non_string_name():
    with pytest.raises(TypeError, match="must be a string"):
        get_gpu(80)
