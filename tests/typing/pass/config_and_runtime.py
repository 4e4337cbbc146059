"""Every documented input form of AttentionConfig type-checks, options come back typed,
and a typed state-layer handle takes its own input class."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from typing_extensions import assert_type

from attnkit import (
    AttentionConfig,
    AttentionRuntime,
    Determinism,
    KVCacheSpecKind,
    Mamba2Inputs,
    ShortConvInputs,
    StateLayer,
)
from attnkit.backends.flash_attn import FlashAttentionOptions

by_string = AttentionConfig(backend_per_kind="sliding_window=triton_attn,full_attention=reference")
by_name = AttentionConfig(backend_per_kind={"full_attention": "reference"})
by_kind = AttentionConfig(backend_per_kind={KVCacheSpecKind.FULL_ATTENTION: "reference"})
one_backend = AttentionConfig(backend="reference", plugins="my_plugin,other")
plugin_list = AttentionConfig(plugins=["my_plugin"], max_num_reqs=8, max_model_len=4096)
options_dict = AttentionConfig(backend_options={"flash_attn": {"version": 2}})
options_typed = AttentionConfig(backend_options={"flash_attn": FlashAttentionOptions(version=4)})
level_named = AttentionConfig(determinism="batch_invariant")
level_typed = AttentionConfig(determinism=Determinism.PREFIX_HIT_INVARIANT)
assert_type(level_named.determinism, Determinism)
validated = AttentionConfig.model_validate(
    {"backend_per_kind": {"sliding_window": "triton_attn"}},
    context={"known_backends": ["triton_attn"]},
)
assert_type(by_kind.backend_per_kind, Mapping[KVCacheSpecKind, str])
assert_type(one_backend.backend, str | None)
assert_type(plugin_list.plugins, frozenset[str] | None)

options = options_dict.options_for("flash_attn", FlashAttentionOptions)
assert_type(options, FlashAttentionOptions)
assert_type(options.version, Literal[2, 4] | None)


def run(runtime: AttentionRuntime, xbc: torch.Tensor, dt: torch.Tensor) -> None:
    mamba = runtime.state_layer("layers.1", Mamba2Inputs)
    assert_type(mamba, StateLayer[Mamba2Inputs])
    assert_type(mamba.forward(Mamba2Inputs(xBC=xbc, dt=dt)), torch.Tensor)
    conv = runtime.state_layer("layers.2", ShortConvInputs)
    assert_type(conv.forward(ShortConvInputs(b=xbc, c=xbc, x=xbc), output=xbc), torch.Tensor)
    # The untyped entry point takes any state input class (checked at run time).
    assert_type(runtime.forward_state("layers.1", Mamba2Inputs(xBC=xbc, dt=dt)), torch.Tensor)
    assert_type(runtime.forward("layers.0", xbc, xbc, xbc), torch.Tensor)
