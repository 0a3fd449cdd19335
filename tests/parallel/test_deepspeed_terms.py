"""DeepSpeed ZeRO-3's own terms under offloading (`preflight.parallel._deepspeed.zero3_terms_for`): the gathered and
persistent parameters stay on the device as without offload; what the optimizer's CPU device holds leaves it."""

from __future__ import annotations

import sys
from pathlib import Path

from preflight.parallel._deepspeed import zero3_terms_for

sys.path.insert(0, str(Path(__file__).parent.parent))
from conftest import make_gpt2  # noqa: E402

OFF = {"offload_optimizer": False, "offload_params": False}


def test_offloading_keeps_the_gathered_parameters_and_moves_the_optimizers_partitions_to_the_host():
    model = make_gpt2()
    config = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 10_000_000,
                                    "stage3_prefetch_bucket_size": 50_000, "stage3_param_persistence_threshold": 100}}
    from preflight._sharding import read_deepspeed_config

    ds = read_deepspeed_config(config)
    plain, _ = zero3_terms_for(model, "zero3", ds, None, 4, OFF)
    optimizer, note = zero3_terms_for(model, "zero3", ds, None, 4, {**OFF, "offload_optimizer": True})
    params, _ = zero3_terms_for(model, "zero3", ds, None, 4, {**OFF, "offload_params": True})
    assert plain.gathered_bytes > 0 and plain.master_bytes > 0
    # the gathered, prefetched and persistent parameters are the same with or without offload
    for terms in (optimizer, params):
        assert (terms.gathered_bytes, terms.persistent_bytes, terms.first_step_gathered_bytes) == \
            (plain.gathered_bytes, plain.persistent_bytes, plain.first_step_gathered_bytes)
    # stage3.py makes the fp32 partitions and the gradient partitions on the optimizer's device, the CPU
    assert (optimizer.master_bytes, optimizer.grad_partition_bytes, optimizer.step_grad_bytes) == (0, 0, 0)
    assert params.master_bytes == plain.master_bytes  # only the parameter partitions move with offload_param
    assert "stage3_max_live_parameters" in note and "host memory" in note
    trainable = sum(p.numel() for p in model.parameters())
    assert plain.master_bytes == 4 * sum(-(-p.numel() // 4) for p in model.parameters()) >= trainable
