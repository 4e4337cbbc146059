"""The public batch helpers agree with the runtime's ordering: a new request, even of
one token, is a prefill (it has nothing cached to extend)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from typing_extensions import override

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    BackendRegistry,
    FullAttentionSpec,
    ScheduledRequest,
)
from attnkit.backend_api import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    bind_builder,
    reorder_batch_to_split_decodes_and_prefills,
    split_decodes_and_prefills,
)


class _EchoBuilder(AttentionMetadataBuilder[CommonAttentionMetadata, FullAttentionSpec]):
    """Hands the runtime's common metadata through, and asks for decodes first."""

    reorder_batch_threshold = 1

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> CommonAttentionMetadata:
        return common_attn_metadata


class _NoOpImpl(AttentionImpl[CommonAttentionMetadata, FullAttentionSpec, AttentionLayerParams]):
    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: CommonAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output


class _EchoBackend(AttentionBackend):
    name = "echo"
    builders = (bind_builder(FullAttentionSpec, _EchoBuilder, _NoOpImpl),)


def _runtime() -> AttentionRuntime:
    registry = BackendRegistry(discover_plugins=False)
    registry.register(_EchoBackend)
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    return AttentionRuntime(
        {"l0": spec},
        AttentionConfig(backend="echo"),
        device="cpu",
        memory_budget_bytes=64 * spec.page_size_bytes,
        registry=registry,
    )


def test_a_new_one_token_request_is_a_prefill_in_the_runtime_and_the_helpers() -> None:
    runtime = _runtime()
    runtime.begin_step([ScheduledRequest("a", 5), ScheduledRequest("b", 2)])
    # "c" is new and has one token: not a decode. "a" continues: a decode.
    step = runtime.begin_step(
        [ScheduledRequest("c", 1), ScheduledRequest("b", 3), ScheduledRequest("a", 1)]
    )
    assert step.order == ("a", "c", "b")
    cm = runtime.metadata_for("l0")
    assert isinstance(cm, CommonAttentionMetadata)
    assert cm.num_computed_tokens_cpu is not None
    assert cm.num_computed_tokens_cpu.tolist() == [5, 0, 2]
    split = split_decodes_and_prefills(cm)
    assert (split.num_decodes, split.num_prefills) == (1, 2)
    assert (split.num_decode_tokens, split.num_prefill_tokens) == (1, 4)
    # The reorder helper gives the runtime's order from the scheduler's.
    scheduled_lens, scheduled_computed = [1, 3, 1], [0, 2, 5]  # c, b, a as scheduled
    order = reorder_batch_to_split_decodes_and_prefills(
        scheduled_lens, num_computed_tokens=scheduled_computed
    )
    assert [("c", "b", "a")[i] for i in order] == list(step.order)


def test_split_refuses_a_decode_after_a_prefill() -> None:
    qsl = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    seq = torch.tensor([1, 6, 9], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq,
        seq_lens_cpu=seq,
        num_reqs=3,
        num_actual_tokens=5,
        max_query_len=3,
        max_seq_len=9,
        block_table_tensor=torch.zeros((3, 3), dtype=torch.int32),
        slot_mapping=torch.full((5,), -1, dtype=torch.int64),
        num_computed_tokens_cpu=torch.tensor([0, 3, 8], dtype=torch.int32),
    )
    # Request 0 is new (a prefill) and request 2 a decode after it.
    with pytest.raises(ValueError, match=r"request 2 is a decode .* after prefill request 0"):
        split_decodes_and_prefills(cm)


def test_reorder_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match=r"num_computed_tokens must have one entry per request"):
        reorder_batch_to_split_decodes_and_prefills([1, 2], num_computed_tokens=[1])
    with pytest.raises(ValueError, match=r"num_computed_tokens\[1\] must be an int >= 0"):
        reorder_batch_to_split_decodes_and_prefills([1, 2], num_computed_tokens=[1, -1])


def test_num_computed_tokens_is_validated() -> None:
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    seq = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"num_computed_tokens_cpu must be int32 of shape \[1\]"):
        CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl,
            seq_lens=seq,
            seq_lens_cpu=seq,
            num_reqs=1,
            num_actual_tokens=1,
            max_query_len=1,
            max_seq_len=2,
            block_table_tensor=torch.zeros((1, 1), dtype=torch.int32),
            slot_mapping=torch.zeros((1,), dtype=torch.int64),
            num_computed_tokens_cpu=torch.tensor([1, 1], dtype=torch.int32),
        )
