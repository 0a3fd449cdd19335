"""Quantized base weights for a model built on the meta device: what ``from_pretrained(quantization_config=...)``
would load, without a checkpoint.

A user planning QLoRA or LLM.int8 fine-tuning for a model they have not downloaded has only its config. transformers
builds the quantized layers before it reads any weight (its bitsandbytes quantizer's ``preprocess_model`` swaps each
``nn.Linear`` for ``Linear4bit`` or ``Linear8bitLt``, keeping the output head and any module the config names
unquantized); bitsandbytes quantizes each weight when it is moved to the device. Here both run as they run for a
real load, with the weights on the meta device: bitsandbytes' quantize operators are ``torch.library`` operators
with fake implementations, so the packed 4-bit storage, its ``absmax`` and code, the nested statistics of double
quantization, and LLM.int8's ``CB``/``SCB`` come out with the shapes and dtypes a real load gives them, and the
trace counts them as it counts a loaded model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from preflight._quiet import quiet_import_logs

SCHEMES = ("nf4", "fp4", "int8")


def bnb_config(scheme: str, *, compute_dtype: torch.dtype = torch.float32, double_quant: bool = False) -> Any:
    """transformers' ``BitsAndBytesConfig`` for ``scheme`` (``nf4``/``fp4``: 4-bit with ``compute_dtype`` and
    optional double quantization; ``int8``: LLM.int8 with frozen int8 weights)."""
    from transformers import BitsAndBytesConfig

    if scheme not in SCHEMES:
        raise ValueError(f"quantization {scheme!r}: expected one of {', '.join(SCHEMES)}")
    if scheme == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=scheme, bnb_4bit_use_double_quant=double_quant,
                              bnb_4bit_compute_dtype=compute_dtype)


def quantize_on_meta(model: Any, config: Any) -> Any:
    """Quantize a transformers model built on the meta device as ``from_pretrained(quantization_config=config)``
    quantizes a loaded one, in place; returns ``model``. Raises ImportError without bitsandbytes."""
    with quiet_import_logs("bitsandbytes"):  # its CPU build logs a missing optional kernel package
        import bitsandbytes as bnb
    from transformers.quantizers.auto import AutoHfQuantizer

    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("quantize_on_meta takes a model built on the meta device (under torch.device('meta'))")
    quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
    # `device_map` as from_pretrained passes it for one device (read only for CPU-offloaded modules).
    quantizer.preprocess_model(model, device_map={"": "cpu"})
    # Under the CPU device: a caller's `torch.device("meta")` context would put bitsandbytes' own tables (the
    # quantization maps it builds as data, then copies to the weight's device) on meta, with nothing to copy.
    with _bnb_maps_kept(), torch.device("cpu"):
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, (bnb.nn.Params4bit, bnb.nn.Int8Params)):
                weight._quantize("meta")  # in place: the packed data and its statistics, as `.to(device)` does
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer  # as from_pretrained leaves it (peft and the Trainer read it)
    model.config.quantization_config = config
    return model


@contextlib.contextmanager
def _bnb_maps_kept() -> Iterator[None]:
    """bitsandbytes caches its quantization maps (``functional.name2qmap``) on the device of the first call that
    needs one: a map made here would be a meta tensor, and the user's next real double quantization would fail
    copying out of it. The cache is put back as it was."""
    import bitsandbytes.functional as F

    maps = getattr(F, "name2qmap", None)
    saved = dict(maps) if isinstance(maps, dict) else None
    try:
        yield
    finally:
        if saved is not None:
            maps.clear()
            maps.update(saved)
