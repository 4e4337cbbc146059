"""The flash_attn builder's metadata type flows through build() and its binding."""

from __future__ import annotations

import torch
from typing_extensions import assert_type

from attnkit import (
    AttentionCGSupport,
    AttentionConfig,
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from attnkit.backend_api import (
    Binding,
    BuilderBinding,
    CommonAttentionMetadata,
    bind_builder,
    bind_each,
)
from attnkit.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
    FlashAttentionOptions,
    VersionChoice,
    choose_version,
)

spec = SlidingWindowSpec(
    block_size=256, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=128
)
config = AttentionConfig(backend_options={"flash_attn": FlashAttentionOptions(version=2)})
builder = FlashAttentionMetadataBuilder(spec, ["layers.0"], config, torch.device("cpu"))
assert_type(builder.kv_cache_spec, AttentionSpec)

batch = CommonAttentionMetadata.from_lists(
    query_lens=[2], seq_lens=[2], block_table=[[1]], slot_mapping=[256, 257]
)
meta = builder.build(0, batch)
assert_type(meta, FlashAttentionMetadata)
assert_type(builder.build(0, batch, fast_build=True), FlashAttentionMetadata)
assert_type(builder.build_for_cudagraph_capture(batch), FlashAttentionMetadata)
assert_type(meta.cu_seqlens_q, torch.Tensor)
assert_type(meta.cu_seqlens_k, torch.Tensor | None)
assert_type(meta.seqused_k, torch.Tensor | None)
assert_type(meta.block_table, torch.Tensor | None)
assert_type(meta.max_seqlen_q, int)
assert_type(meta.max_seqlen_k, int)
assert_type(meta.causal, bool)
assert_type(meta.window_size, tuple[int | None, int | None])
assert_type(
    FlashAttentionMetadataBuilder.get_cudagraph_support(config, spec),
    AttentionCGSupport,
)

binding = bind_builder(FullAttentionSpec, FlashAttentionMetadataBuilder, FlashAttentionImpl)
assert_type(binding, BuilderBinding[FullAttentionSpec, FlashAttentionMetadata])
cross = bind_builder(CrossAttentionSpec, FlashAttentionMetadataBuilder, FlashAttentionImpl)
assert_type(cross, BuilderBinding[CrossAttentionSpec, FlashAttentionMetadata])
for each in bind_each(
    (FullAttentionSpec, SlidingWindowSpec, EncoderOnlyAttentionSpec),
    FlashAttentionMetadataBuilder,
    FlashAttentionImpl,
):
    made = each.create(spec, ["layers.0"], config, torch.device("cpu"))
    assert_type(made.build(0, batch), FlashAttentionMetadata)
assert_type(config.options_for("flash_attn", FlashAttentionOptions), FlashAttentionOptions)
builders: tuple[Binding, ...] = FlashAttentionBackend.builders

choice = choose_version(None, (10, 0), installed=frozenset({2, 4}))
assert_type(choice, VersionChoice)
