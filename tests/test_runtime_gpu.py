"""The per-step host path on CUDA: no device-to-host synchronisation anywhere in
``begin_step`` or the builders, and the metadata equals the CPU runtime's."""

from __future__ import annotations

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionRuntime,
    FullAttentionSpec,
    KVCacheSpec,
    ScheduledRequest,
    SlidingWindowSpec,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEDULE = [
    [ScheduledRequest("a", 40), ScheduledRequest("b", 7)],
    [ScheduledRequest("a", 1), ScheduledRequest("b", 1), ScheduledRequest("c", 33)],
    [ScheduledRequest("a", 1), ScheduledRequest("c", 1)],
    [ScheduledRequest("a", 1), ScheduledRequest("c", 1), ScheduledRequest("d", 1)],
]


def _specs() -> dict[str, KVCacheSpec]:
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=24
    )
    return {"l0": full, "l1": window, "l2": full}


def _runtime(device: str, backend: str) -> AttentionRuntime:
    return AttentionRuntime(
        _specs(),
        AttentionConfig(backend=backend),
        device=device,
        memory_budget_bytes=1 << 24,
    )


@pytest.mark.parametrize("backend", ["reference", "triton_attn"])
def test_begin_step_never_syncs_and_matches_the_cpu_runtime(backend: str) -> None:
    gpu, cpu = _runtime("cuda", backend), _runtime("cpu", "reference")
    for step in SCHEDULE:
        torch.cuda.set_sync_debug_mode("error")
        try:
            gpu.begin_step(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        cpu.begin_step(step)
        for layer in ("l0", "l1"):
            g_common = gpu._groups[gpu._layer_group[layer]].common
            c_common = cpu._groups[cpu._layer_group[layer]].common
            assert g_common is not None
            assert c_common is not None
            assert g_common.block_table_tensor.device.type == "cuda"
            for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
                torch.testing.assert_close(
                    getattr(g_common, name).cpu(), getattr(c_common, name), rtol=0, atol=0
                )


def test_a_step_reaches_the_device_in_one_copy() -> None:
    """Every group's device fields are views of one buffer sent for the step
    (``hosts_to_device``); the next step's are a new one."""
    gpu = _runtime("cuda", "reference")
    seen: set[int] = set()
    for step in SCHEDULE:
        gpu.begin_step(step)
        storages = set()
        for entry in gpu._groups:
            common = entry.common
            assert common is not None
            for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
                storages.add(getattr(common, name).untyped_storage().data_ptr())
        assert len(storages) == 1, storages
        assert not storages & seen  # (a fresh buffer each step: the last may be in use)
        seen |= storages
