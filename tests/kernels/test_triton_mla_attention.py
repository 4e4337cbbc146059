"""Triton absorbed-form MLA (``mla_attention``, ``write_mla_latents``) against a dense
float64 reference written here.

The reference attends each request's query rows to the latents it wrote (gathered from
the request itself, not from the cache): score ``scale * q . latent`` over the whole
latent (``D = R + P`` channels), causal (and windowed) mask, softmax, values = the first
``R`` channels. The cache the kernel reads has shuffled physical blocks and NaN in every
slot that was never written, so a kernel that reads outside ``[window start, seq_len)``
or assumes contiguous blocks fails.

Without CUDA the kernels run under the Triton interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``): shapes stay small (``R = 32, P = 16``, up to 16 heads), plus
one case at DeepSeek's real split (``R = 512, P = 64``) with four heads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from attnkit.kernels.attention.triton_plan import PagedAttentionPlan, plan_paged_attention
from attnkit.kernels.mla.triton import (
    mla_attention,
    mla_split_workspace,
    write_mla_latents,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn

# Output (atol, rtol) and lse atol per query dtype, against the float64 reference fed the
# same rounded inputs: the kernel accumulates in float32 and rounds the softmax weights
# to the query dtype before P @ V (about one ulp of it), and its output to the dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float, float]] = {
    torch.float32: (2e-5, 2e-5, 2e-5),
    torch.float16: (3e-3, 3e-3, 1e-4),
    torch.bfloat16: (2e-2, 2e-2, 1e-4),
}


# --------------------------------------------------------------------------- fixtures


@dataclass
class Case:
    """A batch whose context (this step's latents included) is already in the cache."""

    query: torch.Tensor  # [T + pad, H, D]; rows past T are padding
    cache: torch.Tensor  # [NB, BS, D]
    latents: list[torch.Tensor]  # per request, [seq_len, D] float64, as the cache holds them
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_lens: list[int]
    rank: int
    window: int | None
    kv_scale: float

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def plan(self, num_splits: int | None) -> PagedAttentionPlan:
        return plan_paged_attention(
            self.query_start_loc,
            self.seq_lens,
            self.block_table,
            max_query_len=max(self.query_lens),
            max_seq_len=int(self.seq_lens.max()),
            block_size=self.cache.shape[1],
            num_kv_heads=1,
            sliding_window=self.window,
            num_splits=num_splits,
        )


def make_case(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    *,
    heads: int = 4,
    rank: int = 32,
    rope: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    kv_scale: float = 1.0,
    window: int | None = None,
    pad_rows: int = 2,
    seed: int = 0,
) -> Case:
    """Random latents written at shuffled physical blocks of a NaN-filled cache. With a
    window, every slot before the step's earliest window start holds NaN and blocks
    wholly before it are replaced by a NaN block (as if released)."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    dim = rank + rope
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    width = max(max(blocks_per_req), 1)
    num_blocks = sum(blocks_per_req) + 2  # + a NaN block for released / unused entries
    perm = torch.randperm(num_blocks, generator=gen)
    nan_block = int(perm[-1])
    cache = torch.full((num_blocks, block_size, dim), float("nan"), dtype=torch.float32)
    cache = cache.to(cache_dtype)
    table = torch.full((len(seq_lens), width), nan_block, dtype=torch.int32)
    latents: list[torch.Tensor] = []
    used = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        raw = torch.randn(seq_len, dim, generator=gen)
        # What the cache holds, and what the reference attends to (dequantised).
        stored = (raw / kv_scale).to(cache_dtype)
        latents.append(stored.to(torch.float64) * kv_scale)
        for blk in range(blocks_per_req[b]):
            physical = int(perm[used])
            used += 1
            lo = blk * block_size
            hi = min(lo + block_size, seq_len)
            cache[physical, : hi - lo] = stored[lo:hi]
            table[b, blk] = physical
            if window is not None:
                # Keys before the earliest window start of this step's queries are never
                # needed: NaN them (slot by slot), and swap wholly dead blocks for the
                # NaN block, as if released.
                dead = seq_len - q_len - window + 1
                if dead > lo:
                    cache[physical, : min(dead, hi) - lo] = float("nan")
                if hi <= dead:
                    table[b, blk] = nan_block
    offsets = [0]
    for q_len in query_lens:
        offsets.append(offsets[-1] + q_len)
    query = torch.randn(offsets[-1] + pad_rows, heads, dim, generator=gen).to(dtype)
    return Case(
        query=query.to(DEVICE),
        cache=cache.to(DEVICE),
        latents=latents,
        query_start_loc=torch.tensor(offsets, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=DEVICE),
        block_table=table.to(DEVICE),
        query_lens=list(query_lens),
        rank=rank,
        window=window,
        kv_scale=kv_scale,
    )


def reference(case: Case, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 MLA per request: ``([T, H, R], [T, H])``."""
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    offset = 0
    for latent, q_len in zip(case.latents, case.query_lens, strict=True):
        q = case.query[offset : offset + q_len].to(torch.float64).cpu()
        offset += q_len
        seq_len = latent.shape[0]
        scores = scale * torch.einsum("thd,jd->thj", q, latent)
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        key = torch.arange(seq_len)[None, :]
        visible = key <= pos
        if case.window is not None:
            visible &= pos - key < case.window
        scores = scores.masked_fill(~visible[:, None, :], -math.inf)
        lse = torch.logsumexp(scores, -1)
        weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
        outs.append(weights @ latent[:, : case.rank])
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def run(
    case: Case,
    num_splits: int | None,
    *,
    scale: float | None = None,
    kv_scale: float | torch.Tensor | None = None,
    with_buffers: bool = True,
) -> None:
    """Run the kernel into NaN-filled buffers and compare with the reference."""
    dim = case.query.shape[2]
    score_scale = dim**-0.5 if scale is None else scale
    rows, heads = case.query.shape[:2]
    dtype = case.query.dtype
    output = lse = None
    if with_buffers:
        output = torch.full((rows, heads, case.rank), float("nan"), dtype=dtype, device=DEVICE)
        lse = torch.full((rows, heads), float("nan"), device=DEVICE)
    result = mla_attention(
        case.query,
        case.cache,
        case.plan(num_splits),
        kv_lora_rank=case.rank,
        scale=score_scale,
        kv_scale=kv_scale,
        output=output,
        lse=lse,
    )
    if output is not None:
        assert result is output
    assert result.shape == (rows, heads, case.rank)
    assert result.dtype == dtype
    want_out, want_lse = reference(case, score_scale)
    t = case.num_tokens
    atol, rtol, lse_atol = TOLERANCES[dtype]
    torch.testing.assert_close(
        result[:t].cpu().to(torch.float64), want_out, atol=atol, rtol=rtol, equal_nan=False
    )
    if lse is not None:
        torch.testing.assert_close(lse[:t].cpu().to(torch.float64), want_lse, atol=lse_atol, rtol=0)
        # Rows past query_start_loc[B] are padding: left untouched.
        assert torch.isnan(result[t:]).all()
        assert torch.isnan(lse[t:]).all()


# --------------------------------------------------------------------------- batches

BATCHES = {
    # name: (seq_lens, query_lens)
    "decode": ([1, 17, 40], [1, 1, 1]),
    "prefill": ([7, 20], [7, 20]),
    "chunked": ([33, 5, 30], [1, 5, 12]),  # decode + fresh prefill + prefill with context
}


@pytest.mark.parametrize("splits", [0, 1, 3, 7], ids=lambda s: f"S{s}")
@pytest.mark.parametrize("batch", ["decode", "chunked"])
def test_mla_matches_reference_fp32(batch: str, splits: int) -> None:
    """One pass and split-KV (7 splits exceed every request's 1-3 blocks: empty splits)."""
    seq_lens, query_lens = BATCHES[batch]
    run(make_case(seq_lens, query_lens, seed=splits), splits)


def test_mla_prefill_one_pass() -> None:
    seq_lens, query_lens = BATCHES["prefill"]
    run(make_case(seq_lens, query_lens, heads=3, dtype=torch.float16), 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("splits", [0, 2])
def test_mla_16bit(dtype: torch.dtype, splits: int) -> None:
    seq_lens, query_lens = BATCHES["chunked"]
    run(make_case(seq_lens, query_lens, heads=5, dtype=dtype, block_size=32), splits)


@pytest.mark.parametrize(
    ("window", "splits"), [(5, 0), (20, 0), (5, 3), (1, 2)], ids=["w5", "w20", "w5-S3", "w1-S2"]
)
def test_sliding_window_never_reads_released_blocks(window: int, splits: int) -> None:
    """Slots before the window start hold NaN and blocks wholly before it are swapped for
    a NaN block: a kernel that reads (rather than skips) any key before the window start
    returns NaN."""
    seq_lens, query_lens = [70, 50, 9], [1, 6, 9]
    case = make_case(seq_lens, query_lens, window=window, seed=window)
    run(case, splits)


@pytest.mark.parametrize(
    "kv_scale", [0.5, torch.tensor([0.25]), torch.tensor(2.0)], ids=["float", "t[1]", "t[]"]
)
@pytest.mark.parametrize("splits", [0, 3])
def test_fp8_latents(kv_scale: float | torch.Tensor, splits: int) -> None:
    scale_value = float(kv_scale)
    seq_lens, query_lens = BATCHES["chunked"]
    case = make_case(
        seq_lens, query_lens, dtype=torch.float16, cache_dtype=FP8, kv_scale=scale_value
    )
    if isinstance(kv_scale, torch.Tensor):
        kv_scale = kv_scale.to(DEVICE)
    run(case, splits, kv_scale=kv_scale)


def test_fp8_latents_bf16_query() -> None:
    case = make_case([40, 3], [1, 3], dtype=torch.bfloat16, cache_dtype=FP8, kv_scale=0.5)
    run(case, 2, kv_scale=0.5)


def test_kv_scale_on_a_16bit_cache() -> None:
    """A non-fp8 cache holds ``latent / kv_scale`` too when a scale is given."""
    case = make_case([20], [4], dtype=torch.float16, kv_scale=2.0)
    run(case, 0, kv_scale=2.0)


@pytest.mark.parametrize("splits", [0, 4])
def test_deepseek_split_rank512_rope64(splits: int) -> None:
    """The real split of DeepSeek-V2/V3 and Kimi K2: R = 512, P = 64 (D = 576)."""
    case = make_case(
        [40, 9], [1, 2] if splits else [5, 9], heads=4, rank=512, rope=64, block_size=16
    )
    run(case, splits, scale=0.05)


def test_deepseek_dims_bf16() -> None:
    case = make_case([35], [1], heads=4, rank=512, rope=64, dtype=torch.bfloat16, block_size=32)
    run(case, 3, scale=0.05)


def test_many_heads_span_head_blocks() -> None:
    """More heads than one program's rows (64 at this R): two head blocks, the second
    partial."""
    case = make_case([21, 4], [1, 1], heads=70, rank=16, rope=16)
    run(case, 0)


def test_more_heads_than_tile_with_several_tokens() -> None:
    case = make_case([12], [12], heads=16, rank=32, rope=16, block_size=16)
    run(case, 0)


def test_no_rope_channels() -> None:
    """``D = R``: the latent is the whole key (no decoupled rope part)."""
    case = make_case([30], [3], heads=2, rank=32, rope=0)
    run(case, 2)


def test_allocates_output_and_workspace_when_not_given() -> None:
    case = make_case([30, 2], [1, 1], pad_rows=0)
    run(case, 3, with_buffers=False)


def test_given_workspace_and_strided_query() -> None:
    case = make_case([30, 17], [1, 1], heads=4, pad_rows=0)
    # A query view with a non-unit head stride (a slice of a wider projection).
    wide = torch.randn(2, 4, 2 * case.query.shape[2], device=DEVICE)
    wide[..., ::2] = case.query
    case.query = wide[..., ::2]
    workspace = mla_split_workspace(5, 8, 4, case.rank, device=DEVICE)
    out = mla_attention(
        case.query, case.cache, case.plan(5), kv_lora_rank=case.rank, scale=0.2, workspace=workspace
    )
    want, _ = reference(case, 0.2)
    torch.testing.assert_close(out.to(torch.float64).cpu(), want, atol=2e-5, rtol=2e-5)


def test_auto_splits_plan() -> None:
    case = make_case([1000], [1], heads=2, block_size=64, pad_rows=0)
    plan = plan_paged_attention(
        case.query_start_loc,
        case.seq_lens,
        case.block_table,
        max_query_len=1,
        max_seq_len=1000,
        block_size=64,
        num_kv_heads=1,
        num_splits=None,
        num_sms=8,
    )
    assert plan.num_splits > 1
    out = mla_attention(case.query, case.cache, plan, kv_lora_rank=case.rank, scale=0.1)
    want, _ = reference(case, 0.1)
    torch.testing.assert_close(out.to(torch.float64).cpu(), want, atol=2e-5, rtol=2e-5)


# --------------------------------------------------------------------------- write


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_mla_latents(slot_dtype: torch.dtype, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = torch.full((3, 16, 48), float("nan"), dtype=dtype, device=DEVICE)
    latents = torch.randn(6, 1, 48, generator=gen).to(dtype).to(DEVICE)
    slots = torch.tensor([5, -1, 40, 17, -1, 0], dtype=slot_dtype, device=DEVICE)
    write_mla_latents(latents, cache, slots)
    flat = cache.view(-1, 48)
    for t, slot in enumerate(int(x) for x in slots.cpu()):
        if slot >= 0:
            assert torch.equal(flat[slot], latents[t, 0])
    written = torch.zeros(48, dtype=torch.bool)
    written[[5, 40, 17, 0]] = True
    assert torch.isnan(flat[~written.to(DEVICE)].float()).all()


@pytest.mark.parametrize("kv_scale", [0.5, torch.tensor([0.5])], ids=["float", "tensor"])
def test_write_mla_latents_fp8_matches_torch_cast(kv_scale: float | torch.Tensor) -> None:
    """Bit-exact against torch's e4m3 cast of ``clamp(latent / kv_scale, -448, 448)``:
    ties, subnormals, saturation and NaN included."""
    gen = torch.Generator().manual_seed(2)
    values = torch.randn(4, 40, generator=gen) * 3
    values[0, :8] = torch.tensor([1000.0, -1000.0, 224.5, 0.0, -0.0, 1e-3, 2.0**-9, float("nan")])
    values[1, :6] = torch.tensor([1.0625, 1.1875, 2.0**-7 * 1.5, 2.0**-10, 0.5 + 1 / 32, 240.0])
    cache = torch.zeros(2, 4, 40, dtype=FP8, device=DEVICE)
    slots = torch.tensor([2, 7, -1, 4], device=DEVICE)
    if isinstance(kv_scale, torch.Tensor):
        kv_scale = kv_scale.to(DEVICE)
    write_mla_latents(values.to(DEVICE), cache, slots, kv_scale=kv_scale)
    want = (values / 0.5).clamp(-448, 448).to(FP8)
    got = cache.view(-1, 40).cpu().view(torch.uint8)
    for t, slot in enumerate(int(x) for x in slots.cpu()):
        if slot >= 0:
            assert torch.equal(got[slot], want[t].view(torch.uint8)), t
    assert int(got[1].sum()) == 0  # untouched


def test_written_latents_attend_like_the_reference() -> None:
    """write_mla_latents then mla_attention: one step of decode after a prefill."""
    gen = torch.Generator().manual_seed(3)
    heads, rank, rope, bs = 2, 32, 16, 16
    dim = rank + rope
    cache = torch.full((4, bs, dim), float("nan"), dtype=FP8, device=DEVICE)
    latents = torch.randn(20, dim, generator=gen)
    slots = torch.tensor([16 * 2 + i for i in range(16)] + [16 * 0 + i for i in range(4)])
    write_mla_latents(latents.to(DEVICE), cache, slots.to(DEVICE), kv_scale=0.5)
    case = Case(
        query=torch.randn(1, heads, dim, generator=gen).to(DEVICE),
        cache=cache,
        latents=[(latents / 0.5).to(FP8).to(torch.float64) * 0.5],
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([20], dtype=torch.int32, device=DEVICE),
        block_table=torch.tensor([[2, 0]], dtype=torch.int32, device=DEVICE),
        query_lens=[1],
        rank=rank,
        window=None,
        kv_scale=0.5,
    )
    run(case, 2, kv_scale=0.5, with_buffers=False)


# --------------------------------------------------------------------------- bad input


def _loose(value: object) -> Any:
    """A deliberately wrong argument, typed loosely so the call type-checks."""
    return value


def _args() -> tuple[torch.Tensor, torch.Tensor, PagedAttentionPlan]:
    case = make_case([20], [2], heads=2, pad_rows=0)
    return case.query, case.cache, case.plan(0)


def test_bad_latent_width_and_rank() -> None:
    query, cache, plan = _args()
    with pytest.raises(ValueError, match=r"latent_cache: expected latent width D=48.*got 40"):
        mla_attention(query, cache[..., :40].contiguous(), plan, kv_lora_rank=32, scale=0.1)
    with pytest.raises(ValueError, match=r"kv_lora_rank: expected an int <= the latent width"):
        mla_attention(query, cache, plan, kv_lora_rank=64, scale=0.1)
    with pytest.raises(ValueError, match=r"kv_lora_rank: expected an int >= 1, got 0"):
        mla_attention(query, cache, plan, kv_lora_rank=0, scale=0.1)
    with pytest.raises(TypeError, match=r"kv_lora_rank: expected an int, got float"):
        mla_attention(query, cache, plan, kv_lora_rank=_loose(32.0), scale=0.1)


def test_bad_cache() -> None:
    query, cache, plan = _args()
    with pytest.raises(ValueError, match=r"latent_cache: expected dtype torch.float32 .* or "):
        mla_attention(query, cache.half(), plan, kv_lora_rank=32, scale=0.1)
    with pytest.raises(ValueError, match=r"latent_cache: expected shape \[NB, BS, D\]"):
        mla_attention(query, cache[:, None], plan, kv_lora_rank=32, scale=0.1)
    with pytest.raises(ValueError, match=r"latent_cache: expected a contiguous tensor"):
        mla_attention(query, cache.transpose(0, 1), plan, kv_lora_rank=32, scale=0.1)
    with pytest.raises(ValueError, match=r"latent_cache: expected block size 16 \(the plan"):
        mla_attention(query, cache.view(-1, 32, 48), plan, kv_lora_rank=32, scale=0.1)
    with pytest.raises(TypeError, match=r"latent_cache: expected a torch.Tensor"):
        mla_attention(query, _loose([1.0]), plan, kv_lora_rank=32, scale=0.1)


def test_bad_query_output_lse() -> None:
    query, cache, plan = _args()
    with pytest.raises(ValueError, match=r"query: expected shape \[T, H, D\]"):
        mla_attention(query[0], cache, plan, kv_lora_rank=32, scale=0.1)
    with pytest.raises(ValueError, match=r"query: expected dtype in"):
        mla_attention(query.double(), cache, plan, kv_lora_rank=32, scale=0.1)
    with pytest.raises(ValueError, match=r"output: expected shape \[T, H, R\]=\[2, 2, 32\]"):
        mla_attention(
            query, cache, plan, kv_lora_rank=32, scale=0.1, output=torch.empty_like(query)
        )
    out = torch.empty(2, 2, 32, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match=r"output: expected dtype torch.float32"):
        mla_attention(query, cache, plan, kv_lora_rank=32, scale=0.1, output=out)
    lse = torch.empty(2, 2, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match=r"lse: expected dtype torch.float32, got torch.float64"):
        mla_attention(query, cache, plan, kv_lora_rank=32, scale=0.1, lse=lse)
    with pytest.raises(ValueError, match=r"scale: expected a finite float"):
        mla_attention(query, cache, plan, kv_lora_rank=32, scale=math.inf)


def test_fp8_needs_kv_scale() -> None:
    query, cache, plan = _args()
    fp8 = cache.to(FP8)
    with pytest.raises(ValueError, match=r"kv_scale: expected a float > 0 .* with a .*got None"):
        mla_attention(query, fp8, plan, kv_lora_rank=32, scale=0.1)
    with pytest.raises(ValueError, match=r"kv_scale: expected a float > 0, got -1.0"):
        mla_attention(query, fp8, plan, kv_lora_rank=32, scale=0.1, kv_scale=-1.0)
    with pytest.raises(ValueError, match=r"kv_scale: expected a one-element torch.float32"):
        mla_attention(query, fp8, plan, kv_lora_rank=32, scale=0.1, kv_scale=torch.ones(2))


def test_bad_plan_and_workspace() -> None:
    case = make_case([20], [1], heads=2, pad_rows=0)
    gqa_plan = plan_paged_attention(
        case.query_start_loc,
        case.seq_lens,
        case.block_table,
        max_query_len=1,
        max_seq_len=20,
        block_size=16,
        num_kv_heads=2,
    )
    with pytest.raises(ValueError, match=r"plan: expected num_kv_heads=1"):
        mla_attention(case.query, case.cache, gqa_plan, kv_lora_rank=32, scale=0.1)
    with pytest.raises(TypeError, match=r"plan: expected a PagedAttentionPlan"):
        mla_attention(case.query, case.cache, _loose(None), kv_lora_rank=32, scale=0.1)
    small = mla_split_workspace(2, 1, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"workspace.partial_out: expected shape \[S >= 4"):
        mla_attention(
            case.query, case.cache, case.plan(4), kv_lora_rank=32, scale=0.1, workspace=small
        )
    wrong_rank = mla_split_workspace(4, 1, 2, 48, device=DEVICE)
    with pytest.raises(ValueError, match=r"workspace.partial_out: expected shape .*32\]"):
        mla_attention(
            case.query, case.cache, case.plan(4), kv_lora_rank=32, scale=0.1, workspace=wrong_rank
        )


def test_bad_write_inputs() -> None:
    cache = torch.zeros(2, 16, 48, device=DEVICE)
    latents = torch.zeros(3, 48, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match=r"latents: expected shape \[T, 48\] or \[T, 1, 48\]"):
        write_mla_latents(latents[:, :40], cache, slots)
    with pytest.raises(ValueError, match=r"latents: expected dtype torch.float32 \(the latent"):
        write_mla_latents(latents.half(), cache, slots)
    with pytest.raises(ValueError, match=r"slot_mapping: expected dtype torch.int32 or"):
        write_mla_latents(latents, cache, slots.float())
    with pytest.raises(ValueError, match=r"slot_mapping: expected shape \[3\]"):
        write_mla_latents(latents, cache, slots[:2])
    with pytest.raises(ValueError, match=r"kv_scale: expected a float > 0 .*got None"):
        write_mla_latents(latents, cache.to(FP8), slots)
    with pytest.raises(ValueError, match=r"latent_cache: expected shape \[NB, BS, D\]"):
        write_mla_latents(latents, cache[0], slots)
