"""Triton ``write_kv_cache`` and ``unified_attention`` against the pure-torch oracle.

The oracle is ``attnkit.kernels.attention.reference`` (``paged_attention``), which defines
every mask and score option. On a machine without CUDA, ``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` and the kernels run on CPU tensors under the Triton interpreter,
which is slow: shapes here are kept small on purpose. Tests marked ``gpu`` run
realistic sizes on CUDA.

Every batch is built to catch a kernel that reads memory it must not: physical blocks
are shuffled, every cache slot no request owns is NaN (block 0, the tails of last
blocks, spare blocks), blocks wholly outside a window or chunk can be "released" to the
NaN null block 0 as the runtime does, and outputs and lse start as NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from attnkit.kernels.attention.reference import paged_attention
from attnkit.kernels.attention.triton_kv_write import write_kv_cache
from attnkit.kernels.attention.triton_unified import unified_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn

# (atol, rtol) of a kernel output against the float32 oracle fed the same inputs, keyed
# by the dtype that limits accuracy: the query dtype, or FP8 for an fp8 cache.
# float32: only the order of float32 sums differs. float16/bfloat16: the output is
# rounded to the dtype and the softmax weights are rounded to it before the P.V
# product, about one ulp each.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    # fp8 cache: both sides read the same e4m3 values, so quantisation error does not
    # count; what differs is that the kernel folds k_scale into the score scale and
    # applies v_scale to the output instead of scaling the cache first, with the
    # 16-bit rounding of the weights on top. Looser than the query dtype's entry so that
    # one entry covers bf16 queries too.
    FP8: (2e-2, 2e-2),
}
# lse is float32 in both, computed from the same rounded inputs (scores differ only in
# the order of float32 sums and in the tanh formula under a soft cap).
LSE_TOLERANCE = (1e-4, 1e-5)
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# --------------------------------------------------------------------------- fixtures


@dataclass
class Batch:
    """A ragged batch whose whole context (new tokens included) is already cached."""

    query: torch.Tensor  # [T, Hq, D]; rows past query_start_loc[-1] are padding
    kv_cache: torch.Tensor  # [NB, 2, BS, Hkv, D]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, MB]
    q_lens: list[int]
    seq_len_list: list[int]
    scale: float
    k_scale: torch.Tensor | None = None  # float32 [1] for fp8 caches
    v_scale: torch.Tensor | None = None

    @property
    def num_real(self) -> int:
        return sum(self.q_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_len_list)

    def metadata(self) -> dict[str, Any]:
        return dict(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            scale=self.scale,
        )


def first_visible(q_len: int, seq_len: int, window: int | None, chunk: int | None) -> int:
    """Lowest key position any query of a causal request can see."""
    first_q = seq_len - q_len
    if window is not None:
        return max(first_q - window + 1, 0)
    if chunk is not None:
        return first_q // chunk * chunk
    return 0


def make_batch(
    q_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    seed: int = 0,
    spare_blocks: int = 3,
    pad_tokens: int = 0,
    release_before: Sequence[int] | None = None,
    query_mult: float = 1.0,
) -> Batch:
    """Build a batch with shuffled physical blocks and a NaN-filled cache.

    Block 0 stays the null block; every slot that no request owns (including the tail
    of each request's last block and block 0) holds NaN, so reading one shows up.
    ``release_before[b]``: blocks of request ``b`` that end at or before this position
    are pointed at the null block, as the runtime does with blocks that left a window.
    With ``cache_dtype=FP8`` the cache holds ``k / k_scale`` quantised, and the batch
    carries the scales as float32 tensors.
    """
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + spare_blocks
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()

    max_blocks = max(blocks_per_req, default=0) + 1  # one unused column, pointing at 0
    block_table = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    cache = torch.full(
        (num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=cache_dtype
    )
    k_scale, v_scale = kv_scales
    for b, (seq_len, nblk) in enumerate(zip(seq_lens, blocks_per_req, strict=True)):
        blocks = [physical.pop() for _ in range(nblk)]
        block_table[b, :nblk] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        if cache_dtype == FP8:
            k = (k / k_scale).clamp(-448, 448)
            v = (v / v_scale).clamp(-448, 448)
        pos = torch.arange(seq_len)
        blk = block_table[b, pos // block_size].long()
        cache[blk, 0, pos % block_size] = k.to(cache_dtype)
        cache[blk, 1, pos % block_size] = v.to(cache_dtype)
        if release_before is not None:
            released = [i for i in range(nblk) if (i + 1) * block_size <= release_before[b]]
            block_table[b, released] = 0

    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int64), 0)
    num_tokens = int(qsl[-1]) + pad_tokens
    query = (torch.randn(num_tokens, num_q_heads, head_dim, generator=gen) * query_mult).to(dtype)
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if cache_dtype == FP8:
        scales = (
            torch.tensor([k_scale], dtype=torch.float32, device=DEVICE),
            torch.tensor([v_scale], dtype=torch.float32, device=DEVICE),
        )
    return Batch(
        query=query.to(DEVICE),
        kv_cache=cache.to(DEVICE),
        query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=block_table.to(DEVICE),
        q_lens=list(q_lens),
        seq_len_list=list(seq_lens),
        scale=head_dim**-0.5,
        k_scale=scales[0],
        v_scale=scales[1],
    )


@dataclass(frozen=True)
class Options:
    """The mask and score options of one call, passed alike to kernel and oracle."""

    causal: bool = True
    sliding_window: int | None = None
    chunk_size: int | None = None
    logits_soft_cap: float | None = None
    alibi: bool = False
    sinks: bool = False

    def tensors(self, num_q_heads: int) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            causal=self.causal,
            sliding_window=self.sliding_window,
            chunk_size=self.chunk_size,
            logits_soft_cap=self.logits_soft_cap,
        )
        if self.alibi:
            # The usual geometric slopes 2**(-8 (h + 1) / Hq).
            h = torch.arange(1, num_q_heads + 1, dtype=torch.float32)
            kwargs["alibi_slopes"] = torch.exp2(-8.0 * h / num_q_heads).to(DEVICE)
        if self.sinks:
            gen = torch.Generator().manual_seed(7)
            kwargs["sinks"] = (torch.randn(num_q_heads, generator=gen) * 2).to(DEVICE)
        return kwargs


def run_and_check(
    batch: Batch, opts: Options, *, with_lse: bool = True, tolerance_key: torch.dtype
) -> None:
    """Run the kernel into NaN-filled buffers and compare with the oracle."""
    num_tokens, num_q_heads, _ = batch.query.shape
    kwargs = opts.tensors(num_q_heads)
    output = torch.full_like(batch.query, float("nan"))
    lse = torch.full((num_tokens, num_q_heads), float("nan"), device=DEVICE)
    returned = unified_attention(
        batch.query,
        batch.kv_cache,
        **batch.metadata(),
        **kwargs,
        k_scale=batch.k_scale,
        v_scale=batch.v_scale,
        output=output,
        lse=lse if with_lse else None,
    )
    assert returned is output

    expected, expected_lse = paged_attention(
        batch.query.float(),  # float32 output: the reference is not rounded
        batch.kv_cache,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        scale=batch.scale,
        **kwargs,
        k_scale=1.0 if batch.k_scale is None else float(batch.k_scale.item()),
        v_scale=1.0 if batch.v_scale is None else float(batch.v_scale.item()),
        return_lse=True,
    )
    n = batch.num_real
    atol, rtol = TOLERANCES[tolerance_key]
    assert not output[:n].isnan().any(), "an output row was never written, or read NaN"
    torch.testing.assert_close(output[:n].float(), expected[:n], atol=atol, rtol=rtol)
    # Rows past query_start_loc[-1] are padding: left untouched.
    assert output[n:].isnan().all()
    if with_lse:
        atol, rtol = LSE_TOLERANCE
        torch.testing.assert_close(lse[:n], expected_lse[:n], atol=atol, rtol=rtol)
        assert lse[n:].isnan().all()
    else:
        assert lse.isnan().all()


# ------------------------------------------------------------------ unified_attention


@dataclass(frozen=True)
class Case:
    q_lens: list[int]
    seq_lens: list[int]
    hq: int = 4
    hkv: int = 2
    d: int = 64
    bs: int = 16
    dtype: torch.dtype = torch.float32
    fp8_scales: tuple[float, float] | None = None  # fp8 cache with (k_scale, v_scale)
    opts: Options = field(default_factory=Options)
    lse: bool = True
    pad_tokens: int = 0
    release: bool = False  # point blocks outside the window/chunk at the null block
    query_mult: float = 1.0


def case(id: str, q_lens: list[int], seq_lens: list[int], **kwargs: Any) -> Any:
    opt_names = set(Options.__dataclass_fields__)
    opts = Options(**{k: kwargs.pop(k) for k in list(kwargs) if k in opt_names})
    return pytest.param(Case(q_lens, seq_lens, opts=opts, **kwargs), id=id)


# decode, full prefill, chunked prefill, context exactly at a block boundary (bs 16),
# single-token prefill.
MIXED_Q = [1, 20, 7, 3, 1]
MIXED_SEQ = [37, 20, 40, 19, 1]
# q_len > seq_len (cross attention), and an empty encoder output.
CROSS_Q = [20, 3, 5]
CROSS_SEQ = [7, 12, 0]

ATTENTION_CASES = [
    case("mixed-fp32-pad", MIXED_Q, MIXED_SEQ, pad_tokens=2),
    case("mixed-fp16-nolse", MIXED_Q, MIXED_SEQ, dtype=torch.float16, lse=False),
    case("mixed-bf16", MIXED_Q, MIXED_SEQ, dtype=torch.bfloat16, pad_tokens=1),
    case("mqa-D128-bs32-fp16", MIXED_Q, MIXED_SEQ, hq=4, hkv=1, d=128, bs=32, dtype=torch.float16),
    case("mqa-Hq8-fp32", [2, 1], [30, 17], hq=8, hkv=1),
    case("group3-bs32-fp32", MIXED_Q, MIXED_SEQ, hq=6, hkv=2, bs=32),
    case("D80-fp32", [2, 5], [32, 16], hq=2, hkv=2, d=80),
    case("D96-bf16", [3, 1], [20, 33], hq=2, hkv=1, d=96, dtype=torch.bfloat16),
    case("decode-bs32-bf16", [1, 1, 1], [1, 32, 65], hq=8, hkv=2, bs=32, dtype=torch.bfloat16),
    case("single-token", [1], [1], hq=1, hkv=1, d=16),
    # 70 queries with G=2 -> 32 tokens per tile: three tiles, the last one partial.
    case("long-prefill", [70, 1], [75, 41], hq=2, hkv=1, d=32),
    # Windows. W=1: every query sees only itself, its whole context is outside.
    case("window1-release", MIXED_Q, MIXED_SEQ, sliding_window=1, release=True),
    case(
        "window5-fp16-release",
        MIXED_Q,
        MIXED_SEQ,
        dtype=torch.float16,
        sliding_window=5,
        release=True,
    ),
    case("window16-bs32", MIXED_Q, MIXED_SEQ, bs=32, sliding_window=16, release=True),
    case("window20-long", [70, 1], [75, 41], hq=2, hkv=1, d=32, sliding_window=20, release=True),
    case("window-huge", MIXED_Q, MIXED_SEQ, sliding_window=1000),
    case(
        "window7-bf16",
        MIXED_Q,
        MIXED_SEQ,
        hq=2,
        hkv=1,
        d=128,
        dtype=torch.bfloat16,
        sliding_window=7,
    ),
    # Request 0's window starts on the last slot of a block (37 - 22 = 15): an
    # off-by-one in the first tile the loop visits drops that key.
    case("window-edge", [1, 1, 4], [37, 21, 34], sliding_window=22, release=True),
    case("window-bs64", [9, 1], [130, 70], bs=64, sliding_window=24, release=True),
    # Chunked local attention: aligned with blocks, unaligned, and query tiles that
    # straddle chunk boundaries.
    case("chunk16-release", MIXED_Q, MIXED_SEQ, chunk_size=16, release=True),
    case("chunk5-fp16", MIXED_Q, MIXED_SEQ, dtype=torch.float16, chunk_size=5, release=True),
    case(
        "chunk40-long-bs32",
        [70, 1],
        [75, 90],
        hq=2,
        hkv=1,
        d=32,
        bs=32,
        chunk_size=40,
        release=True,
    ),
    # Non-causal: encoder self-attention, queries with earlier context, cross attention.
    case("bidirectional-fp16", [9, 20, 1], [9, 20, 1], dtype=torch.float16, causal=False),
    case("noncausal-context", [3, 1], [40, 17], causal=False),
    # Several query tiles per request: every tile must see all keys, not just the
    # keys up to its own last query.
    case("bidirectional-long", [70, 3], [70, 3], hq=2, hkv=1, d=32, causal=False),
    case("cross-long", [70, 2], [40, 50], hq=2, hkv=1, d=32, causal=False),
    case("cross-qlen-gt-seqlen", CROSS_Q, CROSS_SEQ, causal=False, pad_tokens=2),
    case(
        "cross-alibi-sinks-bf16",
        CROSS_Q,
        CROSS_SEQ,
        dtype=torch.bfloat16,
        causal=False,
        alibi=True,
        sinks=True,
    ),
    # Score options. query_mult makes raw logits reach the hundreds.
    case(
        "softcap-fp16-large",
        MIXED_Q,
        MIXED_SEQ,
        dtype=torch.float16,
        logits_soft_cap=20.0,
        query_mult=40.0,
    ),
    case("softcap-fp32", MIXED_Q, MIXED_SEQ, logits_soft_cap=5.0, query_mult=4.0),
    case("alibi-fp32", MIXED_Q, MIXED_SEQ, alibi=True),
    case(
        "alibi-window-fp16", MIXED_Q, MIXED_SEQ, dtype=torch.float16, alibi=True, sliding_window=9
    ),
    case("sinks-fp32", MIXED_Q, MIXED_SEQ, sinks=True, pad_tokens=1),
    case("sinks-chunk-bf16", MIXED_Q, MIXED_SEQ, dtype=torch.bfloat16, sinks=True, chunk_size=8),
    case(
        "all-options-fp16",
        MIXED_Q,
        MIXED_SEQ,
        dtype=torch.float16,
        logits_soft_cap=10.0,
        alibi=True,
        sinks=True,
        sliding_window=12,
        release=True,
        query_mult=8.0,
    ),
    # fp8 caches; k_scale > 1 puts many keys in e4m3's subnormal range.
    case("fp8-fp16", MIXED_Q, MIXED_SEQ, dtype=torch.float16, fp8_scales=(0.02, 3.0)),
    case(
        "fp8-bf16-window-bs32",
        MIXED_Q,
        MIXED_SEQ,
        bs=32,
        dtype=torch.bfloat16,
        fp8_scales=(4.0, 0.05),
        sliding_window=10,
        release=True,
    ),
    case(
        "fp8-fp32-softcap-alibi-sinks",
        MIXED_Q,
        MIXED_SEQ,
        fp8_scales=(0.5, 0.25),
        logits_soft_cap=8.0,
        alibi=True,
        sinks=True,
        query_mult=3.0,
    ),
    case(
        "fp8-noncausal",
        CROSS_Q,
        CROSS_SEQ,
        dtype=torch.float16,
        fp8_scales=(0.1, 0.1),
        causal=False,
    ),
    # Large blocks are processed in sub-tiles (64 keys up to D=128, 32 above).
    case("bs64-D192-fp16", [5, 1], [70, 129], hq=2, hkv=1, d=192, bs=64, dtype=torch.float16),
    case("bs128-D128-bf16", [4, 1], [140, 128], hq=2, hkv=1, d=128, bs=128, dtype=torch.bfloat16),
    case("bs128-D256-fp16", [3, 1], [100, 129], hq=2, hkv=2, d=256, bs=128, dtype=torch.float16),
    case(
        "bs64-D256-fp8",
        [2, 1],
        [65, 64],
        hq=2,
        hkv=1,
        d=256,
        bs=64,
        dtype=torch.float16,
        fp8_scales=(0.05, 0.5),
    ),
]


@pytest.mark.parametrize("c", ATTENTION_CASES)
def test_unified_attention_matches_oracle(c: Case) -> None:
    release_before = None
    if c.release:
        release_before = [
            first_visible(q, s, c.opts.sliding_window, c.opts.chunk_size)
            for q, s in zip(c.q_lens, c.seq_lens, strict=True)
        ]
    batch = make_batch(
        c.q_lens,
        c.seq_lens,
        num_q_heads=c.hq,
        num_kv_heads=c.hkv,
        head_dim=c.d,
        block_size=c.bs,
        dtype=c.dtype,
        cache_dtype=FP8 if c.fp8_scales is not None else None,
        kv_scales=c.fp8_scales or (1.0, 1.0),
        pad_tokens=c.pad_tokens,
        release_before=release_before,
        query_mult=c.query_mult,
    )
    if c.release:
        assert bool((batch.block_table == 0).sum() > len(c.q_lens)), "nothing was released"
    run_and_check(
        batch, c.opts, with_lse=c.lse, tolerance_key=FP8 if c.fp8_scales is not None else c.dtype
    )


def test_window_huge_equals_no_window() -> None:
    batch = make_batch(
        MIXED_Q,
        MIXED_SEQ,
        num_q_heads=2,
        num_kv_heads=2,
        head_dim=16,
        block_size=16,
        dtype=torch.float32,
    )
    plain = unified_attention(batch.query, batch.kv_cache, **batch.metadata())
    windowed = unified_attention(
        batch.query, batch.kv_cache, sliding_window=batch.max_seq_len, **batch.metadata()
    )
    torch.testing.assert_close(windowed, plain, atol=0, rtol=0)


def test_unit_scales_change_nothing_for_16bit_cache() -> None:
    batch = make_batch(
        [3, 1],
        [10, 20],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=16,
        block_size=16,
        dtype=torch.float16,
    )
    one = torch.ones(1, device=DEVICE)
    plain = unified_attention(batch.query, batch.kv_cache, **batch.metadata())
    scaled = unified_attention(
        batch.query, batch.kv_cache, k_scale=one, v_scale=one[0], **batch.metadata()
    )
    torch.testing.assert_close(scaled, plain, atol=0, rtol=0)


def test_strided_query_output_lse_and_untouched_padding_rows() -> None:
    """Query/output/lse as views into wider buffers; rows past query_start_loc[-1] stay put."""
    hq, hkv, d = 4, 2, 32
    batch = make_batch(
        [3, 1],
        [13, 21],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=16,
        dtype=torch.float16,
    )
    num_real = batch.query.shape[0]
    num_padded = num_real + 2
    # A fused qkv buffer: query is a non-contiguous view of its first Hq heads.
    qkv = torch.randn(num_padded, hq + 2 * hkv, d, device=DEVICE).to(torch.float16)
    qkv[:num_real, :hq] = batch.query
    query = qkv[:, :hq]
    out_buffer = torch.full(
        (num_padded, hq, 2 * d), float("nan"), dtype=torch.float16, device=DEVICE
    )
    output = out_buffer[:, :, :d]
    lse_buffer = torch.full((hq, 2 * num_padded), float("nan"), device=DEVICE)
    lse = lse_buffer[:, ::2].t()  # [T, Hq] with strides (2, 2T)
    assert not query.is_contiguous()
    assert not output.is_contiguous()
    assert not lse.is_contiguous()
    unified_attention(query, batch.kv_cache, **batch.metadata(), output=output, lse=lse)
    expected, expected_lse = paged_attention(
        batch.query.float(),
        batch.kv_cache,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        scale=batch.scale,
        return_lse=True,
    )
    atol, rtol = TOLERANCES[torch.float16]
    torch.testing.assert_close(output[:num_real].float(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse[:num_real], expected_lse, atol=1e-4, rtol=1e-5)
    assert output[num_real:].isnan().all()
    assert out_buffer[:, :, d:].isnan().all()
    assert lse[num_real:].isnan().all()
    assert lse_buffer[:, 1::2].isnan().all()


def test_allocates_output_when_not_given() -> None:
    batch = make_batch(
        [2],
        [5],
        num_q_heads=1,
        num_kv_heads=1,
        head_dim=16,
        block_size=16,
        dtype=torch.bfloat16,
    )
    out = unified_attention(batch.query, batch.kv_cache, **batch.metadata())
    assert out.shape == batch.query.shape
    assert out.dtype == torch.bfloat16
    expected = paged_attention(
        batch.query.float(),
        batch.kv_cache,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        scale=batch.scale,
    )
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def test_empty_batch_returns_without_launch() -> None:
    cache = torch.zeros(2, 2, 16, 1, 16, device=DEVICE)
    out = unified_attention(
        torch.empty(0, 1, 16, device=DEVICE),
        cache,
        query_start_loc=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.zeros(0, dtype=torch.int32, device=DEVICE),
        block_table=torch.zeros(0, 1, dtype=torch.int32, device=DEVICE),
        max_query_len=0,
        max_seq_len=0,
        scale=1.0,
        lse=torch.empty(0, 1, device=DEVICE),
    )
    assert out.shape == (0, 1, 16)


def test_fp8_cache_decodes_every_bit_pattern_exactly() -> None:
    """One key, one query: the output is the dequantised value row, bit for bit.

    D = 256 holds all 256 e4m3fn codes, NaN (0x7F, 0xFF) and subnormals included.
    """
    cache = torch.full((2, 2, 16, 1, 256), float("nan"), dtype=FP8)
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    cache[1, 0, 0] = torch.zeros(256, dtype=FP8)
    cache[1, 1, 0] = codes
    query = torch.randn(1, 1, 256)
    one = torch.ones(1)
    out = unified_attention(
        query.to(DEVICE),
        cache.to(DEVICE),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([1], dtype=torch.int32, device=DEVICE),
        block_table=torch.tensor([[1]], dtype=torch.int32, device=DEVICE),
        max_query_len=1,
        max_seq_len=1,
        scale=1.0,
        k_scale=one.to(DEVICE),
        v_scale=one.to(DEVICE),
    )
    torch.testing.assert_close(out[0, 0].cpu(), codes.float(), atol=0, rtol=0, equal_nan=True)


@settings(max_examples=10, deadline=None)
@given(
    data=st.data(),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    block_size=st.sampled_from([16, 32, 64]),
    causal=st.booleans(),
    mask=st.sampled_from(["none", "window", "chunk"]),
    softcap=st.sampled_from([None, 5.0]),
    alibi=st.booleans(),
    sinks=st.booleans(),
)
def test_unified_attention_random_ragged_batches(
    data: st.DataObject,
    num_kv_heads: int,
    group: int,
    block_size: int,
    causal: bool,
    mask: str,
    softcap: float | None,
    alibi: bool,
    sinks: bool,
) -> None:
    num_requests = data.draw(st.integers(min_value=1, max_value=4), label="B")
    q_lens = data.draw(
        st.lists(st.integers(1, 18), min_size=num_requests, max_size=num_requests),
        label="q_lens",
    )
    if causal:
        ctx_lens = data.draw(
            st.lists(st.integers(0, 40), min_size=num_requests, max_size=num_requests),
            label="ctx_lens",
        )
        seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    else:  # any number of keys, fewer than queries included
        seq_lens = data.draw(
            st.lists(st.integers(0, 40), min_size=num_requests, max_size=num_requests),
            label="seq_lens",
        )
    window = chunk = None
    if causal and mask == "window":
        window = data.draw(st.integers(1, 40), label="window")
    if causal and mask == "chunk":
        chunk = data.draw(st.integers(1, 40), label="chunk")
    release = [first_visible(q, s, window, chunk) for q, s in zip(q_lens, seq_lens, strict=True)]
    batch = make_batch(
        q_lens,
        seq_lens,
        num_q_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        block_size=block_size,
        dtype=torch.float32,
        seed=data.draw(st.integers(0, 2**16), label="seed"),
        pad_tokens=data.draw(st.integers(0, 2), label="pad_tokens"),
        release_before=release if causal else None,
        query_mult=3.0 if softcap is not None else 1.0,
    )
    opts = Options(
        causal=causal,
        sliding_window=window,
        chunk_size=chunk,
        logits_soft_cap=softcap,
        alibi=alibi,
        sinks=sinks,
    )
    run_and_check(batch, opts, tolerance_key=torch.float32)


# --------------------------------------------------------------------- write_kv_cache


def _reference_write(
    cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    expected = cache.clone()
    block_size = cache.shape[2]
    keep = (slots >= 0) & (slots < cache.shape[0] * block_size)
    s = slots[keep]
    expected[s // block_size, 0, s % block_size] = key[keep].to(cache.dtype)
    expected[s // block_size, 1, s % block_size] = value[keep].to(cache.dtype)
    return expected


def _random_slots(num_tokens: int, num_blocks: int, block_size: int, seed: int) -> torch.Tensor:
    """Distinct slots outside block 0, every third token marked as padding (-1)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens]
    slots = slots + block_size
    slots[::3] = -1
    return slots


@pytest.mark.parametrize(
    ("hkv", "d", "bs", "dtype"),
    [
        pytest.param(2, 64, 16, torch.float32, id="Hkv2-D64-bs16-fp32"),
        pytest.param(1, 128, 32, torch.float16, id="Hkv1-D128-bs32-fp16"),
        pytest.param(3, 80, 16, torch.bfloat16, id="Hkv3-D80-bs16-bf16"),
        pytest.param(1, 96, 128, torch.float16, id="Hkv1-D96-bs128-fp16"),
    ],
)
def test_write_kv_cache_matches_index_put(hkv: int, d: int, bs: int, dtype: torch.dtype) -> None:
    num_tokens, num_blocks = 11, 4
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=gen).to(dtype)
    key = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
    value = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
    slots = _random_slots(num_tokens, num_blocks, bs, seed=2)
    expected = _reference_write(cache, key, value, slots)

    cache_dev = cache.to(DEVICE)
    write_kv_cache(key.to(DEVICE), value.to(DEVICE), cache_dev, slots.to(DEVICE))
    assert torch.equal(cache_dev.cpu(), expected)
    # Padding tokens wrote nothing: the cache differs from the start only at real slots.
    changed = (cache_dev.cpu() != cache).flatten(2).any(-1).any(1).flatten()
    assert set(changed.nonzero().flatten().tolist()) <= set(slots[slots >= 0].tolist())


def test_write_kv_cache_strided_inputs_and_out_of_range_slots() -> None:
    hkv, d, bs, num_blocks = 2, 32, 16, 3
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 1 + 2 * hkv, d, generator=gen)
    key, value = qkv[:, 1 : 1 + hkv], qkv[:, 1 + hkv :]
    assert not key.is_contiguous()
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=gen)
    slots = torch.tensor([17, -1, num_blocks * bs, 40, -5], dtype=torch.int64)
    expected = _reference_write(cache, key, value, slots)
    cache_dev = cache.to(DEVICE)
    write_kv_cache(key.to(DEVICE), value.to(DEVICE), cache_dev, slots.to(DEVICE))
    assert torch.equal(cache_dev.cpu(), expected)


def _fp8_edge_values() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours (ties), values spread
    over 2**-14 .. 2**10 (subnormals, out of range), infinities and NaN."""
    gen = torch.Generator().manual_seed(4)
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    spread = torch.randn(1500, generator=gen) * torch.exp2(
        torch.randint(-14, 11, (1500,), generator=gen).float()
    )
    special = torch.tensor([500.0, -1000.0, 464.0, -449.0, math.inf, -math.inf, math.nan, 1e-30])
    return torch.cat([grid, (grid[1:] + grid[:-1]) / 2, spread, special])


@pytest.mark.parametrize(
    ("src_dtype", "k_scale", "v_scale"),
    [
        pytest.param(torch.float32, 1.0, 0.37, id="fp32-scales-1-0.37"),
        pytest.param(torch.float16, 0.05, 3.0, id="fp16-scales-0.05-3"),
        pytest.param(torch.bfloat16, 2.0, 0.125, id="bf16-scales-2-0.125"),
    ],
)
def test_write_kv_cache_fp8_matches_torch_cast_bit_for_bit(
    src_dtype: torch.dtype, k_scale: float, v_scale: float
) -> None:
    """Quantisation is clamp(x / scale, -448, 448) cast with torch's rounding (RTNE)."""
    hkv, d, bs = 2, 64, 16
    values = _fp8_edge_values().to(src_dtype)
    num_tokens = -(-values.numel() // (hkv * d))
    flat = torch.zeros(num_tokens * hkv * d, dtype=src_dtype)
    flat[: values.numel()] = values
    key = flat.reshape(num_tokens, hkv, d)
    value = key.flip(0)
    num_blocks = num_tokens // bs + 2
    cache = torch.full((num_blocks, 2, bs, hkv, d), float("nan"), dtype=FP8)
    slots = _random_slots(num_tokens, num_blocks, bs, seed=5)

    def quantise(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x.float() / torch.tensor(scale)).clamp(-448, 448).to(FP8)

    expected = _reference_write(cache, quantise(key, k_scale), quantise(value, v_scale), slots)
    cache_dev = cache.to(DEVICE)
    write_kv_cache(
        key.to(DEVICE),
        value.to(DEVICE),
        cache_dev,
        slots.to(DEVICE),
        k_scale=torch.tensor([k_scale], device=DEVICE),
        v_scale=torch.tensor(v_scale, device=DEVICE),
    )
    got = cache_dev.cpu()
    both_nan = got.float().isnan() & expected.float().isnan()
    mismatch = (got.view(torch.uint8) != expected.view(torch.uint8)) & ~both_nan
    assert not mismatch.any(), f"{int(mismatch.sum())} codes differ from torch's cast"


def test_write_kv_cache_unit_scales_on_16bit_cache_are_exact() -> None:
    gen = torch.Generator().manual_seed(6)
    cache = torch.randn(3, 2, 16, 1, 16, generator=gen).to(torch.bfloat16)
    key = torch.randn(4, 1, 16, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([16, 17, -1, 40])
    expected = _reference_write(cache, key, key, slots)
    cache_dev = cache.to(DEVICE)
    one = torch.ones(1, device=DEVICE)
    write_kv_cache(key.to(DEVICE), key.to(DEVICE), cache_dev, slots.to(DEVICE), k_scale=one)
    assert torch.equal(cache_dev.cpu(), expected)
    write_kv_cache(key.to(DEVICE), key.to(DEVICE), cache_dev, slots.to(DEVICE), v_scale=one)
    assert torch.equal(cache_dev.cpu(), expected)


def _write_new_tokens(batch: Batch, key_source: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Slots and K/V of each request's last q_len tokens, taken from ``key_source``."""
    table = batch.block_table.cpu().long()
    bs = batch.kv_cache.shape[2]
    slot_list = []
    for b, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_len_list, strict=True)):
        pos = torch.arange(seq_len - q_len, seq_len)
        slot_list.append(table[b, pos // bs] * bs + pos % bs)
    slots = torch.cat(slot_list)
    kv = key_source[slots // bs, :, slots % bs]  # [T, 2, Hkv, D]
    return slots, kv[:, 0], kv[:, 1]


@pytest.mark.parametrize(
    ("dtype", "fp8"),
    [
        pytest.param(torch.float16, False, id="fp16"),
        pytest.param(torch.bfloat16, True, id="fp8-bf16"),
    ],
)
def test_write_then_attend(dtype: torch.dtype, fp8: bool) -> None:
    """Context prefilled in the cache, this step's tokens written by the kernel."""
    batch = make_batch(
        [1, 6],
        [21, 15],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=dtype,
        cache_dtype=FP8 if fp8 else None,
        kv_scales=(0.03, 0.2) if fp8 else (1.0, 1.0),
    )
    bs = batch.kv_cache.shape[2]
    cache = batch.kv_cache.cpu()
    # The new tokens in full precision: the dequantised cache for fp8, whose
    # re-quantisation by the kernel must give back the same codes.
    source = cache.float()
    if fp8:
        assert batch.k_scale is not None
        assert batch.v_scale is not None
        source[:, 0] *= batch.k_scale.cpu()
        source[:, 1] *= batch.v_scale.cpu()
    slots, new_k, new_v = _write_new_tokens(batch, source)
    # Forget the new tokens, then let write_kv_cache put them back.
    cache[slots // bs, :, slots % bs] = float("nan")
    batch.kv_cache = cache.to(DEVICE)
    write_kv_cache(
        new_k.to(dtype).to(DEVICE) if not fp8 else new_k.to(DEVICE),
        new_v.to(dtype).to(DEVICE) if not fp8 else new_v.to(DEVICE),
        batch.kv_cache,
        slots.to(DEVICE),
        k_scale=batch.k_scale,
        v_scale=batch.v_scale,
    )
    run_and_check(batch, Options(), tolerance_key=FP8 if fp8 else dtype)


# --------------------------------------------------------------------- validation

_Kwargs = dict[str, Any]


def _valid_attention_args() -> _Kwargs:
    batch = make_batch(
        [2, 1],
        [5, 5],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=16,
        dtype=torch.float32,
    )
    return dict(query=batch.query, kv_cache=batch.kv_cache, **batch.metadata())


def _set(**changes: Callable[[_Kwargs], Any]) -> Callable[[_Kwargs], None]:
    def mutate(args: _Kwargs) -> None:
        for name, make in changes.items():
            args[name] = make(args)

    return mutate


META = torch.device("meta")


def _fp8(a: _Kwargs) -> torch.Tensor:
    return torch.as_tensor(a["kv_cache"].to(FP8))


def _f32(*shape: int) -> Callable[[_Kwargs], torch.Tensor]:
    return lambda a: torch.zeros(*shape, device=DEVICE)


ATTENTION_ERRORS = [
    pytest.param(_set(query=lambda a: a["query"][0]), "query: expected shape", id="query-2d"),
    pytest.param(
        _set(query=lambda a: a["query"].double(), kv_cache=lambda a: a["kv_cache"].double()),
        "query: expected dtype",
        id="query-fp64",
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"][:, 0]), "kv_cache: expected shape", id="cache-4d"
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"].half()),
        r"kv_cache: expected dtype torch.float32 \(the query dtype\) or torch.float8_e4m3fn",
        id="cache-dtype",
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"].to(torch.float8_e5m2)),
        "kv_cache: expected dtype",
        id="cache-fp8-e5m2",
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"].to(META)),
        "kv_cache: expected device",
        id="cache-device",
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"].transpose(3, 2).contiguous().transpose(3, 2)),
        "kv_cache: expected a contiguous",
        id="cache-noncontiguous",
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"][..., :8].contiguous()),
        "kv_cache: expected head size 16",
        id="cache-headdim",
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"][:, :, :8].contiguous()),
        "kv_cache: expected block size",
        id="blocksize-8",
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"].repeat(1, 1, 16, 1, 1)),
        r"kv_cache: expected block size in \(16, 32, 64, 128\), got 256",
        id="blocksize-256",
    ),
    pytest.param(
        _set(
            query=lambda a: a["query"][..., :8],
            kv_cache=lambda a: a["kv_cache"][..., :8].contiguous(),
        ),
        r"query: expected head size in \[16, 256\]",
        id="headdim-8",
    ),
    pytest.param(
        _set(query=lambda a: a["query"][:, :3]),
        "kv_cache: expected a kv head count dividing",
        id="heads-not-divisible",
    ),
    pytest.param(
        _set(seq_lens=lambda a: a["seq_lens"].long()),
        "seq_lens: expected dtype torch.int32",
        id="seq-lens-int64",
    ),
    pytest.param(
        _set(seq_lens=lambda a: a["seq_lens"][None]),
        r"seq_lens: expected shape \[B\]",
        id="seq-lens-2d",
    ),
    pytest.param(
        _set(query_start_loc=lambda a: a["query_start_loc"][:-1]),
        r"query_start_loc: expected shape \[3\]",
        id="qsl-length",
    ),
    pytest.param(
        _set(query_start_loc=lambda a: a["query_start_loc"].to(META)),
        "query_start_loc: expected device",
        id="qsl-device",
    ),
    pytest.param(
        _set(block_table=lambda a: a["block_table"][:1]),
        r"block_table: expected shape \[2, \*\]",
        id="table-rows",
    ),
    pytest.param(
        _set(block_table=lambda a: a["block_table"].repeat(1, 2)[:, ::2]),
        "block_table: expected unit stride",
        id="table-strided",
    ),
    pytest.param(
        _set(max_seq_len=lambda a: 100),
        "block_table: expected at least 7 columns",
        id="table-too-narrow",
    ),
    pytest.param(
        _set(max_query_len=lambda a: -1),
        "max_query_len: expected an int >= 0",
        id="max-query-len-negative",
    ),
    pytest.param(
        _set(max_query_len=lambda a: 2.0),
        "max_query_len: expected an int, got float",
        id="max-query-len-float",
    ),
    pytest.param(
        _set(max_seq_len=lambda a: 1),
        "max_seq_len: expected an int >= 2",
        id="max-seq-len-below-query",
    ),
    pytest.param(
        _set(scale=lambda a: float("nan")), "scale: expected a finite float", id="scale-nan"
    ),
    pytest.param(
        _set(causal=lambda a: 1), "causal: expected a bool, got int", id="causal-not-bool"
    ),
    pytest.param(
        _set(sliding_window=lambda a: 0), "sliding_window: expected an int >= 1", id="window-zero"
    ),
    pytest.param(
        _set(sliding_window=lambda a: True),
        "sliding_window: expected an int, got bool",
        id="window-bool",
    ),
    pytest.param(_set(chunk_size=lambda a: 0), "chunk_size: expected an int >= 1", id="chunk-zero"),
    pytest.param(
        _set(chunk_size=lambda a: 4.0), "chunk_size: expected an int, got float", id="chunk-float"
    ),
    pytest.param(
        _set(sliding_window=lambda a: 4, chunk_size=lambda a: 8),
        "sliding_window, chunk_size: expected at most one of them",
        id="window-and-chunk",
    ),
    pytest.param(
        _set(causal=lambda a: False, sliding_window=lambda a: 4),
        "sliding_window: expected None with causal=False",
        id="window-noncausal",
    ),
    pytest.param(
        _set(causal=lambda a: False, chunk_size=lambda a: 4),
        "chunk_size: expected None with causal=False",
        id="chunk-noncausal",
    ),
    pytest.param(
        _set(logits_soft_cap=lambda a: 0.0),
        "logits_soft_cap: expected a finite float > 0",
        id="softcap-zero",
    ),
    pytest.param(
        _set(logits_soft_cap=lambda a: math.inf),
        "logits_soft_cap: expected a finite float > 0",
        id="softcap-inf",
    ),
    pytest.param(
        _set(alibi_slopes=_f32(3)),
        r"alibi_slopes: expected shape \[4\], got \[3\]",
        id="alibi-shape",
    ),
    pytest.param(
        _set(alibi_slopes=lambda a: torch.zeros(4, dtype=torch.int32, device=DEVICE)),
        r"alibi_slopes: expected dtype in \(torch.float32, torch.float16, torch.bfloat16, "
        r"torch.float64\), got torch.int32",
        id="alibi-dtype",
    ),
    pytest.param(
        _set(alibi_slopes=lambda a: torch.zeros(4, device=META)),
        "alibi_slopes: expected device",
        id="alibi-device",
    ),
    pytest.param(
        _set(sinks=_f32(4, 1)), r"sinks: expected shape \[4\], got \[4, 1\]", id="sinks-shape"
    ),
    pytest.param(
        _set(sinks=lambda a: torch.zeros(4, dtype=torch.int32, device=DEVICE)),
        "sinks: expected dtype in",
        id="sinks-dtype",
    ),
    pytest.param(
        _set(sinks=lambda a: [0.0] * 4),
        r"sinks: expected a float torch.Tensor \[Hq\]=\[4\] or None, got list",
        id="sinks-list",
    ),
    pytest.param(
        _set(lse=_f32(3, 3)), r"lse: expected shape \[3, 4\], got \[3, 3\]", id="lse-shape"
    ),
    pytest.param(
        _set(lse=lambda a: torch.zeros(3, 4, device=DEVICE).half()),
        "lse: expected dtype torch.float32",
        id="lse-dtype",
    ),
    pytest.param(
        _set(lse=lambda a: torch.zeros(3, 4, device=META)), "lse: expected device", id="lse-device"
    ),
    pytest.param(
        _set(kv_cache=_fp8),
        "k_scale: expected a float or a one-element torch.float32 tensor with a "
        "torch.float8_e4m3fn",
        id="fp8-without-scales",
    ),
    pytest.param(
        _set(kv_cache=_fp8, k_scale=_f32(1)),
        "v_scale: expected a float or a one-element torch.float32 tensor with a "
        "torch.float8_e4m3fn",
        id="fp8-without-v-scale",
    ),
    pytest.param(
        _set(kv_cache=_fp8, k_scale=lambda a: 0.0, v_scale=_f32(1)),
        r"k_scale: expected a float > 0, got 0\.0",
        id="scale-python-float-zero",
    ),
    pytest.param(
        _set(kv_cache=_fp8, k_scale=_f32(1), v_scale=_f32(3)),
        r"v_scale: expected a torch.float32 tensor of shape \[\] or \[1\] \(per tensor\) "
        r"or \[Hkv\]=\[2\] \(per K/V head\), got torch.float32 \[3\]",
        id="scale-two-elements",
    ),
    pytest.param(
        _set(k_scale=lambda a: torch.ones(1, device=DEVICE).half()),
        "k_scale: expected a one-element torch.float32 tensor",
        id="scale-dtype",
    ),
    pytest.param(
        _set(v_scale=lambda a: torch.ones(1, device=META)),
        "v_scale: expected device",
        id="scale-device",
    ),
    pytest.param(
        _set(output=lambda a: torch.empty_like(a["query"][:1])),
        "output: expected shape",
        id="output-shape",
    ),
    pytest.param(
        _set(output=lambda a: torch.empty_like(a["query"]).half()),
        "output: expected dtype",
        id="output-dtype",
    ),
    pytest.param(
        _set(output=lambda a: torch.empty_like(a["query"], device=META)),
        "output: expected device",
        id="output-device",
    ),
]


@pytest.mark.parametrize(("mutate", "match"), ATTENTION_ERRORS)
def test_unified_attention_rejects(mutate: Callable[[_Kwargs], None], match: str) -> None:
    args = _valid_attention_args()
    mutate(args)
    query, kv_cache = args.pop("query"), args.pop("kv_cache")
    with pytest.raises(ValueError, match=match):
        unified_attention(query, kv_cache, **args)


def test_noncausal_accepts_more_queries_than_keys() -> None:
    """max_seq_len < max_query_len is only an error for causal attention."""
    args = _valid_attention_args()
    args["max_seq_len"] = 1
    query, kv_cache = args.pop("query"), args.pop("kv_cache")
    unified_attention(query, kv_cache, causal=False, **args)


def _valid_write_args() -> _Kwargs:
    return dict(
        key=torch.zeros(3, 2, 16, device=DEVICE),
        value=torch.zeros(3, 2, 16, device=DEVICE),
        kv_cache=torch.zeros(2, 2, 16, 2, 16, device=DEVICE),
        slot_mapping=torch.tensor([16, -1, 17], device=DEVICE),
    )


WRITE_ERRORS = [
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"][:, 0]), "kv_cache: expected shape", id="cache-4d"
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"].long()), "kv_cache: expected dtype in", id="cache-int"
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"].transpose(3, 2).contiguous().transpose(3, 2)),
        "kv_cache: expected a contiguous",
        id="cache-noncontiguous",
    ),
    pytest.param(
        _set(key=lambda a: a["key"][:, :1]), r"key: expected shape \[T, 2, 16\]", id="key-heads"
    ),
    pytest.param(
        _set(value=lambda a: a["value"].half()),
        "value: expected dtype torch.float32",
        id="value-dtype",
    ),
    pytest.param(
        _set(kv_cache=_fp8, k_scale=_f32(1), v_scale=_f32(1), key=lambda a: a["key"].double()),
        "key: expected dtype in .* for a torch.float8_e4m3fn kv_cache",
        id="fp8-key-fp64",
    ),
    pytest.param(
        _set(kv_cache=_fp8, k_scale=_f32(1), v_scale=_f32(1), value=lambda a: a["value"].half()),
        r"value: expected dtype torch.float32 \(the key dtype\)",
        id="fp8-value-dtype-differs",
    ),
    pytest.param(_set(key=lambda a: a["key"].to(META)), "key: expected device", id="key-device"),
    pytest.param(
        _set(value=lambda a: a["value"][:2]), "value: expected 3 tokens", id="value-tokens"
    ),
    pytest.param(
        _set(slot_mapping=lambda a: a["slot_mapping"].int()),
        "slot_mapping: expected dtype torch.int64",
        id="slots-int32",
    ),
    pytest.param(
        _set(slot_mapping=lambda a: a["slot_mapping"][:2]),
        r"slot_mapping: expected shape \[3\]",
        id="slots-length",
    ),
    pytest.param(
        _set(slot_mapping=lambda a: a["slot_mapping"].to(META)),
        "slot_mapping: expected device",
        id="slots-device",
    ),
    pytest.param(
        _set(kv_cache=_fp8),
        "k_scale: expected a one-element torch.float32 tensor with a torch.float8_e4m3fn",
        id="fp8-without-scales",
    ),
    pytest.param(
        _set(kv_cache=_fp8, k_scale=_f32(1)),
        "v_scale: expected a one-element torch.float32 tensor with a torch.float8_e4m3fn",
        id="fp8-without-v-scale",
    ),
    pytest.param(
        _set(k_scale=lambda a: 1.0),
        "k_scale: expected a one-element torch.float32 tensor or None, got float",
        id="scale-python-float",
    ),
    pytest.param(
        _set(v_scale=_f32(1, 1)),
        r"v_scale: expected a one-element torch.float32 tensor of shape \[\] or \[1\]",
        id="scale-2d",
    ),
    pytest.param(
        _set(k_scale=lambda a: torch.ones(1, device=META)),
        "k_scale: expected device",
        id="scale-device",
    ),
]


@pytest.mark.parametrize(("mutate", "match"), WRITE_ERRORS)
def test_write_kv_cache_rejects(mutate: Callable[[_Kwargs], None], match: str) -> None:
    args = _valid_write_args()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        write_kv_cache(**args)


# --------------------------------------------------------------------------- GPU

GPU_CASES = [
    pytest.param(torch.bfloat16, None, 16, Options(), id="bf16-bs16"),
    pytest.param(
        torch.bfloat16,
        (0.02, 0.05),
        64,
        Options(sliding_window=1024, sinks=True),
        id="fp8-bs64-window-sinks",
    ),
    pytest.param(
        torch.float16,
        (0.5, 0.5),
        128,
        Options(logits_soft_cap=30.0, alibi=True),
        id="fp8-fp16-bs128-softcap-alibi",
    ),
    pytest.param(torch.float16, None, 32, Options(chunk_size=512), id="fp16-bs32-chunk"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("dtype", "fp8_scales", "block_size", "opts"), GPU_CASES)
def test_unified_attention_realistic_sizes_on_gpu(
    dtype: torch.dtype,
    fp8_scales: tuple[float, float] | None,
    block_size: int,
    opts: Options,
) -> None:
    """B=8 mixed decode and chunked prefill over 1k-4k contexts, D=128, GQA 4:1."""
    q_lens = [1, 1, 1, 1, 1, 37, 128, 300]
    seq_lens = [1024, 2049, 3000, 4096, 1500, 2048, 4000, 3333]
    release = [
        first_visible(q, s, opts.sliding_window, opts.chunk_size)
        for q, s in zip(q_lens, seq_lens, strict=True)
    ]
    batch = make_batch(
        q_lens,
        seq_lens,
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        block_size=block_size,
        dtype=dtype,
        cache_dtype=FP8 if fp8_scales is not None else None,
        kv_scales=fp8_scales or (1.0, 1.0),
        pad_tokens=3,
        release_before=release,
        query_mult=4.0 if opts.logits_soft_cap is not None else 1.0,
    )
    run_and_check(batch, opts, tolerance_key=FP8 if fp8_scales is not None else dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_write_kv_cache_fp8_large_on_gpu() -> None:
    hkv, d, bs, num_tokens = 8, 128, 16, 4096
    gen = torch.Generator().manual_seed(8)
    key = torch.randn(num_tokens, hkv, d, generator=gen).to(torch.bfloat16) * 30
    value = torch.randn(num_tokens, hkv, d, generator=gen).to(torch.bfloat16)
    num_blocks = num_tokens // bs + 2
    cache = torch.full((num_blocks, 2, bs, hkv, d), float("nan"), dtype=FP8)
    slots = _random_slots(num_tokens, num_blocks, bs, seed=9)
    ks, vs = 0.07, 0.004
    expected = _reference_write(
        cache,
        (key.float() / torch.tensor(ks)).clamp(-448, 448).to(FP8),
        (value.float() / torch.tensor(vs)).clamp(-448, 448).to(FP8),
        slots,
    )
    cache_dev = cache.cuda()
    write_kv_cache(
        key.cuda(),
        value.cuda(),
        cache_dev,
        slots.cuda(),
        k_scale=torch.tensor([ks], device="cuda"),
        v_scale=torch.tensor([vs], device="cuda"),
    )
    got = cache_dev.cpu()
    both_nan = got.float().isnan() & expected.float().isnan()
    assert not ((got.view(torch.uint8) != expected.view(torch.uint8)) & ~both_nan).any()
