"""The triton_attn builder's metadata type flows through build() and its binding."""

from __future__ import annotations

import torch
from typing_extensions import assert_type

from attnkit import (
    AttentionCGSupport,
    AttentionConfig,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from attnkit.backend_api import BuilderBinding, CommonAttentionMetadata, bind_builder
from attnkit.backends.triton_attn import (
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

spec = SlidingWindowSpec(
    block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=128
)
builder = TritonAttentionMetadataBuilder(spec, ["layers.0"], AttentionConfig(), torch.device("cpu"))
assert_type(builder.kv_cache_spec, AttentionSpec)

batch = CommonAttentionMetadata.from_lists(
    query_lens=[2], seq_lens=[2], block_table=[[1]], slot_mapping=[16, 17]
)
meta = builder.build(0, batch)
assert_type(meta, TritonAttentionMetadata)
assert_type(builder.build(0, batch, fast_build=True), TritonAttentionMetadata)
assert_type(builder.build_for_cudagraph_capture(batch), TritonAttentionMetadata)
assert_type(meta.query_start_loc, torch.Tensor)
assert_type(meta.block_table, torch.Tensor)
assert_type(meta.max_seq_len, int)
assert_type(meta.num_actual_tokens, int)
assert_type(meta.sliding_window, int | None)
assert_type(meta.chunk_size, int | None)
assert_type(meta.causal, bool)
assert_type(meta.num_splits, int)
assert_type(meta.scratch_block_table, torch.Tensor | None)
assert_type(meta.scratch_slot_mapping, torch.Tensor | None)
assert_type(meta.scratch_num_blocks, int)
assert_type(builder.num_sms, int)
builder.num_sms = 132  # tests force the split-KV heuristic off CUDA
assert_type(
    TritonAttentionMetadataBuilder.get_cudagraph_support(AttentionConfig(), spec),
    AttentionCGSupport,
)

binding = bind_builder(FullAttentionSpec, TritonAttentionMetadataBuilder, TritonAttentionImpl)
assert_type(binding, BuilderBinding[FullAttentionSpec, TritonAttentionMetadata])
assert_type(
    bind_builder(ChunkedLocalAttentionSpec, TritonAttentionMetadataBuilder, TritonAttentionImpl),
    BuilderBinding[ChunkedLocalAttentionSpec, TritonAttentionMetadata],
)
assert_type(
    bind_builder(EncoderOnlyAttentionSpec, TritonAttentionMetadataBuilder, TritonAttentionImpl),
    BuilderBinding[EncoderOnlyAttentionSpec, TritonAttentionMetadata],
)
assert_type(
    bind_builder(CrossAttentionSpec, TritonAttentionMetadataBuilder, TritonAttentionImpl),
    BuilderBinding[CrossAttentionSpec, TritonAttentionMetadata],
)
