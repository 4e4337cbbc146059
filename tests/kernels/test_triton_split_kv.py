"""Triton split-KV decode (``split_kv_decode``) against the torch oracle ``paged_attention``.

Without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` and the kernels run on
CPU tensors under the Triton interpreter, which is slow: shapes stay small, and contexts
of a few blocks are cut into up to nine splits so that empty and fully masked splits
occur. GPU-marked tests at the end run realistic sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.kernels.attention.reference import paged_attention

pytest.importorskip("triton")

from attnkit.kernels.attention.triton import paged_attention as tr_paged_attention
from attnkit.kernels.attention.triton_plan import plan_paged_attention
from attnkit.kernels.attention.triton_split_kv import (
    MAX_QUERY_LEN,
    SplitKVWorkspace,
    choose_num_splits,
    split_kv_decode,
    split_kv_workspace,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn

# Output (atol, rtol) and lse atol, per query dtype, against the float32 oracle fed the
# same rounded inputs. float32: only the summation order differs. float16/bfloat16: both
# outputs are rounded to the dtype and the kernel also rounds the softmax weights to it
# before P.V (about one ulp each); the lse stays float32 on both sides.
TOLERANCES: dict[torch.dtype, tuple[float, float, float]] = {
    torch.float32: (2e-5, 2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3, 1e-4),
    torch.bfloat16: (1.6e-2, 1.6e-2, 1e-4),
}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# --------------------------------------------------------------------------- fixtures


@dataclass
class Batch:
    """A batch whose whole context (this step's tokens included) is already cached."""

    query: torch.Tensor  # [T, Hq, D]; rows num_real: are padding
    kv_cache: torch.Tensor  # [NB, 2, BS, Hkv, D]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    q_lens: list[int]
    lens: list[int]
    scale: float

    @property
    def num_real(self) -> int:
        return sum(self.q_lens)

    def metadata(self) -> dict[str, Any]:
        return dict(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            scale=self.scale,
        )

    def launch_args(self) -> dict[str, Any]:
        return dict(
            self.metadata(),
            max_seq_len=max(self.lens),
            max_query_len=max(self.q_lens),
        )


def make_batch(
    q_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    released_before: Sequence[int] | None = None,
    pad_tokens: int = 0,
    seed: int = 0,
) -> Batch:
    """Shuffled physical blocks in a NaN-filled cache.

    Block 0 is the null block and stays NaN, as do the tails of every request's last
    block, spare blocks, and the unused last column of the block table (pointing at
    block 0). ``released_before[b]`` (a position) releases request ``b``'s blocks that
    end at or before it, as an engine does behind a sliding window: their table entries
    become 0, so reading one reads NaN. Keys and values are stored divided by the scales,
    as ``write_kv_cache`` does.
    """
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    blocks_per_req = [math.ceil(s / bs) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + 2
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(q_lens), max(blocks_per_req) + 1, dtype=torch.int32)
    cache = torch.full((num_blocks, 2, bs, hkv, d), float("nan"))
    for b, (seq_len, nblk) in enumerate(zip(seq_lens, blocks_per_req, strict=True)):
        block_table[b, :nblk] = torch.tensor([physical.pop() for _ in range(nblk)])
        pos = torch.arange(seq_len)
        blk = block_table[b, pos // bs].long()
        cache[blk, 0, pos % bs] = torch.randn(seq_len, hkv, d, generator=gen) / k_scale
        cache[blk, 1, pos % bs] = torch.randn(seq_len, hkv, d, generator=gen) / v_scale
        if released_before is not None:
            block_table[b, : released_before[b] // bs] = 0
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    query = torch.randn(int(qsl[-1]) + pad_tokens, hq, d, generator=gen).to(dtype)
    return Batch(
        query=query.to(DEVICE),
        kv_cache=cache.to(cache_dtype).to(DEVICE),
        query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=block_table.to(DEVICE),
        q_lens=list(q_lens),
        lens=list(seq_lens),
        scale=d**-0.5,
    )


def first_visible(
    q_lens: Sequence[int], seq_lens: Sequence[int], window: int | None, chunk: int | None
) -> list[int]:
    """Per request, the first key position any of its queries can see."""
    firsts = []
    for q_len, seq_len in zip(q_lens, seq_lens, strict=True):
        i0 = seq_len - q_len
        if window is not None:
            firsts.append(max(i0 - window + 1, 0))
        elif chunk is not None:
            firsts.append(i0 // chunk * chunk)
        else:
            firsts.append(0)
    return firsts


def oracle(batch: Batch, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_attention`` on the same tensors; scales as floats, as the oracle takes."""
    options = dict(options)
    for name in ("k_scale", "v_scale"):
        if isinstance(options.get(name), torch.Tensor):
            options[name] = float(options[name])
        elif options.get(name) is None:
            options.pop(name, None)
    kwargs: dict[str, Any] = {
        k: v.cpu() if isinstance(v, torch.Tensor) else v
        for k, v in {**batch.metadata(), **options}.items()
    }
    out, lse = paged_attention(batch.query.cpu(), batch.kv_cache.cpu(), **kwargs, return_lse=True)
    return out, lse


def check_against_oracle(
    batch: Batch,
    output: torch.Tensor,
    lse: torch.Tensor | None,
    **options: Any,
) -> None:
    n = batch.num_real
    expected, expected_lse = oracle(batch, **options)
    atol, rtol, lse_atol = TOLERANCES[batch.query.dtype]
    got = output[:n].cpu()
    assert not got.isnan().any(), "a row was never written, or a masked NaN key leaked"
    torch.testing.assert_close(got.float(), expected[:n].float(), atol=atol, rtol=rtol)
    if lse is not None:
        torch.testing.assert_close(lse[:n].cpu(), expected_lse[:n], atol=lse_atol, rtol=1e-5)
        assert lse[n:].isnan().all(), "padding rows of lse must stay untouched"
    assert output[n:].isnan().all(), "padding rows of output must stay untouched"


def run_split_kv(
    batch: Batch, *, num_splits: int, with_lse: bool = True, **options: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch with NaN-filled output / lse (every real row must be overwritten)."""
    output = torch.full_like(batch.query, float("nan"))
    lse = torch.full(batch.query.shape[:2], float("nan"), device=DEVICE) if with_lse else None
    returned = split_kv_decode(
        batch.query,
        batch.kv_cache,
        **batch.launch_args(),
        num_splits=num_splits,
        output=output,
        lse=lse,
        **options,
    )
    assert returned is output
    return output, lse


# --------------------------------------------------------------- against the oracle

# decode, speculative decode (4 queries), a context exactly one block long (bs 16).
Q_LENS = [1, 4, 1]
SEQ_LENS = [90, 57, 16]


def _case(
    case_id: str,
    *,
    dtype: torch.dtype = torch.float32,
    num_splits: int = 3,
    q_lens: Sequence[int] = Q_LENS,
    seq_lens: Sequence[int] = SEQ_LENS,
    hq: int = 4,
    hkv: int = 2,
    d: int = 32,
    bs: int = 16,
    cache_dtype: torch.dtype | None = None,
    with_lse: bool = True,
    release: bool = False,
    **options: Any,
) -> Any:
    spec = dict(
        q_lens=list(q_lens),
        seq_lens=list(seq_lens),
        hq=hq,
        hkv=hkv,
        d=d,
        bs=bs,
        dtype=dtype,
        cache_dtype=cache_dtype,
        num_splits=num_splits,
        with_lse=with_lse,
        release=release,
    )
    return pytest.param(spec, options, id=f"{case_id}-{DTYPE_NAMES[dtype]}")


def _heads(values: list[float]) -> torch.Tensor:
    return torch.tensor(values)


ORACLE_CASES = [
    _case("splits1", num_splits=1),
    _case("splits2", num_splits=2, dtype=torch.float16, with_lse=False),
    _case("splits3", num_splits=3),
    _case("splits3", num_splits=3, dtype=torch.bfloat16),
    # Request 0 has 6 blocks and request 2 one: most of its 9 splits are empty.
    _case("more-splits-than-blocks", num_splits=9),
    # A window of 5 keys is smaller than one split; released blocks behind it are NaN.
    _case("window5", sliding_window=5, release=True),
    _case("window1", num_splits=2, sliding_window=1, release=True),
    _case("window40", num_splits=4, dtype=torch.float16, sliding_window=40, release=True),
    _case("chunk20", chunk_size=20, release=True),
    _case("chunk32", num_splits=2, dtype=torch.bfloat16, chunk_size=32, release=True),
    _case("softcap", logits_soft_cap=2.5),
    _case("alibi", alibi_slopes=_heads([0.5, 0.25, 0.125, 0.0625])),
    # Sinks must join the denominator once, not once per split.
    _case("sinks", num_splits=4, sinks=_heads([0.5, -1.0, 2.0, 6.0])),
    _case("sinks", num_splits=1, dtype=torch.bfloat16, sinks=_heads([0.5, -1.0, 2.0, 6.0])),
    _case(
        "all-features",
        num_splits=4,
        dtype=torch.float16,
        sliding_window=24,
        release=True,
        logits_soft_cap=3.0,
        alibi_slopes=_heads([0.3, 0.1, 0.05, 0.02]).half(),
        sinks=_heads([1.0, 0.0, -2.0, 3.0]),
    ),
    _case("mqa", num_splits=2, dtype=torch.bfloat16, hq=8, hkv=1, d=64),
    # Group of 3 pads to 4 heads per kv head.
    _case("group3", hq=6, hkv=2),
    _case("headdim80", dtype=torch.float16, d=80),
    _case("bs64", bs=64, seq_lens=[200, 57, 16]),
    _case(
        "bs64-window", num_splits=2, dtype=torch.bfloat16, bs=64, seq_lens=[200, 57, 16],
        sliding_window=70, release=True,
    ),
    _case("bs32-d256", num_splits=2, dtype=torch.float16, bs=32, d=256, hq=2, hkv=1),
    _case("bs128", num_splits=2, bs=128, seq_lens=[300, 57, 16], hq=2, hkv=1),
    # Cross attention: request 1 has more queries than keys.
    _case("noncausal", q_lens=[3, 5], seq_lens=[40, 4], causal=False),
    # Speculative decoding with 8 drafts and 8 query heads per kv head: 64-row tiles.
    _case("spec8-gqa8", dtype=torch.bfloat16, q_lens=[8, 3], seq_lens=[70, 33], hq=8, hkv=1),
    _case("scales-float", k_scale=0.5, v_scale=2.0),
    _case("scales-tensor", k_scale=torch.tensor([0.5]), v_scale=torch.tensor(2.0)),
    _case(
        "fp8-cache", dtype=torch.bfloat16, cache_dtype=FP8,
        k_scale=torch.tensor(0.25), v_scale=torch.tensor([0.5]),
    ),
    _case(
        "fp8-cache-window", num_splits=4, dtype=torch.float16, cache_dtype=FP8,
        sliding_window=9, release=True, k_scale=0.25, v_scale=torch.tensor([0.5]),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "options"), ORACLE_CASES)
def test_split_kv_matches_oracle(spec: dict[str, Any], options: dict[str, Any]) -> None:
    options = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    released = None
    if spec["release"]:
        released = first_visible(
            spec["q_lens"],
            spec["seq_lens"],
            options.get("sliding_window"),
            options.get("chunk_size"),
        )
    scales: dict[str, Any] = {
        name: float(options[name]) for name in ("k_scale", "v_scale") if name in options
    }
    batch = make_batch(
        spec["q_lens"],
        spec["seq_lens"],
        hq=spec["hq"],
        hkv=spec["hkv"],
        d=spec["d"],
        bs=spec["bs"],
        dtype=spec["dtype"],
        cache_dtype=spec["cache_dtype"],
        released_before=released,
        pad_tokens=2,
        **scales,
    )
    if released is not None:
        assert (batch.block_table[:, :-1] == 0).any(), "the case should release a block"
    output, lse = run_split_kv(
        batch, num_splits=spec["num_splits"], with_lse=spec["with_lse"], **options
    )
    check_against_oracle(batch, output, lse, **options)


# ------------------------------------------------------------- empty / masked splits


def test_empty_and_fully_masked_splits_have_neg_inf_lse() -> None:
    """Request 0 (one block, four splits): three splits are empty. Request 1 (8 queries
    at positions 32..39, window 2): one split holds key 31 alone, which only the first
    query sees, so for the seven others that split is fully masked."""
    batch = make_batch(
        [1, 8], [16, 40], hq=2, hkv=1, d=16, bs=16, dtype=torch.float32, pad_tokens=1
    )
    num_splits = 4
    workspace = split_kv_workspace(num_splits, batch.query.shape[0], 2, 16, device=DEVICE)
    workspace.partial_out.fill_(float("nan"))
    workspace.partial_lse.fill_(float("nan"))
    output = torch.full_like(batch.query, float("nan"))
    lse = torch.full(batch.query.shape[:2], float("nan"), device=DEVICE)
    split_kv_decode(
        batch.query,
        batch.kv_cache,
        **batch.launch_args(),
        num_splits=num_splits,
        sliding_window=2,
        output=output,
        lse=lse,
        workspace=workspace,
    )
    check_against_oracle(batch, output, lse, sliding_window=2)

    part_lse = workspace.partial_lse.cpu()
    part_out = workspace.partial_out.cpu()
    n = batch.num_real
    assert not part_lse[:, :n].isnan().any()
    assert not part_out[:, :n].isnan().any()
    # Request 0, token 0: a single block; with 4 splits of 1 block only split 3 has it.
    assert torch.isneginf(part_lse[:3, 0]).all()
    assert (part_out[:3, 0] == 0).all()
    assert torch.isfinite(part_lse[3, 0]).all()
    # Request 1 (tokens 1..8): kv range [31, 40) is blocks 1..2; four splits of two
    # blocks: split s covers blocks [1 + 2s // 4, 1 + 2(s + 1) // 4), so split 1 holds
    # block 1 (key 31 alone), split 3 block 2 (keys 32..39), splits 0 and 2 are empty.
    assert torch.isfinite(part_lse[1, 1]).all()
    assert torch.isneginf(part_lse[1, 2:9]).all()
    assert (part_out[1, 2:9] == 0).all()
    assert torch.isneginf(part_lse[0, 1:9]).all()
    assert torch.isneginf(part_lse[2, 1:9]).all()
    assert torch.isfinite(part_lse[3, 1:9]).all()
    # The padding token's partials are never written.
    assert part_lse[:, n:].isnan().all()


def test_split_count_does_not_change_the_result() -> None:
    batch = make_batch([2, 1], [150, 3], hq=4, hkv=2, d=32, bs=16, dtype=torch.float32, seed=5)
    results = [run_split_kv(batch, num_splits=s)[0] for s in (1, 2, 5, 12)]
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], atol=2e-6, rtol=2e-6)


def _first_alone(batch: Batch) -> Batch:
    """The batch's first request alone: the same cache, blocks and query rows."""
    n = batch.q_lens[0]
    return Batch(
        query=batch.query[:n].clone(),
        kv_cache=batch.kv_cache,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
        seq_lens=batch.seq_lens[:1].clone(),
        block_table=batch.block_table[:1].clone(),
        q_lens=[n],
        lens=batch.lens[:1],
        scale=batch.scale,
    )


@pytest.mark.parametrize("q_len", [1, 3])
def test_a_fixed_split_size_gives_a_request_the_same_bits_in_any_batch(q_len: int) -> None:
    """split_tokens (keys per split) with the same num_splits bound every call: the
    first request alone and beside longer ones, the same bits, and right."""
    batch = make_batch(
        [q_len, 1, 2], [150, 700, 333], hq=4, hkv=2, d=32, bs=16, dtype=torch.float32, seed=7
    )
    alone = _first_alone(batch)
    fixed = {"num_splits": 8, "split_tokens": 96}
    together, lse = run_split_kv(batch, **fixed)
    check_against_oracle(batch, together, lse)
    by_itself, _ = run_split_kv(alone, **fixed)
    assert torch.equal(by_itself[:q_len], together[:q_len])


def test_a_split_count_from_the_batch_changes_a_requests_bits() -> None:
    """The negative control: the split count of each call (here one more than the
    batch's requests, as a heuristic filling a device would pick) moves the first
    request's split boundaries, and its bits."""
    batch = make_batch([1, 1, 2], [150, 700, 333], hq=4, hkv=2, d=32, bs=16, dtype=torch.float32, seed=7)
    alone = _first_alone(batch)
    together, _ = run_split_kv(batch, num_splits=4)
    by_itself, _ = run_split_kv(alone, num_splits=2)
    assert not torch.equal(by_itself[:1], together[:1])


def test_split_tokens_is_checked() -> None:
    batch = make_batch([1], [150], hq=4, hkv=2, d=32, bs=16, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"^split_tokens: expected a multiple of block_size=16"):
        run_split_kv(batch, num_splits=4, split_tokens=40)
    with pytest.raises(ValueError, match=r"^num_splits: 2 splits of split_tokens=32 keys cover 64"):
        run_split_kv(batch, num_splits=2, split_tokens=32)


# ----------------------------------------------------------- views, padding, workspace


def test_strided_query_output_lse_and_untouched_padding_rows() -> None:
    hq, hkv, d = 4, 2, 32
    batch = make_batch(
        [1, 3], [50, 20], hq=hq, hkv=hkv, d=d, bs=16, dtype=torch.float16, pad_tokens=2
    )
    num_tokens = batch.query.shape[0]
    # A fused qkv buffer: query is a non-contiguous view of its first Hq heads.
    qkv = torch.randn(num_tokens, hq + 2 * hkv, d, device=DEVICE).to(torch.float16)
    qkv[:, :hq] = batch.query
    query = qkv[:, :hq]
    out_buffer = torch.full((num_tokens, hq, 2 * d), float("nan"), device=DEVICE).half()
    output = out_buffer[:, :, :d]
    lse_buffer = torch.full((hq, num_tokens), float("nan"), device=DEVICE)
    lse = lse_buffer.t()
    assert not query.is_contiguous()
    assert not output.is_contiguous()
    assert not lse.is_contiguous()
    split_kv_decode(
        query, batch.kv_cache, **batch.launch_args(), num_splits=3, output=output, lse=lse
    )
    check_against_oracle(batch, output, lse)
    assert out_buffer[:, :, d:].isnan().all()


def test_workspace_larger_than_needed_and_reused() -> None:
    first = make_batch([1, 2], [70, 30], hq=4, hkv=2, d=16, bs=16, dtype=torch.float32)
    second = make_batch([1], [45], hq=4, hkv=2, d=16, bs=16, dtype=torch.float32, seed=3)
    workspace = split_kv_workspace(6, 8, 4, 16, device=DEVICE)
    for batch in (first, second, first):
        expected, _ = run_split_kv(batch, num_splits=3)
        got = split_kv_decode(
            batch.query,
            batch.kv_cache,
            **batch.launch_args(),
            num_splits=3,
            workspace=workspace,
        )
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_split_kv_workspace_shapes() -> None:
    ws = split_kv_workspace(3, 5, 8, 64, device=DEVICE)
    assert isinstance(ws, SplitKVWorkspace)
    assert ws.partial_out.shape == (3, 5, 8, 64)
    assert ws.partial_lse.shape == (3, 5, 8)
    assert ws.partial_out.dtype == torch.float32
    assert ws.partial_lse.dtype == torch.float32
    assert ws.partial_out.device.type == DEVICE.type


_ALLOCATORS = (
    "empty",
    "empty_like",
    "empty_strided",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "full",
    "full_like",
    "tensor",
)


def test_allocates_nothing_with_full_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the step is planned, a layer's launch allocates nothing (the thin
    ``split_kv_decode`` wrapper plans per call, and planning computes the tile offsets)."""
    batch = make_batch(
        [1, 3], [40, 20], hq=4, hkv=2, d=16, bs=16, dtype=torch.bfloat16, cache_dtype=FP8
    )
    num_tokens = batch.query.shape[0]
    output = torch.empty_like(batch.query)
    lse = torch.empty(num_tokens, 4, device=DEVICE)
    workspace = split_kv_workspace(2, num_tokens, 4, 16, device=DEVICE)
    options: dict[str, Any] = dict(
        k_scale=torch.ones(1, device=DEVICE),
        v_scale=torch.ones(1, device=DEVICE),
        sinks=torch.zeros(4, device=DEVICE),
        alibi_slopes=torch.zeros(4, device=DEVICE),
    )
    plan = plan_paged_attention(
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        max_query_len=max(batch.q_lens),
        max_seq_len=max(batch.lens),
        block_size=16,
        num_kv_heads=2,
        sliding_window=30,
        num_tokens=num_tokens,
        num_splits=2,
    )

    def forbidden(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("paged_attention allocated a tensor")

    for name in _ALLOCATORS:
        monkeypatch.setattr(torch, name, forbidden)
    # The hooks bite: without a workspace the launcher must allocate one.
    with pytest.raises(AssertionError, match="allocated a tensor"):
        tr_paged_attention(
            batch.query, batch.kv_cache, plan, scale=batch.scale, output=output, **options
        )
    tr_paged_attention(
        batch.query,
        batch.kv_cache,
        plan,
        scale=batch.scale,
        output=output,
        lse=lse,
        workspace=workspace,
        **options,
    )
    monkeypatch.undo()
    check_against_oracle(batch, output, lse, sliding_window=30, **options)


def test_allocates_output_and_empty_batch() -> None:
    batch = make_batch([1], [20], hq=2, hkv=1, d=16, bs=16, dtype=torch.float16)
    out = split_kv_decode(batch.query, batch.kv_cache, **batch.launch_args(), num_splits=2)
    assert out.shape == batch.query.shape
    assert out.dtype == torch.float16
    check_against_oracle(batch, out, None)

    cache = torch.zeros(2, 2, 16, 1, 16, device=DEVICE)
    empty = split_kv_decode(
        torch.empty(0, 1, 16, device=DEVICE),
        cache,
        query_start_loc=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.zeros(0, dtype=torch.int32, device=DEVICE),
        block_table=torch.zeros(0, 1, dtype=torch.int32, device=DEVICE),
        max_seq_len=0,
        max_query_len=0,
        scale=1.0,
        num_splits=4,
    )
    assert empty.shape == (0, 1, 16)


# ---------------------------------------------------------------- choose_num_splits


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        pytest.param((1, 8, 32768, 16), 17, id="one-long-request"),
        pytest.param((4, 8, 8192, 16), 5, id="four-requests-8k"),
        pytest.param((64, 8, 32768, 16), 1, id="batch-fills-gpu"),
        pytest.param((1, 8, 1000, 16), 3, id="short-context-caps-splits"),
        pytest.param((1, 8, 100, 16), 1, id="tiny-context"),
        pytest.param((1, 1, 1 << 20, 16), 32, id="max-splits"),
        pytest.param((1, 8, 8192, 128, 16), 2, id="small-gpu"),
        pytest.param((0, 8, 0, 16), 1, id="empty-batch"),
    ],
)
def test_choose_num_splits(args: tuple[int, ...], expected: int) -> None:
    assert choose_num_splits(*args) == expected


def test_choose_num_splits_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_sms: expected an int >= 1"):
        choose_num_splits(1, 8, 1024, 16, num_sms=0)
    with pytest.raises(ValueError, match="block_size: expected an int, got float"):
        choose_num_splits(1, 8, 1024, 16.0)  # type: ignore[arg-type]  # test input built loosely or wrong on purpose


# ---------------------------------------------------------------------- hypothesis


@settings(max_examples=8, deadline=None)
@given(
    data=st.data(),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    block_size=st.sampled_from([16, 32]),
    num_splits=st.integers(1, 6),
    mask=st.sampled_from(["none", "window", "chunk"]),
    use_sinks=st.booleans(),
)
def test_split_kv_random_batches(
    data: st.DataObject,
    num_kv_heads: int,
    group: int,
    block_size: int,
    num_splits: int,
    mask: str,
    use_sinks: bool,
) -> None:
    num_requests = data.draw(st.integers(1, 3), label="B")
    q_lens = data.draw(st.lists(st.integers(1, 4), min_size=num_requests, max_size=num_requests))
    ctx = data.draw(st.lists(st.integers(0, 80), min_size=num_requests, max_size=num_requests))
    seq_lens = [q + c for q, c in zip(q_lens, ctx, strict=True)]
    hq = num_kv_heads * group
    options: dict[str, Any] = {}
    if mask == "window":
        options["sliding_window"] = data.draw(st.integers(1, 50), label="window")
    elif mask == "chunk":
        options["chunk_size"] = data.draw(st.integers(1, 40), label="chunk")
    if use_sinks:
        options["sinks"] = torch.linspace(-2.0, 3.0, hq, device=DEVICE)
    released = first_visible(
        q_lens, seq_lens, options.get("sliding_window"), options.get("chunk_size")
    )
    batch = make_batch(
        q_lens,
        seq_lens,
        hq=hq,
        hkv=num_kv_heads,
        d=16,
        bs=block_size,
        dtype=torch.float32,
        released_before=released,
        seed=data.draw(st.integers(0, 2**16), label="seed"),
    )
    output, lse = run_split_kv(batch, num_splits=num_splits, **options)
    check_against_oracle(batch, output, lse, **options)


# ----------------------------------------------------------------------- validation

_Kwargs = dict[str, Any]
META = torch.device("meta")


def _valid_args() -> _Kwargs:
    batch = make_batch([1, 2], [5, 20], hq=4, hkv=2, d=16, bs=16, dtype=torch.float32)
    return dict(
        query=batch.query,
        kv_cache=batch.kv_cache,
        **batch.launch_args(),
        num_splits=2,
    )


def _set(**changes: Callable[[_Kwargs], Any]) -> Callable[[_Kwargs], None]:
    def mutate(args: _Kwargs) -> None:
        for name, make in changes.items():
            args[name] = make(args)

    return mutate


def _workspace(splits: int, tokens: int, heads: int = 4, d: int = 16) -> Callable[[_Kwargs], Any]:
    return lambda a: split_kv_workspace(splits, tokens, heads, d, device=DEVICE)


ERRORS = [
    pytest.param(_set(query=lambda a: a["query"][0]), "query: expected shape", id="query-2d"),
    pytest.param(
        _set(query=lambda a: a["query"].double(), kv_cache=lambda a: a["kv_cache"].double()),
        "query: expected dtype",
        id="query-fp64",
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"].half()),
        "kv_cache: expected dtype torch.float32",
        id="cache-dtype",
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
        _set(kv_cache=lambda a: a["kv_cache"][:, :, :8].contiguous()),
        r"kv_cache: expected block size in \(16, 32, 64, 128\)",
        id="blocksize-8",
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
        _set(query=lambda a: a["query"][:, :3]), "kv_cache: expected a kv head count", id="heads"
    ),
    pytest.param(
        _set(seq_lens=lambda a: a["seq_lens"].long()),
        "seq_lens: expected dtype",
        id="seq-lens-int64",
    ),
    pytest.param(
        _set(query_start_loc=lambda a: a["query_start_loc"][:-1]),
        r"query_start_loc: expected shape \[3\]",
        id="qsl-length",
    ),
    pytest.param(
        _set(block_table=lambda a: a["block_table"].repeat(1, 2)[:, ::2]),
        "block_table: expected unit stride",
        id="table-strided",
    ),
    pytest.param(
        _set(max_seq_len=lambda a: 100),
        "block_table: expected at least 7 columns",
        id="table-narrow",
    ),
    pytest.param(
        _set(max_query_len=lambda a: MAX_QUERY_LEN + 1),
        f"max_query_len: expected an int <= {MAX_QUERY_LEN}",
        id="query-len-too-long",
    ),
    pytest.param(
        _set(max_query_len=lambda a: -1), "max_query_len: expected an int >= 0", id="q-negative"
    ),
    pytest.param(
        _set(max_seq_len=lambda a: 1), "max_seq_len: expected an int >= 2", id="seq-below-query"
    ),
    pytest.param(_set(num_splits=lambda a: 0), "num_splits: expected an int >= 1", id="splits-0"),
    pytest.param(
        _set(num_splits=lambda a: 257), "num_splits: expected an int <= 256", id="splits-257"
    ),
    pytest.param(
        _set(num_splits=lambda a: 2.0), "num_splits: expected an int, got float", id="splits-float"
    ),
    pytest.param(
        _set(scale=lambda a: float("inf")), "scale: expected a finite float", id="scale-inf"
    ),
    pytest.param(_set(causal=lambda a: 1), "causal: expected a bool", id="causal-int"),
    pytest.param(
        _set(sliding_window=lambda a: 0), "sliding_window: expected an int >= 1", id="window-0"
    ),
    pytest.param(
        _set(sliding_window=lambda a: 4, causal=lambda a: False),
        "sliding_window: expected None with causal=False",
        id="window-noncausal",
    ),
    pytest.param(
        _set(sliding_window=lambda a: 4, chunk_size=lambda a: 8),
        "sliding_window, chunk_size: expected at most one",
        id="window-and-chunk",
    ),
    pytest.param(
        _set(chunk_size=lambda a: 4, causal=lambda a: False),
        "chunk_size: expected None with causal=False",
        id="chunk-noncausal",
    ),
    pytest.param(
        _set(logits_soft_cap=lambda a: 0.0),
        "logits_soft_cap: expected a finite float > 0",
        id="softcap-0",
    ),
    pytest.param(
        _set(alibi_slopes=lambda a: torch.zeros(3, device=DEVICE)),
        r"alibi_slopes: expected shape \[4\]",
        id="alibi-shape",
    ),
    pytest.param(
        _set(sinks=lambda a: torch.zeros(4, dtype=torch.int32, device=DEVICE)),
        "sinks: expected dtype in",
        id="sinks-int",
    ),
    pytest.param(
        _set(sinks=lambda a: torch.zeros(4, device=META)),
        "sinks: expected device",
        id="sinks-device",
    ),
    pytest.param(
        _set(k_scale=lambda a: torch.ones(3, device=DEVICE)),
        r"k_scale: expected a torch.float32 tensor of shape \[\] or \[1\] \(per tensor\) or \[Hkv\]",
        id="k-scale-two",
    ),
    pytest.param(
        _set(v_scale=lambda a: torch.ones(1, dtype=torch.float16, device=DEVICE)),
        r"v_scale: expected a one-element torch.float32 tensor of shape \[\] or \[1\], "
        r"got torch.float16",
        id="v-scale-fp16",
    ),
    pytest.param(_set(v_scale=lambda a: -1.0), "v_scale: expected a float > 0", id="v-scale-neg"),
    pytest.param(
        _set(
            query=lambda a: a["query"].half(),
            kv_cache=lambda a: a["kv_cache"].to(FP8),
            k_scale=lambda a: 1.0,
        ),
        "v_scale: expected a float or a one-element torch.float32 tensor with a",
        id="fp8-without-v-scale",
    ),
    pytest.param(
        _set(output=lambda a: torch.empty_like(a["query"]).half()),
        "output: expected dtype",
        id="output-dtype",
    ),
    pytest.param(
        _set(output=lambda a: torch.empty_like(a["query"][:1])),
        "output: expected shape",
        id="output-shape",
    ),
    pytest.param(
        _set(lse=lambda a: torch.empty(3, 4, dtype=torch.float16, device=DEVICE)),
        "lse: expected dtype torch.float32",
        id="lse-dtype",
    ),
    pytest.param(
        _set(lse=lambda a: torch.empty(3, 3, device=DEVICE)),
        r"lse: expected shape \[3, 4\]",
        id="lse-shape",
    ),
    pytest.param(
        _set(workspace=_workspace(1, 3)),
        r"workspace.partial_out: expected shape \[S >= 2, T >= 3, 4, 16\]",
        id="workspace-few-splits",
    ),
    pytest.param(
        _set(workspace=_workspace(2, 2)),
        r"workspace.partial_out: expected shape \[S >= 2, T >= 3, 4, 16\]",
        id="workspace-few-tokens",
    ),
    pytest.param(
        _set(
            workspace=lambda a: SplitKVWorkspace(
                _workspace(2, 3)(a)[0], torch.empty(2, 3, 4).half()
            )
        ),
        "workspace.partial_lse: expected dtype torch.float32",
        id="workspace-lse-dtype",
    ),
    pytest.param(
        _set(workspace=lambda a: _workspace(2, 3)(a)[0]),
        "workspace: expected a SplitKVWorkspace",
        id="workspace-tensor",
    ),
]


@pytest.mark.parametrize(("mutate", "match"), ERRORS)
def test_split_kv_rejects(mutate: Callable[[_Kwargs], None], match: str) -> None:
    args = _valid_args()
    mutate(args)
    query, kv_cache = args.pop("query"), args.pop("kv_cache")
    with pytest.raises(ValueError, match=match):
        split_kv_decode(query, kv_cache, **args)


# ------------------------------------------------------------------------------ GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "options"),
    [
        pytest.param([1], [32768], {}, id="B1-32k"),
        pytest.param([1, 1, 1, 1], [8192, 16000, 9000, 12345], {}, id="B4-8k-16k"),
        pytest.param([4, 1], [20000, 8192], {"sliding_window": 4096}, id="B2-spec4-window"),
        pytest.param([1, 1], [16384, 9000], {"logits_soft_cap": 30.0}, id="B2-softcap"),
    ],
)
def test_split_kv_gpu_realistic(
    q_lens: list[int], seq_lens: list[int], options: dict[str, Any]
) -> None:
    hq, hkv, d, bs = 32, 8, 128, 16
    batch = make_batch(q_lens, seq_lens, hq=hq, hkv=hkv, d=d, bs=bs, dtype=torch.bfloat16)
    num_splits = choose_num_splits(len(q_lens), hkv, max(seq_lens), bs)
    assert num_splits > 1
    output, lse = run_split_kv(batch, num_splits=num_splits, **options)
    check_against_oracle(batch, output, lse, **options)


@pytest.mark.gpu
@needs_cuda
def test_split_kv_gpu_fp8_cache_and_sinks() -> None:
    hq, hkv, d, bs = 32, 8, 128, 64
    batch = make_batch(
        [1, 2], [16384, 8192], hq=hq, hkv=hkv, d=d, bs=bs, dtype=torch.bfloat16,
        cache_dtype=FP8, k_scale=0.5, v_scale=0.25,
    )  # fmt: skip
    options: dict[str, Any] = dict(
        k_scale=torch.tensor([0.5], device=DEVICE),
        v_scale=torch.tensor([0.25], device=DEVICE),
        sinks=torch.linspace(-1.0, 2.0, hq, device=DEVICE),
    )
    output, lse = run_split_kv(batch, num_splits=16, **options)
    check_against_oracle(batch, output, lse, **options)


@pytest.mark.gpu
@needs_cuda
def test_split_kv_gpu_cuda_graph_replay() -> None:
    """Captured once with preallocated buffers, replayed after the metadata changes."""
    hq, hkv, d, bs = 32, 8, 128, 16
    first = make_batch([1, 1], [9000, 20000], hq=hq, hkv=hkv, d=d, bs=bs, dtype=torch.bfloat16)
    second = make_batch(
        [1, 1], [20000, 12000], hq=hq, hkv=hkv, d=d, bs=bs, dtype=torch.bfloat16, seed=1
    )
    width = max(first.block_table.shape[1], second.block_table.shape[1])
    num_splits = choose_num_splits(2, hkv, 20000, bs)
    query = first.query.clone()
    cache = torch.cat([first.kv_cache, second.kv_cache])
    qsl = first.query_start_loc.clone()
    seq_lens = first.seq_lens.clone()
    table = torch.zeros(2, width, dtype=torch.int32, device=DEVICE)
    table[:, : first.block_table.shape[1]] = first.block_table
    output = torch.empty_like(query)
    lse = torch.empty(2, hq, device=DEVICE)
    workspace = split_kv_workspace(num_splits, 2, hq, d, device=DEVICE)
    kwargs: dict[str, Any] = dict(
        query_start_loc=qsl, seq_lens=seq_lens, block_table=table, max_seq_len=20000,
        scale=first.scale, num_splits=num_splits, output=output, lse=lse, workspace=workspace,
    )  # fmt: skip
    split_kv_decode(query, cache, **kwargs)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        split_kv_decode(query, cache, **kwargs)

    offset = first.kv_cache.shape[0]
    for batch, shift in ((first, 0), (second, offset)):
        query.copy_(batch.query)
        seq_lens.copy_(batch.seq_lens)
        table.zero_()
        table[:, : batch.block_table.shape[1]] = batch.block_table + shift
        graph.replay()
        torch.cuda.synchronize()
        ref_batch = Batch(
            query=query, kv_cache=cache, query_start_loc=qsl, seq_lens=seq_lens,
            block_table=table, q_lens=batch.q_lens, lens=batch.lens, scale=batch.scale,
        )  # fmt: skip
        check_against_oracle(ref_batch, output, lse)
