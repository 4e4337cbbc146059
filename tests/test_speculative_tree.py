"""Draft trees: a verify step whose drafts are a tree (``ScheduledRequest.draft_parents``)
and ``accept`` with the accepted path.

References, all independent of the code under test:
- every draft token's output against a dense float64 softmax built here, over the
  cached context and the keys a dense ancestor mask (made from the parents by walking
  them) lets it see: the same as running its root-to-node path as a linear sequence;
- a rollback to a path that is not a prefix of the draft order, followed by new tokens,
  against a second runtime that only ever decoded the path: the keys and values held
  at every position, the states, held tokens, blocks and outputs.
Each check has a deliberately broken variant shown to be caught.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from attnkit import (
    AttentionConfig,
    AttentionFeature,
    AttentionLayerParams,
    AttentionRuntime,
    ChunkedLocalAttentionSpec,
    EngineLimitError,
    FullAttentionSpec,
    InvalidArgumentError,
    MambaSpec,
    MLAAttentionSpec,
    ScheduledRequest,
    SlidingWindowSpec,
)
from attnkit.backend import BackendRequest, DraftTreeSupport
from attnkit.backends.reference import ReferenceBackend
from attnkit.registry import BUILTIN_BACKENDS, BackendRegistry
from attnkit.runtime import _spec
from attnkit.spec import KVCacheSpecKind
from attnkit.state_types import state_type_of
from speculative_helpers import broken as _broken
from speculative_helpers import gen as _gen
from speculative_helpers import state_of as _state_of

HQ, HKV, D, BS = 4, 2, 32, 16
TOL = 2e-5
# Depth 1: drafts 0, 1; depth 2: 2, 3, 4; depth 3: 5, 6 (width 3, depth 3).
TREE = (-1, -1, 0, 0, 1, 2, 4)
K = len(TREE)
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32)


def _attn_rows(rid: str, token: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A token's q, k, v: a function of the request and the token's name, so the same
    token gets the same rows in every runtime and at every position."""
    gen = _gen("attn", rid, token)
    return torch.randn(HQ, D, generator=gen), *torch.randn(2, HKV, D, generator=gen)


class Model:
    """A full-attention layer and optionally a state layer; a token is named by
    ``("p", position)`` (prompt and decoded tokens) or ``("d", step, i)`` (draft ``i``)."""

    def __init__(
        self,
        backend: str,
        state: str | None = None,
        width: int = 3,
        spec: Any = FULL,
        alibi: tuple[float, ...] | None = None,
    ) -> None:
        self.specs: dict[str, Any] = {"attn": spec}
        self.params: dict[str, Any] = {
            "attn": AttentionLayerParams(num_heads=HQ, alibi_slopes=alibi)
        }
        per_kind = {spec.kind.value: backend}
        self.state = state
        if state is not None:
            st = state_type_of(state)
            params = st.example(torch.Generator().manual_seed(0), torch.device("cpu"))
            self.specs["mixer"] = MambaSpec(
                block_size=BS,
                shapes=params.state_shapes,
                dtypes=st.state_dtypes(torch.float32),
                mamba_type=state,
            )
            self.params["mixer"] = params
        self.config = AttentionConfig(
            backend_per_kind=per_kind,
            num_speculative_tokens=K,
            draft_tree_width=width,
            max_num_reqs=8,
        )

    def runtime(self) -> AttentionRuntime:
        return AttentionRuntime(
            self.specs,
            self.config,
            device="cpu",
            memory_budget_bytes=2**22,
            layer_params=self.params,
            cache_fill=float("nan"),
        )

    def step(
        self,
        rt: AttentionRuntime,
        scheduled: Sequence[tuple[str, Sequence[object], tuple[int, ...] | None, int]],
    ) -> dict[str, dict[str, torch.Tensor]]:
        """``(rid, token names, draft parents or None, drafts)`` per request."""
        batch = rt.begin_step(
            [
                ScheduledRequest(rid, len(toks), num_draft_tokens=d, draft_parents=parents)
                for rid, toks, parents, d in scheduled
            ]
        )
        names = {rid: toks for rid, toks, _, _ in scheduled}
        order = [(rid, t) for rid in batch.order for t in names[rid]]
        out: dict[str, torch.Tensor] = {}
        rows = [_attn_rows(rid, t) for rid, t in order]
        out["attn"] = rt.forward(
            "attn", *(torch.stack([r[i] for r in rows]) for i in range(3))
        )
        if self.state is not None:
            st = state_type_of(self.state)
            parts = [
                st.example_inputs(self.params["mixer"], 1, _gen("s", rid, t), torch.device("cpu"))
                for rid, t in order
            ]
            fields = type(parts[0]).__dataclass_fields__
            inputs = type(parts[0])(**{f: torch.cat([getattr(p, f) for p in parts]) for f in fields})
            out["mixer"] = rt.forward_state("mixer", inputs)
        slices = batch.token_slices()
        return {name: {rid: y[s].clone() for rid, s in slices.items()} for name, y in out.items()}


def _ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """Dense bool ``[k, k]``: draft ``i`` sees draft ``j`` (its ancestors and itself)."""
    k = len(parents)
    mask = torch.zeros(k, k, dtype=torch.bool)
    for i in range(k):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def _oracle(rid: str, context: Sequence[object], drafts: Sequence[object], parents: Sequence[int]) -> torch.Tensor:
    """Float64 ``[k, Hq, D]``: each draft over the context and the drafts it sees."""
    ctx = [_attn_rows(rid, t) for t in context]
    dr = [_attn_rows(rid, t) for t in drafts]
    keys = torch.stack([r[1] for r in ctx + dr]).double().repeat_interleave(HQ // HKV, 1)
    values = torch.stack([r[2] for r in ctx + dr]).double().repeat_interleave(HQ // HKV, 1)
    q = torch.stack([r[0] for r in dr]).double()
    visible = torch.cat(
        [torch.ones(len(dr), len(ctx), dtype=torch.bool), _ancestor_mask(parents)], dim=1
    )
    scores = torch.einsum("thd,nhd->thn", q, keys) / D**0.5
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("thn,nhd->thd", scores.softmax(-1), values)


def _close(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    err = (got.double() - want.double()).abs().max().item()
    assert err <= TOL, f"{where}: max error {err:.3g} > {TOL}"


TREE_BACKENDS = ("reference", "cpu_attn", "triton_attn")


@pytest.mark.parametrize("backend", TREE_BACKENDS)
def test_tree_verify_equals_each_path_against_the_float64_oracle(backend: str) -> None:
    if backend == "triton_attn":
        pytest.importorskip("triton")
    model = Model(backend)
    rt = model.runtime()
    prompts = {"a": 37, "b": 16}
    model.step(rt, [(rid, [("p", i) for i in range(n)], None, 0) for rid, n in prompts.items()])
    # "a" verifies a tree, "b" a chain of 3 drafts in the same step.
    shapes = {"a": TREE, "b": (-1, 0, 1)}
    got = model.step(
        rt,
        [
            (rid, [("p", n)] + [("d", 1, i) for i in range(len(p))], p if rid == "a" else None, len(p))
            for (rid, n), p in zip(prompts.items(), shapes.values(), strict=True)
        ],
    )
    for rid, n in prompts.items():
        parents = shapes[rid]
        context = [("p", i) for i in range(n + 1)]
        want = _oracle(rid, context, [("d", 1, i) for i in range(len(parents))], parents)
        for i in range(len(parents)):
            _close(got["attn"][rid][1 + i], want[i], f"{backend} request {rid} draft {i}")
    rt.accept({"a": [1, 4], "b": 3})


# A window of 3 and chunks of 8 after a 38-token context: the drafts sit at 38 (depth
# 1), 39 (depth 2) and 40 (depth 3, a new chunk), while their slots run to 44, so a
# window or chunk measured in slots, or an ALiBi distance counted in slots, differs.
WINDOW = SlidingWindowSpec(
    block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32, sliding_window=3
)
CHUNKED = ChunkedLocalAttentionSpec(
    block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32, attention_chunk_size=8
)
SLOPES = (0.5, 0.25, 0.125, 0.0625)
LOCAL_KINDS = {"full": FULL, "window": WINDOW, "chunked": CHUNKED}


def _path_oracle(
    rid: str,
    context: Sequence[object],
    drafts: Sequence[object],
    parents: Sequence[int],
    *,
    window: int | None,
    chunk: int | None,
    alibi: tuple[float, ...] | None,
) -> torch.Tensor:
    """Float64 ``[k, Hq, D]``: each draft as the last token of the linear sequence
    context + its root-to-node path, at positions ``0 .. len - 1``, under the window,
    chunk and ALiBi slopes given (written out here, not taken from attnkit)."""
    out = []
    for i in range(len(drafts)):
        path = []
        j = i
        while j >= 0:
            path.append(drafts[j])
            j = parents[j]
        tokens = [*context, *reversed(path)]
        rows = [_attn_rows(rid, t) for t in tokens]
        n = len(tokens)
        q = rows[-1][0].double()  # [Hq, D]
        keys = torch.stack([r[1] for r in rows]).double().repeat_interleave(HQ // HKV, 1)
        values = torch.stack([r[2] for r in rows]).double().repeat_interleave(HQ // HKV, 1)
        pos = torch.arange(n, dtype=torch.float64)
        me = n - 1
        visible = torch.ones(n, dtype=torch.bool)
        if window is not None:
            visible &= pos > me - window
        if chunk is not None:
            visible &= pos >= me - me % chunk
        scores = torch.einsum("hd,nhd->hn", q, keys) / D**0.5
        if alibi is not None:
            scores = scores + torch.tensor(alibi, dtype=torch.float64)[:, None] * (pos - me)
        scores = scores.masked_fill(~visible[None, :], float("-inf"))
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
    return torch.stack(out)


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("kind", list(LOCAL_KINDS))
@pytest.mark.parametrize("backend", ["reference", "cpu_attn"])
def test_tree_drafts_sit_at_their_depth_for_windows_chunks_and_alibi(
    backend: str, kind: str, alibi: bool
) -> None:
    spec = LOCAL_KINDS[kind]
    slopes = SLOPES if alibi else None
    model = Model(backend, spec=spec, alibi=slopes)
    rt = model.runtime()
    n = 37
    model.step(rt, [("a", [("p", i) for i in range(n)], None, 0)])
    drafts = [("d", 1, i) for i in range(K)]
    got = model.step(rt, [("a", [("p", n), *drafts], TREE, K)])["attn"]["a"]
    want = _path_oracle(
        "a",
        [("p", i) for i in range(n + 1)],
        drafts,
        TREE,
        window=getattr(spec, "sliding_window", None),
        chunk=getattr(spec, "attention_chunk_size", None),
        alibi=slopes,
    )
    for i in range(K):
        _close(got[1 + i], want[i], f"{backend} {kind} alibi={alibi} draft {i}")


def _slot_depths(masks: Any) -> Any:
    """Each draft's depth taken as its slot (the chain's), not its ancestors' count."""
    return np.arange(1, len(masks) + 1, dtype=np.int64)


def _slot_positions(ancestors: torch.Tensor, num_drafts: int, seq_len: int) -> Any:
    keys = torch.arange(seq_len, dtype=torch.int64)
    return keys[seq_len - ancestors.shape[0] :].clone(), keys


@pytest.mark.parametrize(("kind", "alibi"), [("window", False), ("chunked", False), ("full", True)])
def test_drafts_placed_at_their_slots_are_caught(kind: str, alibi: bool) -> None:
    from attnkit.backends.cpu_attn import backend as cpu_backend
    from attnkit.kernels.attention import reference as ref_kernel

    for target, name, broken, backend in [
        (cpu_backend, "_popcounts", _slot_depths, "cpu_attn"),
        (ref_kernel, "_draft_tree_positions", _slot_positions, "reference"),
    ]:
        with _broken(target, name, broken), pytest.raises(AssertionError, match="draft"):
            test_tree_drafts_sit_at_their_depth_for_windows_chunks_and_alibi(backend, kind, alibi)


def _chain_masks(parents: Sequence[int]) -> list[int]:
    """Ancestor masks that ignore the tree: every earlier draft, siblings included."""
    return [(1 << (i + 1)) - 1 for i in range(len(parents))]


@pytest.mark.parametrize("backend", TREE_BACKENDS)
def test_a_mask_that_sees_siblings_is_caught(backend: str) -> None:
    with (
        _broken(_spec, "tree_ancestors", _chain_masks),
        pytest.raises(AssertionError, match="draft"),
    ):
        test_tree_verify_equals_each_path_against_the_float64_oracle(backend)


# ---------------------------------------------------------------- rollback


def _kv_at(rt: AttentionRuntime, rid: str, n: int) -> torch.Tensor:
    """The keys and values the attention layer holds at positions ``0 .. n - 1``."""
    gid = rt._layer_group["attn"]
    table = rt.manager.block_table(gid, rid)
    caches = rt.kv_caches["attn"]
    rows = []
    for p in range(n):
        block, off = table[p // BS], p % BS
        if len(caches) == 2:  # K and V planes, row = slot
            rows.append(torch.stack([c[block * BS + off] for c in caches]))
        else:
            rows.append(caches[0][block, :, off])
    return torch.stack(rows)


PATHS = [(), (0,), (1,), (1, 4), (0, 3), (0, 2, 5), (1, 4, 6)]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "path-" + "-".join(map(str, p)))
@pytest.mark.parametrize(
    ("backend", "state"), [("cpu_attn", "gdn"), ("reference", "mamba2"), ("cpu_attn", None)]
)
def test_tree_rollback_then_new_tokens_equals_decoding_the_path(
    backend: str, state: str | None, path: tuple[int, ...]
) -> None:
    model = Model(backend, state)
    spec_rt, plain_rt = model.runtime(), model.runtime()
    n = 30
    prompt = [("p", i) for i in range(n)]
    for rt in (spec_rt, plain_rt):
        model.step(rt, [("a", prompt, None, 0), ("b", prompt[:12], None, 0)])
    drafts = [("d", 1, i) for i in range(K)]
    model.step(spec_rt, [("a", [("p", n), *drafts], TREE, K), ("b", [("p", 12)], None, 0)])
    spec_rt.accept({"a": list(path)})
    # The plain runtime decodes the root and the path's tokens, one at a time.
    model.step(plain_rt, [("a", [("p", n)], None, 0), ("b", [("p", 12)], None, 0)])
    for node in path:
        model.step(plain_rt, [("a", [("d", 1, node)], None, 0)])
    held = n + 1 + len(path)
    where = f"{backend}/{state} path {path}"
    assert spec_rt.manager.num_tokens("a") == plain_rt.manager.num_tokens("a") == held
    _close(_kv_at(spec_rt, "a", held), _kv_at(plain_rt, "a", held), f"{where}: cached K/V")
    if state is not None:
        for x, y in zip(_state_of(spec_rt, "a"), _state_of(plain_rt, "a"), strict=True):
            _close(x, y, f"{where}: state")
    for i in range(3):  # new tokens where the rejected drafts were
        step = [("a", [("p", held + i)], None, 0)]
        got, want = model.step(spec_rt, step), model.step(plain_rt, step)
        for name in got:
            _close(got[name]["a"], want[name]["a"], f"{where}: {name} output of token {held + i}")
    for gid in range(len(spec_rt.groups)):
        assert len(spec_rt.manager.block_table(gid, "a")) == len(
            plain_rt.manager.block_table(gid, "a")
        ), f"{where}: blocks of group {gid}"
    assert spec_rt.manager.pool.num_free_blocks == plain_rt.manager.pool.num_free_blocks


def test_a_rollback_that_leaves_the_path_in_place_is_caught() -> None:
    with (
        _broken(_spec, "_copy_slots", lambda *args: None),
        pytest.raises(AssertionError, match="cached K/V"),
    ):
        test_tree_rollback_then_new_tokens_equals_decoding_the_path("cpu_attn", None, (1, 4))


def test_a_state_path_from_the_previous_draft_is_caught() -> None:
    """State sub-steps that run each draft from the draft before it (a chain)."""
    original = _spec.SpeculativeCalls._prepare_verify

    def as_chain(self: Any, drafts: Any, trees: Any, rows: Any, lens: Any) -> None:
        original(self, drafts, None, rows, lens)
        if self._verify is not None:
            self._verify.trees = trees

    with (
        _broken(_spec.SpeculativeCalls, "_prepare_verify", as_chain),
        pytest.raises(AssertionError, match="state"),
    ):
        test_tree_rollback_then_new_tokens_equals_decoding_the_path("reference", "mamba2", (1, 4))


# ---------------------------------------------------------------- checks


def test_draft_parents_are_checked_where_the_request_is_made() -> None:
    with pytest.raises(InvalidArgumentError, match=r"draft_parents\[1\] must be an int in -1..0"):
        ScheduledRequest("a", 4, num_draft_tokens=3, draft_parents=(-1, 1, 0))
    with pytest.raises(InvalidArgumentError, match="one entry per draft token"):
        ScheduledRequest("a", 4, num_draft_tokens=3, draft_parents=(-1, 0))
    with pytest.raises(InvalidArgumentError, match=r"draft_parents\[2\]"):
        ScheduledRequest("a", 4, num_draft_tokens=3, draft_parents=(-1, 0, True))  # type: ignore[arg-type]  # a bool is refused
    assert not ScheduledRequest("a", 4, num_draft_tokens=3, draft_parents=(-1, 0, 1)).is_tree


def test_trees_wider_than_the_config_and_bad_paths_are_refused() -> None:
    model = Model("reference", "gdn", width=2)
    rt = model.runtime()
    model.step(rt, [("a", [("p", i) for i in range(20)], None, 0)])
    wide = (-1, -1, -1, 0, 1, 2, 3)
    with pytest.raises(EngineLimitError, match=r"3 draft tokens at one depth; AttentionConfig\.draft_tree_width=2"):
        rt.begin_step([ScheduledRequest("a", 8, num_draft_tokens=K, draft_parents=wide)])
    tree = (-1, -1, 0, 1, 2, 3, 4)
    model.step(rt, [("a", [("p", 20)] + [("d", 1, i) for i in range(K)], tree, K)])
    free = rt.manager.pool.num_free_blocks
    for bad, match in [
        ({"a": [2]}, r"accepted\['a'\] must be a path .* draft 2 \(at 0\) has parent 0, not -1"),
        ({"a": [0, 3]}, "draft 3 .* has parent 1, not 0"),
        ({"a": [0, 9]}, r"accepted\['a'\]\[1\] must be a draft index in 0..6"),
        ({"a": 2}, r"int in 0..1 \(the chain its tree starts with"),
        ({}, "must name every request whose drafts are a tree"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            rt.accept(bad)
    assert rt.manager.num_tokens("a") == 28
    assert rt.manager.pool.num_free_blocks == free
    rt.accept({"a": [1, 3, 5]})
    assert rt.manager.num_tokens("a") == 24


def test_config_and_selection_say_why_trees_are_refused() -> None:
    with pytest.raises(ValueError, match=r"draft_tree_width=4 needs num_speculative_tokens in 4\.\.63"):
        AttentionConfig(num_speculative_tokens=3, draft_tree_width=4)
    config = AttentionConfig(num_speculative_tokens=7, draft_tree_width=3)
    window = SlidingWindowSpec(
        block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32, sliding_window=8
    )

    def reasons(name: str, spec: Any) -> list[str]:
        backend = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False).get(name)
        request = BackendRequest(spec=spec, device=torch.device("cpu"), config=config)
        return backend.not_supported_reasons(request)

    assert reasons("reference", FULL) == []
    assert reasons("cpu_attn", FULL) == []
    assert reasons("cpu_attn", window) == []
    assert any(
        "draft trees (AttentionConfig.draft_tree_width=3) not supported on kind=sliding_window"
        in r
        for r in reasons("triton_attn", window)
    )
    alibi = BackendRequest(
        spec=FULL,
        device=torch.device("cpu"),
        config=config,
        features=frozenset({AttentionFeature.ALIBI}),
    )
    registry = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    assert registry.get("cpu_attn").not_supported_reasons(alibi) == []
    assert (
        "draft trees (AttentionConfig.draft_tree_width=3) not supported with alibi (a draft's "
        "distances would be counted in slots, not along its path)"
        in registry.get("triton_attn").not_supported_reasons(alibi)
    )
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=D, dtype=torch.float32)
    assert any(
        "draft trees (AttentionConfig.draft_tree_width=3) not supported (draft chains only)" in r
        for r in reasons("triton_mla", mla)
    )

    class Shallow(ReferenceBackend):
        draft_trees = DraftTreeSupport(
            kinds=frozenset({KVCacheSpecKind.FULL_ATTENTION}), max_width=2, max_depth=4
        )

    request = BackendRequest(spec=FULL, device=torch.device("cpu"), config=config)
    assert Shallow.not_supported_reasons(request) == [
        "draft trees (AttentionConfig.draft_tree_width=3) not supported (max width 2)",
        "draft trees as deep as num_speculative_tokens=7 not supported (max depth 4)",
    ]


# ------------------------------------------------------- the kernels directly


@pytest.mark.parametrize("num_splits", [0, 3], ids=["one-pass", "split-kv"])
def test_triton_kernels_take_the_tree_on_both_paths(num_splits: int) -> None:
    _triton_tree_check(num_splits, chain=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_splits", [0, 3], ids=["one-pass", "split-kv"])
def test_triton_kernels_take_the_tree_on_a_gpu(num_splits: int) -> None:
    _triton_tree_check(num_splits, chain=False, device="cuda")


def _triton_tree_check(num_splits: int, *, chain: bool, device: str = "cpu") -> None:
    """Both Triton paths against a float64 softmax under a dense ancestor mask
    (``chain``: launched without the tree, the broken variant)."""
    pytest.importorskip("triton")
    from attnkit.kernels.attention.triton import paged_attention
    from attnkit.kernels.attention.triton_plan import plan_paged_attention

    gen = _gen("kernels", num_splits)
    trees = [TREE, (-1, -1, 1)]
    context = [40, 17]  # tokens before the drafts (the root included)
    seq = [c + len(t) for c, t in zip(context, trees, strict=True)]
    qlens = [1 + len(t) for t in trees]  # the root and its drafts
    nb = 16
    cache = torch.randn(nb, 2, BS, HKV, D, generator=gen)
    perm = torch.randperm(nb - 1, generator=gen) + 1  # shuffled physical blocks
    table = torch.zeros(2, 4, dtype=torch.int32)
    table[0], table[1] = perm[:4], perm[4:8]
    q = torch.randn(sum(qlens), HQ, D, generator=gen)
    ancestors = torch.zeros(sum(qlens), dtype=torch.int64)
    row = 0
    for t, n in zip(trees, qlens, strict=True):
        for i, mask in enumerate(_ancestor_mask(t).tolist()):
            ancestors[row + 1 + i] = sum(1 << j for j, seen in enumerate(mask) if seen)
        row += n
    qsl = torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32)
    counts = torch.tensor([len(t) for t in trees], dtype=torch.int32)
    on = torch.device(device)
    plan = plan_paged_attention(
        qsl.to(on),
        torch.tensor(seq, dtype=torch.int32, device=on),
        table.to(on),
        max_query_len=max(qlens),
        max_seq_len=max(seq),
        block_size=BS,
        num_kv_heads=HKV,
        num_splits=num_splits,
        device=on,
    )
    out = torch.full_like(q, float("nan"), device=on)
    paged_attention(
        q.to(on),
        cache.to(on),
        plan,
        scale=D**-0.5,
        output=out,
        draft_ancestors=None if chain else ancestors.to(on),
        draft_counts=None if chain else counts.to(on),
    )
    out = out.cpu()
    row = 0
    for b, (t, n) in enumerate(zip(trees, qlens, strict=True)):
        slots = [int(table[b, p // BS]) * BS + p % BS for p in range(seq[b])]
        flat = cache.permute(0, 2, 1, 3, 4).reshape(nb * BS, 2, HKV, D)[slots].double()
        keys = flat[:, 0].repeat_interleave(HQ // HKV, 1)
        values = flat[:, 1].repeat_interleave(HQ // HKV, 1)
        first = context[b]
        visible = torch.ones(n, seq[b], dtype=torch.bool)
        visible[0, first:] = False  # the root sees the context up to itself
        visible[1:, first:] = _ancestor_mask(t)
        scores = torch.einsum("thd,nhd->thn", q[row : row + n].double(), keys) / D**0.5
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        want = torch.einsum("thn,nhd->thd", scores.softmax(-1), values)
        _close(out[row : row + n], want, f"{plan.num_splits} splits, request {b}")
        row += n


def test_triton_kernels_without_the_tree_are_caught() -> None:
    with pytest.raises(AssertionError, match="request 0"):
        _triton_tree_check(0, chain=True)


# -------------------------------------------------- a state machine in lockstep


def _width(parents: Sequence[int]) -> int:
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max((depth.count(d) for d in set(depth)), default=0)


class TreeAcceptReject(RuleBasedStateMachine):
    """Two runtimes: ``spec`` verifies draft trees and keeps a path of each, ``plain``
    only ever decodes the root and the kept path. After every step they must agree:
    held tokens, cached K/V, states, blocks, outputs; no leak, no block held twice."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model("cpu_attn", "gdn")
        self.spec = self.model.runtime()
        self.plain = self.model.runtime()
        self.length: dict[str, int] = {}
        self.next_id = 0
        self.steps = 0

    @initialize()
    def start(self) -> None:
        self._admit(13)

    def _admit(self, n: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        for rt in (self.spec, self.plain):
            self.model.step(rt, [(rid, [("p", i) for i in range(n)], None, 0)])
        self.length[rid] = n

    @rule(n=st.integers(1, 40))
    def admit(self, n: int) -> None:
        if len(self.length) < 3:
            self._admit(n)

    @rule(data=st.data())
    def verify(self, data: st.DataObject) -> None:
        self.steps += 1
        rids = sorted(self.length)
        trees: dict[str, tuple[int, ...]] = {}
        paths: dict[str, list[int]] = {}
        for r in rids:
            k = data.draw(st.integers(0, K), label=f"drafts {r}")
            parents = tuple(data.draw(st.integers(-1, i - 1), label=f"{r} parent {i}") for i in range(k))
            if _width(parents) > 3:
                parents = tuple(range(-1, k - 1))
            trees[r] = parents
            leaf = data.draw(st.integers(-1, k - 1), label=f"{r} last kept")
            path: list[int] = []
            while leaf >= 0:
                path.insert(0, leaf)
                leaf = parents[leaf]
            paths[r] = path
        batch = [
            (r, [("p", self.length[r])] + [("d", self.steps, i) for i in range(len(t))], t or None, len(t))
            for r, t in trees.items()
        ]
        self.model.step(self.spec, batch)
        self.spec.accept(paths)
        self.model.step(self.plain, [(r, [("p", self.length[r])], None, 0) for r in rids])
        for depth in range(max(len(p) for p in paths.values())):
            self.model.step(
                self.plain,
                [(r, [("d", self.steps, p[depth])], None, 0) for r, p in paths.items() if len(p) > depth],
            )
        for r in rids:
            self.length[r] += 1 + len(paths[r])
        # A new token for everyone in both: the same outputs where rejected drafts were.
        step = [(r, [("p", self.length[r])], None, 0) for r in rids]
        got, want = self.model.step(self.spec, step), self.model.step(self.plain, step)
        for name, per_request in want.items():
            for r, rows in per_request.items():
                _close(got[name][r], rows, f"{name} {r}")
        for r in rids:
            self.length[r] += 1

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if len(self.length) > 1:
            rid = data.draw(st.sampled_from(sorted(self.length)))
            self.spec.free([rid])
            self.plain.free([rid])
            del self.length[rid]

    @invariant()
    def agree(self) -> None:
        for rid, n in self.length.items():
            assert self.spec.manager.num_tokens(rid) == self.plain.manager.num_tokens(rid) == n
            _close(_kv_at(self.spec, rid, n), _kv_at(self.plain, rid, n), f"{rid}: cached K/V")
            for x, y in zip(_state_of(self.spec, rid), _state_of(self.plain, rid), strict=True):
                _close(x, y, f"{rid}: state")
            for gid in range(len(self.spec.groups)):
                a = len(self.spec.manager.block_table(gid, rid))
                assert a == len(self.plain.manager.block_table(gid, rid)), f"{rid}: blocks"
        assert self.spec.manager.pool.num_free_blocks == self.plain.manager.pool.num_free_blocks

    @invariant()
    def no_leak_no_double_owner(self) -> None:
        manager = self.spec.manager
        seen: set[tuple[int, int]] = set()
        for blocks in manager.owned_blocks().values():
            assert not blocks & seen, "a block held by two requests"
            seen |= blocks
        pages = manager.owned_pages()
        used = set().union(*pages.values()) if pages else set()
        assert manager.pool.num_free_blocks + len(used) == manager.pool.num_blocks - 1, "leak"


TreeAcceptReject.TestCase.settings = settings(
    max_examples=6,
    stateful_step_count=5,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTreeAcceptReject = TreeAcceptReject.TestCase


def test_the_state_machine_catches_a_rollback_that_leaves_the_path_in_place() -> None:
    with (
        _broken(_spec, "_copy_slots", lambda *args: None),
        pytest.raises(AssertionError, match=r"cached K/V|output|state"),
    ):
        # No shrinking: the first failing run is the proof, and shrinking it is slow.
        run_state_machine_as_test(
            TreeAcceptReject,
            settings=settings(
                TreeAcceptReject.TestCase.settings,
                phases=[Phase.generate],
                derandomize=True,
                database=None,
            ),
        )
