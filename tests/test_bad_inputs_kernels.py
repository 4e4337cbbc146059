"""Bad-input catalogue of the kernel launchers (Triton launchers and torch oracles).

Each case starts from a small valid call, breaks one argument, and checks that the
launcher raises, in Python and before any kernel runs:

1. the exception type: ``TypeError`` for an argument of the wrong Python type (a list
   for a tensor, a float for an int), ``ValueError`` (and not ``TypeError``) for a
   value that is not allowed;
2. a message naming the argument and what is allowed (the ``match`` regex, searched
   from the start of the message);
3. that nothing changed: every tensor of the call (caches and states filled with a
   sentinel, outputs, inputs) is bit-for-bit what it was before the call.

The valid calls themselves are run once each (``test_valid_call_runs``), so every case
fails only through the argument it breaks. Without CUDA the Triton kernels run under
the Triton interpreter (``tests/conftest.py``); no case below launches one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from attnkit.kernels.attention import reference as t_attn
from attnkit.kernels.attention import triton_kv_write as tr_kvw
from attnkit.kernels.attention import triton_split_kv as tr_skv
from attnkit.kernels.attention import triton_unified as tr_ua
from attnkit.kernels.conv1d import reference as t_conv
from attnkit.kernels.conv1d import triton as tr_conv
from attnkit.kernels.gated_delta import reference as t_gdn
from attnkit.kernels.gated_delta import triton as tr_gdn
from attnkit.kernels.linear_attention import triton as tr_la
from attnkit.kernels.mamba2 import reference as t_ssm
from attnkit.kernels.mamba2 import triton as tr_ssm
from attnkit.kernels.merge import reference as t_merge
from attnkit.kernels.merge import triton as tr_merge
from attnkit.kernels.short_conv import triton as tr_sc

Kwargs = dict[str, Any]
Mutation = Callable[[Kwargs], None]

META = torch.device("meta")
# Caches, states and outputs hold this value, so any write by a rejected call shows.
SENTINEL = 7.0
FP8 = torch.float8_e4m3fn


def _i32(values: list[int] | list[list[int]]) -> Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _i64(values: list[int]) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _bools(values: list[bool]) -> Tensor:
    return torch.tensor(values, dtype=torch.bool)


def _rand(*shape: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _full(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.full(shape, SENTINEL, dtype=dtype)


# ----------------------------------------------------------------------------------
# Valid calls: one small call per launcher (the cases below break one argument each)
# ----------------------------------------------------------------------------------


def _paged_batch(num_tokens: int, qsl: list[int], seq_lens: list[int]) -> Kwargs:
    """Hq = 4, Hkv = 2, D = 16, BS = 16, two blocks: one block per request."""
    return {
        "query": _rand(num_tokens, 4, 16),
        "kv_cache": _rand(2, 2, 16, 2, 16),
        "query_start_loc": _i32(qsl),
        "seq_lens": _i32(seq_lens),
        "block_table": _i32([[0], [1]]),
        "max_seq_len": max(seq_lens),
        "scale": 0.25,
        "output": _full(num_tokens, 4, 16),
    }


def _unified() -> Kwargs:
    return {**_paged_batch(3, [0, 2, 3], [5, 4]), "max_query_len": 2}


def _split_kv() -> Kwargs:
    return {**_paged_batch(2, [0, 1, 2], [5, 4]), "num_splits": 2}


def _merge() -> Kwargs:
    return {
        "out_a": _rand(3, 2, 16),
        "lse_a": _rand(3, 2),
        "out_b": _rand(3, 2, 17)[..., :16],
        "lse_b": _rand(3, 3)[:, :2],
        "output": _full(3, 2, 16),
        "output_lse": _full(3, 2),
    }


def _kv_write() -> Kwargs:
    return {
        "key": _rand(3, 2, 16),
        "value": _rand(3, 2, 17)[..., :16],
        "kv_cache": _full(2, 2, 16, 2, 16),
        "slot_mapping": _i64([16, -1, 17]),
    }


def _torch_kv_write() -> Kwargs:
    return {
        "key": _rand(3, 2, 4),
        "value": _rand(3, 2, 5)[..., :4],
        "kv_cache": _full(4, 2, 4, 2, 4),
        "slot_mapping": _i64([0, -1, 5]),
    }


def _torch_paged() -> Kwargs:
    return {
        "query": _rand(3, 4, 8),
        "kv_cache": _rand(2, 2, 16, 2, 8),
        "query_start_loc": _i32([0, 2, 3]),
        "seq_lens": _i32([5, 4]),
        "block_table": _i32([[0], [1]]),
        "scale": 0.5,
        "output": _full(3, 4, 8),
    }


def _dense() -> Kwargs:
    return {"query": _rand(3, 4, 8), "key": _rand(5, 2, 8), "value": _rand(5, 2, 8), "scale": 1.0}


def _gather() -> Kwargs:
    return {"kv_cache": _full(2, 2, 16, 2, 8), "block_table_row": _i32([1]), "seq_len": 9}


def _varlen_meta() -> Kwargs:
    """Two requests of 1 and 3 tokens in slots 0 and 2 of a three-slot cache."""
    return {
        "query_start_loc": _i32([0, 1, 4]),
        "state_indices": _i32([0, 2]),
        "has_initial_state": _bools([True, False]),
    }


def _conv_varlen() -> Kwargs:
    return {
        "x": _rand(4, 6),
        "weight": _rand(6, 3),
        "bias": None,
        "conv_states": _full(3, 6, 2),
        **_varlen_meta(),
        "out": _full(4, 6),
    }


def _conv_update() -> Kwargs:
    return {
        "x": _rand(2, 6),
        "weight": _rand(6, 3),
        "bias": _rand(6),
        "conv_states": _full(3, 6, 2),
        "state_indices": _i32([0, 2]),
        "out": _full(2, 6),
    }


def _torch_conv_update() -> Kwargs:
    kw = _conv_update()
    del kw["out"]
    return kw


def _short_conv_varlen() -> Kwargs:
    return {
        "b": _rand(4, 6),
        "c": _rand(4, 7)[:, :6],
        "x": _rand(4, 6) + 1,
        "weight": _rand(6, 3),
        "conv_states": _full(3, 6, 2),
        **_varlen_meta(),
        "out": _full(4, 6),
    }


def _short_conv_update() -> Kwargs:
    return {
        "b": _rand(2, 6),
        "c": _rand(2, 6) + 1,
        "x": _rand(2, 6) + 2,
        "weight": _rand(6, 3),
        "conv_states": _full(3, 6, 2),
        "state_indices": _i32([0, 2]),
        "out": _full(2, 6),
    }


def _gdn_chunk() -> Kwargs:
    qk = torch.nn.functional.normalize(_rand(2, 4, 2, 16), dim=-1)
    return {
        "q": qk[0],
        "k": qk[1],
        "v": _rand(4, 2, 16),
        "g": -_rand(4, 2).abs(),
        "beta": _rand(4, 2).sigmoid(),
        "scale": 0.25,
        "states": _full(3, 2, 16, 16),
        **_varlen_meta(),
        "chunk_size": 16,
        "out": _full(4, 2, 16),
    }


def _gdn_chunk_shared_heads() -> Kwargs:
    """Hk = 2 query/key heads shared by H = 4 value heads (as Qwen3-Next, at 16/32)."""
    qk = torch.nn.functional.normalize(_rand(2, 4, 2, 16), dim=-1)
    return {
        "q": qk[0],
        "k": qk[1],
        "v": _rand(4, 4, 16),
        "g": -_rand(4, 4).abs(),
        "beta": _rand(4, 4).sigmoid(),
        "scale": 0.25,
        "states": _full(3, 4, 16, 16),
        **_varlen_meta(),
        "chunk_size": 16,
        "out": _full(4, 4, 16),
    }


def _gdn_decode_shared_heads() -> Kwargs:
    """Hk = 2, H = 4 for one decode step of two requests."""
    qk = torch.nn.functional.normalize(_rand(2, 2, 2, 16), dim=-1)
    return {
        "q": qk[0],
        "k": qk[1],
        "v": _rand(2, 4, 16),
        "g": -_rand(2, 4).abs(),
        "beta": _rand(2, 4).sigmoid(),
        "scale": 0.25,
        "states": _full(3, 4, 16, 16),
        "state_indices": _i32([0, 2]),
        "out": _full(2, 4, 16),
    }


def _gdn_decode() -> Kwargs:
    qk = torch.nn.functional.normalize(_rand(2, 2, 2, 16), dim=-1)
    return {
        "q": qk[0],
        "k": qk[1],
        "v": _rand(2, 2, 16),
        "g": -_rand(2, 2).abs(),
        "beta": _rand(2, 2).sigmoid(),
        "scale": 0.25,
        "states": _full(3, 2, 16, 16),
        "state_indices": _i32([0, 2]),
        "out": _full(2, 2, 16),
    }


def _la_chunk() -> Kwargs:
    return {
        "q": _rand(4, 2, 16),
        "k": _rand(4, 2, 17)[..., :16],
        "v": _rand(4, 2, 16) + 1,
        "decay": _rand(2).abs(),
        "scale": 0.25,
        "states": _full(3, 2, 16, 16),
        **_varlen_meta(),
        "chunk_size": 4,
        "out": _full(4, 2, 16),
    }


def _la_decode() -> Kwargs:
    return {
        "q": _rand(2, 2, 16),
        "k": _rand(2, 2, 16) + 1,
        "v": _rand(2, 2, 16) + 2,
        "decay": _rand(2).abs(),
        "scale": 0.25,
        "states": _full(3, 2, 16, 16),
        "state_indices": _i32([0, 2]),
        "out": _full(2, 2, 16),
    }


def _ssd_operands(lead: int) -> Kwargs:
    """H = 2 heads of P = 16, one group, state size N = 16."""
    return {
        "x": _rand(lead, 2, 16),
        "dt": _rand(lead, 2),
        "A": -_rand(2).abs(),
        "B": _rand(lead, 1, 16),
        "C": _rand(lead, 1, 17)[..., :16],
        "D": _rand(2),
        "dt_bias": None,
        "dt_softplus": True,
        "ssm_states": _full(3, 2, 16, 16),
    }


def _ssd_chunked() -> Kwargs:
    return {**_ssd_operands(4), **_varlen_meta(), "chunk_size": 16, "out": _full(4, 2, 16)}


def _torch_ssd_chunked() -> Kwargs:
    kw = _ssd_chunked()
    del kw["out"]
    return kw


def _ssd_update() -> Kwargs:
    return {**_ssd_operands(2), "state_indices": _i32([0, 2]), "out": _full(2, 2, 16)}


def _chunk_offsets() -> Kwargs:
    return {"query_start_loc": _i32([0, 1, 4]), "num_tokens": 4, "chunk_size": 16}


# Launcher name -> (function, factory of a valid call's keyword arguments).
LAUNCHERS: dict[str, tuple[Callable[..., object], Callable[[], Kwargs]]] = {
    "unified_attention": (tr_ua.unified_attention, _unified),
    "split_kv_decode": (tr_skv.split_kv_decode, _split_kv),
    "merge_attn_states": (tr_merge.merge_attn_states, _merge),
    "torch.merge_attn_states": (t_merge.merge_attn_states, _merge),
    "write_kv_cache": (tr_kvw.write_kv_cache, _kv_write),
    "torch.write_kv_cache": (t_attn.write_kv_cache, _torch_kv_write),
    "torch.paged_attention": (t_attn.paged_attention, _torch_paged),
    "torch.dense_attention": (t_attn.dense_attention, _dense),
    "torch.gather_kv": (t_attn.gather_kv, _gather),
    "causal_conv1d_varlen": (tr_conv.causal_conv1d_varlen, _conv_varlen),
    "causal_conv1d_update": (tr_conv.causal_conv1d_update, _conv_update),
    "torch.causal_conv1d_update": (t_conv.causal_conv1d_update, _torch_conv_update),
    "short_conv_varlen": (tr_sc.short_conv_varlen, _short_conv_varlen),
    "short_conv_update": (tr_sc.short_conv_update, _short_conv_update),
    "chunk_gated_delta_rule_varlen": (tr_gdn.chunk_gated_delta_rule_varlen, _gdn_chunk),
    "fused_recurrent_gated_delta_rule_update": (
        tr_gdn.fused_recurrent_gated_delta_rule_update,
        _gdn_decode,
    ),
    "chunk_gated_delta_rule_varlen.shared_heads": (
        tr_gdn.chunk_gated_delta_rule_varlen,
        _gdn_chunk_shared_heads,
    ),
    "fused_recurrent_gated_delta_rule_update.shared_heads": (
        tr_gdn.fused_recurrent_gated_delta_rule_update,
        _gdn_decode_shared_heads,
    ),
    "torch.chunk_gated_delta_rule_varlen.shared_heads": (
        t_gdn.chunk_gated_delta_rule_varlen,
        _gdn_chunk_shared_heads,
    ),
    "torch.fused_recurrent_gated_delta_rule_update.shared_heads": (
        t_gdn.fused_recurrent_gated_delta_rule_update,
        _gdn_decode_shared_heads,
    ),
    "chunk_linear_attention_varlen": (tr_la.chunk_linear_attention_varlen, _la_chunk),
    "linear_attention_decode": (tr_la.linear_attention_decode, _la_decode),
    "ssd_chunked_varlen": (tr_ssm.ssd_chunked_varlen, _ssd_chunked),
    "torch.ssd_chunked_varlen": (t_ssm.ssd_chunked_varlen, _torch_ssd_chunked),
    "selective_state_update": (tr_ssm.selective_state_update, _ssd_update),
    "ssd_chunk_offsets": (tr_ssm.ssd_chunk_offsets, _chunk_offsets),
}


# ----------------------------------------------------------------------------------
# Snapshots
# ----------------------------------------------------------------------------------


def _tensors(value: object, path: str) -> Iterator[tuple[str, Tensor]]:
    """Every tensor in ``value`` (tuples and NamedTuples included), by path."""
    if isinstance(value, Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(cast("Sequence[object]", value)):
            yield from _tensors(item, f"{path}[{i}]")


def _bits(t: Tensor) -> Tensor:
    """A copy whose comparison is bit-exact (NaN equal to NaN, fp8 as its bytes)."""
    copy = t.detach().clone()
    if copy.dtype.itemsize == 1 and copy.dtype.is_floating_point:
        return copy.view(torch.uint8)
    if copy.dtype.is_floating_point:
        return copy.view(torch.int32 if copy.dtype.itemsize == 4 else torch.int16)
    return copy


def _snapshot(kwargs: Kwargs) -> dict[str, tuple[Tensor, Tensor]]:
    """``path -> (tensor, bit copy)`` for every tensor that has data (not ``meta``)."""
    return {
        path: (t, _bits(t))
        for name, value in kwargs.items()
        for path, t in _tensors(value, name)
        if t.device != META
    }


# ----------------------------------------------------------------------------------
# Mutations
# ----------------------------------------------------------------------------------


def _set(**changes: object) -> Mutation:
    """Set arguments; a callable value is called with the (current) keyword arguments."""

    def mutate(kw: Kwargs) -> None:
        for name, value in changes.items():
            kw[name] = value(kw) if callable(value) else value

    return mutate


def _from(name: str, derive: Callable[[Tensor], object]) -> Callable[[Kwargs], object]:
    """A value computed from the tensor argument ``name`` of the valid call."""

    def value(kw: Kwargs) -> object:
        t = kw[name]
        assert isinstance(t, Tensor)
        return derive(t)

    return value


def _workspace(splits: int, tokens: int) -> tr_skv.SplitKVWorkspace:
    ws = tr_skv.split_kv_workspace(splits, tokens, 4, 16)
    ws.partial_out.fill_(SENTINEL)
    ws.partial_lse.fill_(SENTINEL)
    return ws


# ----------------------------------------------------------------------------------
# The catalogue
# ----------------------------------------------------------------------------------

TE, VE = TypeError, ValueError

CASES = [
    # --- unified_attention -------------------------------------------------------
    pytest.param(
        "unified_attention",
        _set(query=[[0.0] * 16]),
        TE,
        r"query: expected a torch\.Tensor \[T, Hq, D\], got list",
        id="ua-query-list",
    ),
    pytest.param(
        "unified_attention",
        _set(kv_cache=None),
        TE,
        r"kv_cache: expected a torch\.Tensor \[NB, 2, BS, Hkv, D\], got None",
        id="ua-cache-none",
    ),
    pytest.param(
        "unified_attention",
        _set(seq_lens=[5, 4]),
        TE,
        r"seq_lens: expected an int32 torch\.Tensor \[B\], got list \[5, 4\]",
        id="ua-seq-lens-list",
    ),
    pytest.param(
        "unified_attention",
        _set(block_table=_from("block_table", lambda t: t.long())),
        VE,
        r"block_table: expected dtype torch\.int32, got torch\.int64",
        id="ua-block-table-int64",
    ),
    pytest.param(
        "unified_attention",
        _set(query=_from("query", lambda t: t[:, :3]), output=_full(3, 3, 16)),
        VE,
        r"kv_cache: expected a kv head count dividing the 3 query heads, got 2",
        id="ua-heads-not-dividing",
    ),
    pytest.param(
        "unified_attention",
        _set(
            query=_from("query", lambda t: t[..., :8]),
            kv_cache=_from("kv_cache", lambda t: t[..., :8].contiguous()),
        ),
        VE,
        r"query: expected head size in \[16, 256\], got 8",
        id="ua-head-size-8",
    ),
    pytest.param(
        "unified_attention",
        _set(kv_cache=_full(4, 2, 8, 2, 16)),
        VE,
        r"kv_cache: expected block size in \(16, 32, 64, 128\), got 8",
        id="ua-block-size-8",
    ),
    pytest.param(
        "unified_attention",
        _set(kv_cache=_full(0, 2, 16, 2, 16)),
        VE,
        r"kv_cache: expected at least one block \(NB >= 1\), "
        r"got torch\.float32 \[0, 2, 16, 2, 16\] on cpu",
        id="ua-cache-no-blocks",
    ),
    pytest.param(
        "unified_attention",
        _set(kv_cache=_full(2, 2, 2, 16, 16).permute(0, 1, 3, 2, 4)),
        VE,
        r"kv_cache: expected a contiguous tensor, got a non-contiguous one "
        r"\(torch\.float32 \[2, 2, 16, 2, 16\] on cpu, strides",
        id="ua-cache-non-contiguous",
    ),
    pytest.param(
        "unified_attention",
        _set(output=_full(3, 4, 16, dtype=torch.float16)),
        VE,
        r"output: expected dtype torch\.float32 \(the query dtype\), got torch\.float16",
        id="ua-output-dtype",
    ),
    pytest.param(
        "unified_attention",
        _set(output=[0.0]),
        TE,
        r"output: expected a torch\.Tensor \[T, Hq, D\] or None, got list",
        id="ua-output-list",
    ),
    pytest.param(
        "unified_attention",
        _set(scale=float("inf")),
        VE,
        r"scale: expected a finite float, got inf",
        id="ua-scale-inf",
    ),
    pytest.param(
        "unified_attention",
        _set(scale="0.25"),
        TE,
        r"scale: expected a finite float, got str '0\.25'",
        id="ua-scale-str",
    ),
    pytest.param(
        "unified_attention",
        _set(sliding_window=0),
        VE,
        r"sliding_window: expected an int >= 1, got 0",
        id="ua-window-zero",
    ),
    pytest.param(
        "unified_attention",
        _set(causal="yes"),
        TE,
        r"causal: expected a bool, got str 'yes'",
        id="ua-causal-str",
    ),
    pytest.param(
        "unified_attention",
        _set(lse=[0.0]),
        TE,
        r"lse: expected a float32 \[T, Hq\]=\[3, 4\] torch\.Tensor or None, got list",
        id="ua-lse-list",
    ),
    pytest.param(
        "unified_attention",
        _set(k_scale=[1.0]),
        TE,
        r"k_scale: expected a float > 0, a one-element torch\.float32 tensor or None, "
        r"got list",
        id="ua-k-scale-list",
    ),
    pytest.param(
        "unified_attention",
        _set(query_start_loc=_from("query_start_loc", lambda t: t.to(META))),
        VE,
        r"query_start_loc: expected device cpu \(the plan device\), got meta",
        id="ua-qsl-meta-device",
    ),
    pytest.param(
        "unified_attention",
        _set(max_seq_len=40),
        VE,
        r"block_table: expected at least 3 columns for max_seq_len=40 at block size 16, got 1",
        id="ua-block-table-narrow",
    ),
    # --- split_kv_decode ---------------------------------------------------------
    pytest.param(
        "split_kv_decode",
        _set(num_splits=0),
        VE,
        r"num_splits: expected an int >= 1, got 0",
        id="skv-splits-zero",
    ),
    pytest.param(
        "split_kv_decode",
        _set(num_splits=2.0),
        TE,
        r"num_splits: expected an int, got float 2\.0",
        id="skv-splits-float",
    ),
    pytest.param(
        "split_kv_decode",
        _set(max_query_len=17),
        VE,
        r"max_query_len: expected an int <= 16, got 17",
        id="skv-max-query-len-17",
    ),
    pytest.param(
        "split_kv_decode",
        _set(workspace=list(_workspace(2, 2))),
        TE,
        r"workspace: expected a SplitKVWorkspace\(partial_out, partial_lse\), got list",
        id="skv-workspace-list",
    ),
    pytest.param(
        "split_kv_decode",
        _set(workspace=_workspace(1, 2)),
        VE,
        r"workspace\.partial_out: expected shape \[S >= 2, T >= 2, 4, 16\], "
        r"got \(1, 2, 4, 16\)",
        id="skv-workspace-too-few-splits",
    ),
    pytest.param(
        "split_kv_decode",
        _set(alibi_slopes=[0.0] * 4),
        TE,
        r"alibi_slopes: expected a float torch\.Tensor \[Hq\]=\[4\] or None, got list",
        id="skv-alibi-list",
    ),
    pytest.param(
        "split_kv_decode",
        _set(k_scale=0.0),
        VE,
        r"k_scale: expected a float > 0, got 0\.0",
        id="skv-k-scale-zero",
    ),
    pytest.param(
        "split_kv_decode",
        _set(lse=[0.0]),
        TE,
        r"lse: expected a float32 \[T, Hq\]=\[2, 4\] torch\.Tensor or None, got list",
        id="skv-lse-list",
    ),
    pytest.param(
        "split_kv_decode",
        _set(kv_cache=_from("kv_cache", lambda t: t.to(FP8))),
        VE,
        r"k_scale: expected a float or a one-element torch\.float32 tensor with a "
        r"torch\.float8_e4m3fn kv_cache, got None",
        id="skv-fp8-without-scales",
    ),
    # --- merge_attn_states (Triton and torch) -------------------------------------
    pytest.param(
        "merge_attn_states",
        _set(lse_a=[[0.0, 0.0]] * 3),
        TE,
        r"lse_a: expected a torch\.float32 tensor \[T, H\], got list",
        id="merge-lse-a-list",
    ),
    pytest.param(
        "merge_attn_states",
        _set(lse_b=_from("lse_b", lambda t: t.half())),
        VE,
        r"lse_b: expected dtype torch\.float32, got torch\.float16",
        id="merge-lse-b-fp16",
    ),
    pytest.param(
        "merge_attn_states",
        _set(output=_full(3, 2, 8)),
        VE,
        r"output: expected shape \(3, 2, 16\) \(the out_a shape\), got \(3, 2, 8\)",
        id="merge-output-shape",
    ),
    pytest.param(
        "torch.merge_attn_states",
        _set(out_b=None),
        TE,
        r"out_b: expected a torch\.Tensor \[T, H, D\], got None",
        id="torch-merge-out-b-none",
    ),
    pytest.param(
        "torch.merge_attn_states",
        _set(out_b=_from("out_b", lambda t: t.to(META))),
        VE,
        r"out_b: expected device cpu \(the out_a device\), "
        r"got torch\.float32 \[3, 2, 16\] on meta",
        id="torch-merge-out-b-meta",
    ),
    # --- write_kv_cache (Triton) ----------------------------------------------------
    pytest.param(
        "write_kv_cache",
        _set(slot_mapping=_i64([16, 0, -1, 0, 17, 0])[::2]),
        VE,
        r"slot_mapping: expected unit stride, got stride 2 \(torch\.int64 \[3\] on cpu\)",
        id="kvw-slots-strided",
    ),
    pytest.param(
        "write_kv_cache",
        _set(slot_mapping=[16, -1, 17]),
        TE,
        r"slot_mapping: expected an int64 torch\.Tensor \[T\], got list",
        id="kvw-slots-list",
    ),
    pytest.param(
        "write_kv_cache",
        _set(slot_mapping=_from("slot_mapping", lambda t: t.int())),
        VE,
        r"slot_mapping: expected dtype torch\.int64, got torch\.int32",
        id="kvw-slots-int32",
    ),
    pytest.param(
        "write_kv_cache",
        _set(key=_from("key", lambda t: t.half())),
        VE,
        r"key: expected dtype torch\.float32 \(the kv_cache dtype\), got torch\.float16",
        id="kvw-key-dtype",
    ),
    pytest.param(
        "write_kv_cache",
        _set(value=_from("value", lambda t: t[:2])),
        VE,
        r"value: expected 3 tokens \(as key\), got 2",
        id="kvw-value-tokens",
    ),
    pytest.param(
        "write_kv_cache",
        _set(kv_cache=_full(2, 2, 0, 2, 16)),
        VE,
        r"kv_cache: expected NB, BS, Hkv and D >= 1 in \[NB, 2, BS, Hkv, D\], "
        r"got torch\.float32 \[2, 2, 0, 2, 16\] on cpu",
        id="kvw-cache-block-size-0",
    ),
    pytest.param(
        "write_kv_cache",
        _set(kv_cache=_full(2, 2, 16, 2, 16).to(FP8)),
        VE,
        r"k_scale: expected a one-element torch\.float32 tensor with a "
        r"torch\.float8_e4m3fn kv_cache, got None",
        id="kvw-fp8-without-scales",
    ),
    pytest.param(
        "write_kv_cache",
        _set(key=_from("key", lambda t: t.to(META))),
        VE,
        r"key: expected device cpu \(the kv_cache device\), got meta",
        id="kvw-key-meta-device",
    ),
    # --- torch write_kv_cache, paged_attention, dense_attention, gather_kv ----------
    pytest.param(
        "torch.write_kv_cache",
        _set(k_scale=0.0),
        VE,
        r"k_scale must be a finite float > 0, got 0\.0",
        id="torch-kvw-k-scale-zero",
    ),
    pytest.param(
        "torch.write_kv_cache",
        _set(key=[[0.0]]),
        TE,
        r"key must be a tensor of shape \[T, Hkv, D\], got list",
        id="torch-kvw-key-list",
    ),
    pytest.param(
        "torch.write_kv_cache",
        _set(slot_mapping=_i64([0, -1, 16])),
        VE,
        r"slot_mapping entries must be -1 or in \[0, NB\*BS\)=\[0, 16\), got values in \[0, 16\]",
        id="torch-kvw-slot-past-cache",
    ),
    pytest.param(
        "torch.paged_attention",
        _set(scale=float("nan")),
        VE,
        r"scale: expected a finite float, got nan",
        id="torch-paged-scale-nan",
    ),
    pytest.param(
        "torch.paged_attention",
        _set(logits_soft_cap=float("inf")),
        VE,
        r"logits_soft_cap: expected a finite float > 0 or None, got inf",
        id="torch-paged-softcap-inf",
    ),
    pytest.param(
        "torch.paged_attention",
        _set(query_start_loc=[0, 2, 3]),
        TE,
        r"query_start_loc: expected an int32 torch\.Tensor \[3\], got list",
        id="torch-paged-qsl-list",
    ),
    pytest.param(
        "torch.paged_attention",
        _set(sliding_window=2.5),
        TE,
        r"sliding_window: expected an int, got float 2\.5",
        id="torch-paged-window-float",
    ),
    pytest.param(
        "torch.paged_attention",
        _set(v_scale=-1.0),
        VE,
        r"v_scale: expected a float > 0, got -1\.0",
        id="torch-paged-v-scale-negative",
    ),
    pytest.param(
        "torch.paged_attention",
        _set(block_table=_i32([[0], [2]])),
        VE,
        r"block_table\[1, 0\]=2 is not a physical block index in \[0, NB\)=\[0, 2\)",
        id="torch-paged-block-out-of-range",
    ),
    pytest.param(
        "torch.dense_attention",
        _set(key=[[0.0]]),
        TE,
        r"key must be a tensor of shape \[Tk, Hkv, D\], got list",
        id="torch-dense-key-list",
    ),
    pytest.param(
        "torch.dense_attention",
        _set(causal=1),
        TE,
        r"causal: expected a bool, got int 1",
        id="torch-dense-causal-int",
    ),
    pytest.param(
        "torch.dense_attention",
        _set(sinks=[0.0] * 4),
        TE,
        r"sinks: expected a float torch\.Tensor \[Hq\]=\[4\] or None, got list",
        id="torch-dense-sinks-list",
    ),
    pytest.param(
        "torch.gather_kv",
        _set(seq_len=17),
        VE,
        r"seq_len must be an int in \[0, 16\] \(max_blocks \* BS\), got 17",
        id="torch-gather-seq-len-past-row",
    ),
    pytest.param(
        "torch.gather_kv",
        _set(block_table_row=_i32([5])),
        VE,
        r"block_table_row entries must be physical block indices in \[0, NB\)=\[0, 2\), "
        r"got values in \[5, 5\]",
        id="torch-gather-block-out-of-range",
    ),
    # --- causal conv1d (Triton, torch) --------------------------------------------
    pytest.param(
        "causal_conv1d_varlen",
        _set(conv_states=_full(0, 6, 2)),
        VE,
        r"conv_states: expected at least one slot \(S >= 1\) for B = 2 requests, "
        r"got torch\.float32 \[0, 6, 2\] on cpu",
        id="conv-states-no-slots",
    ),
    pytest.param(
        "causal_conv1d_varlen",
        _set(x=[[0.0] * 6] * 4),
        TE,
        r"x: expected a torch\.Tensor \[T, C\], got list",
        id="conv-x-list",
    ),
    pytest.param(
        "causal_conv1d_varlen",
        _set(out=_from("x", lambda t: t)),
        VE,
        r"out: expected a tensor that does not overlap x, got torch\.float32 \[4, 6\] on cpu",
        id="conv-out-is-x",
    ),
    pytest.param(
        "causal_conv1d_varlen",
        _set(query_start_loc=_from("query_start_loc", lambda t: t.long())),
        VE,
        r"query_start_loc: expected dtype torch\.int32, got torch\.int64",
        id="conv-qsl-int64",
    ),
    pytest.param(
        "causal_conv1d_varlen",
        _set(activation=1),
        TE,
        r"activation: expected 'silu' or None, got int 1",
        id="conv-activation-int",
    ),
    pytest.param(
        "causal_conv1d_varlen",
        _set(weight=_from("weight", lambda t: t.double())),
        VE,
        r"weight: expected dtype in \(torch\.float32, torch\.float16, torch\.bfloat16\), "
        r"got torch\.float64",
        id="conv-weight-fp64",
    ),
    pytest.param(
        "causal_conv1d_update",
        _set(conv_states=_full(3, 6, 2, dtype=torch.float16)),
        VE,
        r"conv_states: expected the dtype of x \(torch\.float32\), got torch\.float16",
        id="conv-update-states-fp16",
    ),
    pytest.param(
        "causal_conv1d_update",
        _set(state_indices=_i32([0, 2, 1])),
        VE,
        r"state_indices: expected shape \[B\] = \[2\], got \[3\]",
        id="conv-update-slots-length",
    ),
    pytest.param(
        "torch.causal_conv1d_update",
        _set(state_indices=[0, 2]),
        TE,
        r"state_indices: expected a torch\.Tensor \[B\], got list",
        id="torch-conv-update-slots-list",
    ),
    # --- short conv (Triton) --------------------------------------------------------
    pytest.param(
        "short_conv_varlen",
        _set(weight=_rand(6, 33), conv_states=_full(3, 6, 32)),
        VE,
        r"weight: expected kernel width W <= 32, got shape \[6, 33\]",
        id="short-conv-width-33",
    ),
    pytest.param(
        "short_conv_varlen",
        _set(out=_from("b", lambda t: t)),
        VE,
        r"out: expected a tensor that does not overlap b",
        id="short-conv-out-is-b",
    ),
    pytest.param(
        "short_conv_varlen",
        _set(has_initial_state=_i32([1, 0])),
        VE,
        r"has_initial_state: expected dtype torch\.bool, got torch\.int32",
        id="short-conv-flags-int32",
    ),
    pytest.param(
        "short_conv_update",
        _set(conv_states=_full(0, 6, 2)),
        VE,
        r"conv_states: expected at least one slot \(S >= 1\) for B = 2 requests",
        id="short-conv-update-no-slots",
    ),
    pytest.param(
        "short_conv_update",
        _set(c=_from("c", lambda t: t.half())),
        VE,
        r"c: expected the dtype of x \(torch\.float32\), got torch\.float16",
        id="short-conv-update-c-fp16",
    ),
    # --- gated delta rule (Triton) --------------------------------------------------
    pytest.param(
        "chunk_gated_delta_rule_varlen",
        _set(chunk_size=8),
        VE,
        r"chunk_size: expected one of \(16, 32, 64\), got 8",
        id="gdn-chunk-8",
    ),
    pytest.param(
        "chunk_gated_delta_rule_varlen",
        _set(scale="0.25"),
        TE,
        r"scale: expected a finite float, got str '0\.25'",
        id="gdn-scale-str",
    ),
    pytest.param(
        "chunk_gated_delta_rule_varlen",
        _set(states=_full(3, 2, 16, 16, dtype=torch.float16)),
        VE,
        r"states: expected dtype torch\.float32, got torch\.float16",
        id="gdn-states-fp16",
    ),
    pytest.param(
        "chunk_gated_delta_rule_varlen",
        _set(q=_rand(4, 2, 512), k=_rand(4, 2, 512) + 1, states=_full(3, 2, 512, 16)),
        VE,
        r"k: expected key dim K in \[1, 256\], got 512",
        id="gdn-key-dim-512",
    ),
    pytest.param(
        "chunk_gated_delta_rule_varlen",
        _set(g=_from("g", lambda t: t[:, :1])),
        VE,
        r"g: expected shape \[T, H\] = \[4, 2\], got \[4, 1\]",
        id="gdn-g-heads",
    ),
    # Shared key heads: v, g, beta and states have H heads, a multiple of q/k's Hk.
    pytest.param(
        "chunk_gated_delta_rule_varlen",
        _set(v=_rand(4, 3, 16)),
        VE,
        r"v: expected a head count H that is a multiple of the key heads Hk = 2 of q and k, "
        r"got H = 3",
        id="gdn-v-heads-not-multiple-of-key-heads",
    ),
    pytest.param(
        "chunk_gated_delta_rule_varlen",
        _set(k=_from("k", lambda t: t[:, :1])),
        VE,
        r"k: expected shape \[T, Hk, K\] = \[4, 2, 16\], got \[4, 1, 16\]",
        id="gdn-k-heads-differ-from-q",
    ),
    pytest.param(
        "chunk_gated_delta_rule_varlen.shared_heads",
        _set(v=_rand(4, 5, 16)),
        VE,
        r"v: expected a head count H that is a multiple of the key heads Hk = 2 of q and k, "
        r"got H = 5",
        id="gdn-shared-v-heads-5-of-2",
    ),
    pytest.param(
        "chunk_gated_delta_rule_varlen.shared_heads",
        _set(states=_full(3, 2, 16, 16)),
        VE,
        r"states: expected shape \[S, H, K, V\] = \[\*, 4, 16, 16\], got \[3, 2, 16, 16\]",
        id="gdn-shared-states-with-key-heads",
    ),
    pytest.param(
        "chunk_gated_delta_rule_varlen.shared_heads",
        _set(beta=_from("beta", lambda t: t[:, :2])),
        VE,
        r"beta: expected shape \[T, H\] = \[4, 4\], got \[4, 2\]",
        id="gdn-shared-beta-with-key-heads",
    ),
    pytest.param(
        "torch.chunk_gated_delta_rule_varlen.shared_heads",
        _set(q=_from("q", lambda t: t[:, :1])),
        VE,
        r"k: expected shape \[T, Hk, K\] = \[4, 1, 16\], got \[4, 2, 16\]",
        id="torch-gdn-shared-q-heads-differ-from-k",
    ),
    pytest.param(
        "torch.chunk_gated_delta_rule_varlen.shared_heads",
        _set(v=_rand(4, 3, 16)),
        VE,
        r"v: expected a head count H that is a multiple of the key heads Hk = 2 of q and k, "
        r"got H = 3",
        id="torch-gdn-shared-v-heads-not-multiple",
    ),
    pytest.param(
        "fused_recurrent_gated_delta_rule_update.shared_heads",
        _set(v=_rand(2, 3, 16)),
        VE,
        r"v: expected a head count H that is a multiple of the key heads Hk = 2 of q and k, "
        r"got H = 3",
        id="gdn-decode-shared-v-heads-not-multiple",
    ),
    pytest.param(
        "fused_recurrent_gated_delta_rule_update.shared_heads",
        _set(k=_from("k", lambda t: t[:, :1])),
        VE,
        r"k: expected shape \[B, Hk, K\] = \[2, 2, 16\], got \[2, 1, 16\]",
        id="gdn-decode-shared-k-heads-differ-from-q",
    ),
    pytest.param(
        "torch.fused_recurrent_gated_delta_rule_update.shared_heads",
        _set(g=_from("g", lambda t: t[:, :2])),
        VE,
        r"g: expected shape \[B, H\] = \[2, 4\], got \[2, 2\]",
        id="torch-gdn-decode-shared-g-with-key-heads",
    ),
    pytest.param(
        "fused_recurrent_gated_delta_rule_update",
        _set(out=_from("v", lambda t: t)),
        VE,
        r"out: expected a tensor that does not overlap v",
        id="gdn-decode-out-is-v",
    ),
    pytest.param(
        "fused_recurrent_gated_delta_rule_update",
        _set(states=_full(0, 2, 16, 16)),
        VE,
        r"states: expected at least one slot \(S >= 1\) for B = 2 requests",
        id="gdn-decode-no-slots",
    ),
    # --- linear attention (Triton) --------------------------------------------------
    pytest.param(
        "chunk_linear_attention_varlen",
        _set(chunk_size=129),
        VE,
        r"chunk_size: expected an int <= 128, got 129",
        id="la-chunk-129",
    ),
    pytest.param(
        "chunk_linear_attention_varlen",
        _set(decay=[0.1, 0.2]),
        TE,
        r"decay: expected a torch\.Tensor \[H\], got list",
        id="la-decay-list",
    ),
    pytest.param(
        "chunk_linear_attention_varlen",
        _set(out=_from("q", lambda t: t)),
        VE,
        r"out: expected a tensor that does not overlap q",
        id="la-out-is-q",
    ),
    pytest.param(
        "chunk_linear_attention_varlen",
        _set(states=_from("states", lambda t: t.to(META))),
        VE,
        r"states: expected a tensor on device cpu, got device meta",
        id="la-states-meta-device",
    ),
    pytest.param(
        "linear_attention_decode",
        _set(state_indices=_from("state_indices", lambda t: t.long())),
        VE,
        r"state_indices: expected dtype torch\.int32, got torch\.int64",
        id="la-decode-slots-int64",
    ),
    # --- Mamba2 SSD (Triton, torch) -------------------------------------------------
    pytest.param(
        "ssd_chunked_varlen",
        _set(cu_chunks=[0, 1, 2]),
        TE,
        r"cu_chunks: expected an int32 torch\.Tensor \[B\+1\]=\[3\] or None, got list",
        id="ssd-cu-chunks-list",
    ),
    pytest.param(
        "ssd_chunked_varlen",
        _set(cu_chunks=_i32([0, 1])),
        VE,
        r"cu_chunks: expected int32 \[B\+1\]=\[3\] on cpu, got torch\.int32 \[2\]",
        id="ssd-cu-chunks-length",
    ),
    pytest.param(
        "ssd_chunked_varlen",
        _set(cu_chunks=_i32([0, 9, 1, 9, 2, 9])[::2]),
        VE,
        r"cu_chunks: expected unit stride, got stride 2",
        id="ssd-cu-chunks-strided",
    ),
    pytest.param(
        "ssd_chunked_varlen",
        _set(dt_softplus="yes"),
        TE,
        r"dt_softplus: expected a bool, got str 'yes'",
        id="ssd-softplus-str",
    ),
    pytest.param(
        "ssd_chunked_varlen",
        _set(B=_rand(4, 3, 16), C=_rand(4, 3, 16)),
        VE,
        r"B: expected the number of groups G to divide the number of heads H, "
        r"got G = 3, H = 2",
        id="ssd-groups-not-dividing",
    ),
    pytest.param(
        "ssd_chunked_varlen",
        _set(ssm_states=_full(3, 2, 16, 16, dtype=torch.float16)),
        VE,
        r"ssm_states: expected dtype torch\.float32, got torch\.float16",
        id="ssd-states-fp16",
    ),
    pytest.param(
        "ssd_chunked_varlen",
        _set(ssm_states=_full(0, 2, 16, 16)),
        VE,
        r"ssm_states: expected at least one slot \(S >= 1\) for B = 2 requests",
        id="ssd-states-no-slots",
    ),
    pytest.param(
        "ssd_chunked_varlen",
        _set(out=_from("x", lambda t: t)),
        VE,
        r"out: expected a tensor that does not overlap x",
        id="ssd-out-is-x",
    ),
    pytest.param(
        "ssd_chunked_varlen",
        _set(A=_from("A", lambda t: t.long())),
        VE,
        r"A: expected a floating-point dtype, got torch\.int64",
        id="ssd-A-int64",
    ),
    pytest.param(
        "selective_state_update",
        _set(dt_softplus=1),
        TE,
        r"dt_softplus: expected a bool, got int 1",
        id="ssu-softplus-int",
    ),
    pytest.param(
        "selective_state_update",
        _set(dt=_from("dt", lambda t: t.to(META))),
        VE,
        r"dt: expected a tensor on device cpu, got device meta",
        id="ssu-dt-meta-device",
    ),
    pytest.param(
        "ssd_chunk_offsets",
        _set(chunk_size=0),
        VE,
        r"chunk_size: expected an int >= 1, got 0",
        id="chunk-offsets-chunk-zero",
    ),
    pytest.param(
        "ssd_chunk_offsets",
        _set(query_start_loc=[0, 1, 4]),
        TE,
        r"query_start_loc: expected an int32 torch\.Tensor \[B\+1\], got list",
        id="chunk-offsets-qsl-list",
    ),
    pytest.param(
        "torch.ssd_chunked_varlen",
        _set(chunk_size=2.0),
        TE,
        r"chunk_size: expected an int >= 1, got 2\.0 \(float\)",
        id="torch-ssd-chunk-float",
    ),
    pytest.param(
        "torch.ssd_chunked_varlen",
        _set(state_indices=_i32([0, 0])),
        VE,
        r"state_indices: expected distinct slots within one call, got \[0, 0\]",
        id="torch-ssd-slots-repeated",
    ),
]


@pytest.mark.parametrize(("launcher", "mutate", "error", "match"), CASES)
def test_bad_input_is_rejected(
    launcher: str, mutate: Mutation, error: type[Exception], match: str
) -> None:
    function, valid = LAUNCHERS[launcher]
    kwargs = valid()
    mutate(kwargs)
    before = _snapshot(kwargs)
    with pytest.raises(error) as caught:
        function(**kwargs)
    message = str(caught.value)
    assert re.match(match, message), f"{message!r} does not start with /{match}/"
    if error is ValueError:
        # A value not allowed, not a wrong type: catchable as ValueError only.
        assert not isinstance(caught.value, TypeError), repr(caught.value)
    for path, (tensor, bits) in before.items():
        assert torch.equal(_bits(tensor), bits), f"{launcher} changed {path} before raising"


def test_type_errors_stay_value_errors() -> None:
    """Launchers raised ValueError for wrong types before: such callers keep working."""
    function, valid = LAUNCHERS["unified_attention"]
    kwargs = valid()
    kwargs["query"] = [[0.0]]
    with pytest.raises(ValueError, match=r"^query: expected a torch\.Tensor"):
        function(**kwargs)


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_valid_call_runs(launcher: str) -> None:
    """The unbroken call of every case above is accepted (and runs)."""
    function, valid = LAUNCHERS[launcher]
    function(**valid())
