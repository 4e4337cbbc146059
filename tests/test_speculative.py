"""Speculative decoding through the runtime: verify steps of ``1 + k`` tokens, and
``accept`` taking rejected drafts back.

References, all independent of the code under test:
- a verify step's outputs against the same tokens decoded one step at a time, and
  (attention) against a dense float64 softmax over every key the query may see;
- a rollback followed by new tokens against a second runtime that never saw the
  rejected drafts: outputs, held tokens, pool usage and state tensors;
- a hypothesis state machine over accept/reject patterns, two runtimes in lockstep:
  no leaked block, no block held twice, exact lengths and states.
Each check has a deliberately broken variant shown to be caught.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from typing_extensions import override

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    ChunkedLocalAttentionSpec,
    EngineLimitError,
    FullAttentionSpec,
    InvalidArgumentError,
    MambaSpec,
    ScheduledRequest,
    SlidingWindowSpec,
    StaleStepError,
)
from attnkit.backend_api import AttentionCGSupport, CommonAttentionMetadata, bind_each
from attnkit.backends.reference import (
    ReferenceAttentionBuilder,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
    ReferenceBackend,
)
from attnkit.kv_cache import KVCacheManager
from attnkit.registry import BUILTIN_BACKENDS, BackendRegistry
from attnkit.runtime import _spec
from attnkit.spec import KVCacheSpecKind
from attnkit.state_types import STATE_TYPES, state_type_of
from attnkit.testing import check_cudagraph
from attnkit.testing.strategies import LayerChoice
from speculative_helpers import broken as _broken
from speculative_helpers import gen as _gen
from speculative_helpers import state_of as _state_of

HQ, HKV, D, BS = 4, 2, 32, 16
TOL = 2e-5

ATTENTION_SPECS: dict[str, Any] = {
    "full": FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32),
    "window": SlidingWindowSpec(
        block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32, sliding_window=19
    ),
    "chunked": ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32, attention_chunk_size=32
    ),
}
ATTENTION_BACKENDS = ("reference", "cpu_attn", "triton_attn")


class Model:
    """Layers of one runtime, with inputs that are a function of (request, position,
    variant): the same token gets the same rows in every runtime; a rejected draft
    (variant 1) gets other rows than the token accepted there later (variant 0)."""

    def __init__(
        self,
        attention: Mapping[str, str] | None = None,
        state: str | None = None,
        k: int = 7,
        caching: bool = False,
        state_backend: str | None = None,
    ) -> None:
        self.specs: dict[str, Any] = {}
        self.params: dict[str, Any] = {}
        per_kind: dict[str, str] = {}
        for kind, backend in (attention or {"full": "reference"}).items():
            spec = ATTENTION_SPECS[kind]
            self.specs[f"attn.{kind}"] = spec
            self.params[f"attn.{kind}"] = AttentionLayerParams(num_heads=HQ)
            per_kind[spec.kind.value] = backend
        self.state = state
        if state is not None:
            state_type = state_type_of(state)
            params = state_type.example(torch.Generator().manual_seed(0), torch.device("cpu"))
            self.specs["mixer"] = MambaSpec(
                block_size=BS,
                shapes=params.state_shapes,
                dtypes=state_type.state_dtypes(torch.float32),
                mamba_type=state,
            )
            self.params["mixer"] = params
            if state_backend is not None:
                per_kind["mamba"] = state_backend
        self.config = AttentionConfig(
            backend_per_kind=per_kind,
            num_speculative_tokens=k,
            max_num_reqs=8,
            prefix_caching={"enabled": caching},
        )

    def runtime(self, budget: int = 2**22) -> AttentionRuntime:
        return AttentionRuntime(
            self.specs,
            self.config,
            device="cpu",
            memory_budget_bytes=budget,
            layer_params=self.params,
            cache_fill=float("nan"),
        )

    def rows(self, name: str, rid: str, pos: int, variant: int) -> Any:
        gen = _gen(name, rid, pos, variant)
        if name.startswith("attn."):
            return (torch.randn(HQ, D, generator=gen), *torch.randn(2, HKV, D, generator=gen))
        state_type = state_type_of(self.state or "mamba2")
        return state_type.example_inputs(self.params[name], 1, gen, torch.device("cpu"))

    def step(
        self,
        rt: AttentionRuntime,
        scheduled: list[tuple[str, int, int, int]],
        variant: int | None = None,
    ) -> dict[str, dict[str, torch.Tensor]]:
        """``(rid, first position, tokens, drafts)`` per request; drafts get variant 1
        (``variant``: every token gets that one). Returns layer -> request -> rows."""
        batch = rt.begin_step(
            [ScheduledRequest(rid, n, num_draft_tokens=d) for rid, _, n, d in scheduled]
        )
        by_id = {rid: (p, n, d) for rid, p, n, d in scheduled}
        out: dict[str, dict[str, torch.Tensor]] = {}
        slices = batch.token_slices()
        for name in self.specs:
            per_token = []
            for rid in batch.order:
                p, n, d = by_id[rid]
                per_token += [
                    self.rows(name, rid, p + i, variant if variant is not None else int(i >= n - d))
                    for i in range(n)
                ]
            if name.startswith("attn."):
                q = torch.stack([r[0] for r in per_token])
                k = torch.stack([r[1] for r in per_token])
                v = torch.stack([r[2] for r in per_token])
                y = rt.forward(name, q, k, v)
            else:
                fields = type(per_token[0]).__dataclass_fields__
                inputs = type(per_token[0])(
                    **{f: torch.cat([getattr(r, f) for r in per_token]) for f in fields}
                )
                y = rt.forward_state(name, inputs)
            out[name] = {rid: y[s].clone() for rid, s in slices.items()}
        return out


def _oracle(
    model: Model, name: str, rid: str, pos: int, variants: Mapping[int, int]
) -> torch.Tensor:
    """Dense float64 attention of the query at ``pos`` over every key it may see
    (``variants``: position -> the variant of the token there)."""
    spec = ATTENTION_SPECS[name.split(".")[1]]
    lo = 0
    if isinstance(spec, SlidingWindowSpec):
        lo = max(0, pos - spec.sliding_window + 1)
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        lo = pos // spec.attention_chunk_size * spec.attention_chunk_size
    q = model.rows(name, rid, pos, variants.get(pos, 0))[0].double()
    keys = [model.rows(name, rid, p, variants.get(p, 0)) for p in range(lo, pos + 1)]
    k = torch.stack([r[1] for r in keys]).double()  # [n, Hkv, D]
    v = torch.stack([r[2] for r in keys]).double()
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("hd,nhd->hn", q, k) / D**0.5
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v)


def _close(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    err = (got.double() - want.double()).abs().max().item()
    assert err <= TOL, f"{where}: max error {err:.3g} > {TOL}"


# ------------------------------------------------------------- verify = decodes


@pytest.mark.parametrize("k", [3, 7])
@pytest.mark.parametrize("kind", list(ATTENTION_SPECS))
@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_verify_step_equals_decodes_and_the_float64_oracle(backend: str, kind: str, k: int) -> None:
    if backend == "triton_attn":
        pytest.importorskip("triton")
    model = Model({kind: backend}, k=k)
    name = f"attn.{kind}"
    verify_rt, decode_rt = model.runtime(), model.runtime()
    prompts = {"a": 37, "b": 16}
    for rt in (verify_rt, decode_rt):
        model.step(rt, [(rid, 0, n, 0) for rid, n in prompts.items()])
    # Every request verifies 1 + k tokens (a uniform batch), all drafts accepted later.
    got = model.step(verify_rt, [(rid, n, 1 + k, k) for rid, n in prompts.items()])
    verify_rt.accept({rid: k for rid in prompts})
    # The same tokens one decode at a time (the drafts' rows are variant 1).
    for i in range(1 + k):
        one = model.step(decode_rt, [(rid, n + i, 1, 0) for rid, n in prompts.items()], int(i > 0))
        for rid, n in prompts.items():
            where = f"{backend} {kind} k={k} request {rid} position {n + i}"
            row = got[name][rid][i]
            _close(row, one[name][rid][0], f"{where} (vs one decode)")
            variants = {n + j: 1 for j in range(1, 1 + k)}
            _close(row, _oracle(model, name, rid, n + i, variants), f"{where} (vs float64)")


TRITON_STATE = {"mamba2": "triton_mamba2", "gdn": "triton_gdn"}


@pytest.mark.parametrize(
    ("state", "backend"),
    [(s, None) for s in STATE_TYPES] + [(s, b) for s, b in TRITON_STATE.items()],
)
def test_state_verify_step_equals_decodes(state: str, backend: str | None) -> None:
    if backend is not None:
        pytest.importorskip("triton")
    k = 4
    model = Model(state=state, k=k, state_backend=backend)
    verify_rt, decode_rt = model.runtime(), model.runtime()
    # "b" prefills in the verify step (a prefill next to drafting requests).
    for rt in (verify_rt, decode_rt):
        model.step(rt, [("a", 0, 21, 0)])
    # "b" first: in the sub-step of first tokens, "a" (a decode there) must come first.
    got = model.step(verify_rt, [("b", 0, 9, 0), ("a", 21, 1 + k, k)])
    first = model.step(decode_rt, [("a", 21, 1, 0), ("b", 0, 9, 0)])
    _close(got["mixer"]["a"][0], first["mixer"]["a"][0], f"{state} root token")
    _close(got["mixer"]["b"], first["mixer"]["b"], f"{state} prefill beside the drafts")
    for i in range(1, 1 + k):
        one = model.step(decode_rt, [("a", 21 + i, 1, 0)], 1)
        _close(got["mixer"]["a"][i], one["mixer"]["a"][0], f"{state} draft {i}")
    # Every draft accepted: the state is the one after the last draft.
    verify_rt.accept({"a": k})
    for x, y in zip(_state_of(verify_rt, "a"), _state_of(decode_rt, "a"), strict=True):
        _close(x, y, f"{state} state after all drafts")


# ---------------------------------------------------------------- rollback


def check_same(
    a: AttentionRuntime, b: AttentionRuntime, rids: list[str], state: bool, pool: bool = True
) -> None:
    """What a rollback must leave: the same held tokens, blocks, pool usage and states
    as a runtime that never saw the rejected drafts. (Right after ``accept`` the pool
    may differ by the window blocks the verify step's first query still saw: releases
    follow each step's first query, so they catch up at the next step; ``pool=False``.)"""
    for rid in rids:
        assert a.manager.num_tokens(rid) == b.manager.num_tokens(rid), f"{rid}: held tokens"
        for gid in range(len(a.groups)):
            ta, tb = a.manager.block_table(gid, rid), b.manager.block_table(gid, rid)
            assert len(ta) == len(tb), f"{rid}: group {gid} holds {len(ta)} blocks, not {len(tb)}"
        if state:
            for sa, sb in zip(_state_of(a, rid), _state_of(b, rid), strict=True):
                _close(sa, sb, f"{rid}: state")
    if pool:
        assert a.manager.pool.num_free_blocks == b.manager.pool.num_free_blocks, "free pages"


ROLLBACK_MODELS = {
    "attention": lambda: Model({"full": "cpu_attn", "window": "cpu_attn", "chunked": "reference"}),
    **{f"hybrid-{s}": (lambda s=s: Model({"full": "cpu_attn"}, state=s)) for s in STATE_TYPES},
}


@pytest.mark.parametrize("accepted", [0, 2, 7])
@pytest.mark.parametrize("which", list(ROLLBACK_MODELS))
def test_rollback_then_new_tokens_equals_never_seeing_the_drafts(which: str, accepted: int) -> None:
    model = ROLLBACK_MODELS[which]()
    k = 7
    spec_rt, plain_rt = model.runtime(), model.runtime()
    for rt in (spec_rt, plain_rt):
        model.step(rt, [("a", 0, 30, 0), ("b", 0, 12, 0)])
    # "a" verifies 1 + k tokens, its first `accepted` drafts are right: the plain
    # runtime gets the same tokens (variant 1 rows) and never the rejected ones.
    model.step(spec_rt, [("a", 30, 1 + k, k), ("b", 12, 1, 0)])
    spec_rt.accept({"a": accepted})
    with pytest.raises(StaleStepError):
        spec_rt.forward(
            "attn.full", torch.zeros(1, HQ, D), torch.zeros(1, HKV, D), torch.zeros(1, HKV, D)
        )
    model.step(plain_rt, [("a", 30, 1, 0), ("b", 12, 1, 0)])
    for i in range(1, accepted + 1):  # an accepted draft's rows are variant 1
        model.step(plain_rt, [("a", 30 + i, 1, 0)], 1)
    check_same(spec_rt, plain_rt, ["a", "b"], model.state is not None, pool=False)
    start = 31 + accepted
    for i in range(3):  # new tokens (variant 0) where rejected drafts were
        got = model.step(spec_rt, [("a", start + i, 1, 0)])
        want = model.step(plain_rt, [("a", start + i, 1, 0)])
        for name in model.specs:
            _close(got[name]["a"], want[name]["a"], f"{which} {name} token {start + i}")
    check_same(spec_rt, plain_rt, ["a", "b"], model.state is not None)


def test_accept_checks_everything_first_and_changes_nothing_on_refusal() -> None:
    model = Model(state="mamba2", k=3)
    rt = model.runtime()
    model.step(rt, [("a", 0, 20, 0)])
    with pytest.raises(EngineLimitError, match="num_speculative_tokens=3"):
        rt.begin_step([ScheduledRequest("a", 5, num_draft_tokens=4)])
    with pytest.raises(InvalidArgumentError, match="first step"):
        rt.begin_step([ScheduledRequest("z", 5, num_draft_tokens=2)])
    with pytest.raises(InvalidArgumentError, match="below num_new_tokens"):
        ScheduledRequest("a", 3, num_draft_tokens=3)
    model.step(rt, [("a", 20, 4, 3)])
    before = (rt.manager.num_tokens("a"), _state_of(rt, "a"))
    for bad in ({"a": 4}, {"a": -1}, {"zz": 0}, {"a": True}):
        with pytest.raises(InvalidArgumentError):
            rt.accept(bad)
    assert rt.manager.num_tokens("a") == before[0] == 24
    for x, y in zip(_state_of(rt, "a"), before[1], strict=True):
        assert torch.equal(x, y)
    rt.accept({"a": 1})
    assert rt.manager.num_tokens("a") == 22
    with pytest.raises(StaleStepError, match="already ran"):
        rt.accept({"a": 0})


def test_draft_states_are_counted_in_the_budget_and_the_report() -> None:
    with_drafts = Model(state="gdn", k=4).runtime(2**23)
    without = Model(state="gdn", k=0).runtime(2**23)
    params = with_drafts.layer_params["mixer"]
    assert params is not None
    per_state = sum(
        torch.Size(s).numel() * 4
        for s in params.state_shapes  # float32 states
    )
    report = with_drafts.memory_report()
    assert report.draft_state_bytes == per_state * 4 * 8  # k x max_num_reqs
    assert without.memory_report().draft_state_bytes == 0
    assert "draft states" in report.describe()
    assert with_drafts.num_blocks < without.num_blocks


def test_the_plan_counts_the_draft_states_as_the_runtime_does() -> None:
    from attnkit.planner import plan_model

    model = Model({"full": "reference"}, state="mamba2", k=4)
    runtime = model.runtime(2**23)
    plan = plan_model(
        model.specs, model.config, device="cpu", layer_params=model.params, memory_bytes=2**23
    )
    assert plan.draft_state_bytes == runtime.memory_report().draft_state_bytes > 0
    assert plan.num_blocks == runtime.num_blocks
    without = plan_model(
        model.specs,
        model.config.model_copy(update={"num_speculative_tokens": 0}),
        device="cpu",
        layer_params=model.params,
        memory_bytes=2**23,
    )
    assert without.draft_state_bytes == 0
    assert without.num_blocks is not None
    assert plan.num_blocks is not None
    assert without.num_blocks > plan.num_blocks


# ------------------------------------------------ broken variants are caught


def _lengths_only(self: KVCacheManager, rows: Any, num_tokens: Any) -> None:
    """take_back that forgets to give the emptied blocks back."""
    self._num_tokens[rows] = num_tokens


def test_a_rollback_that_keeps_emptied_blocks_is_caught() -> None:
    with (
        _broken(KVCacheManager, "take_back", _lengths_only),
        pytest.raises(AssertionError, match=r"blocks|free pages"),
    ):
        test_rollback_then_new_tokens_equals_never_seeing_the_drafts("attention", 0)


def test_a_rollback_that_keeps_the_last_state_is_caught() -> None:
    original = _spec.SpeculativeCalls.accept

    def lengths_only(self: Any, accepted: Mapping[str, int]) -> None:
        """accept that takes tokens back but leaves the states after every draft."""
        if self._verify is not None:
            self._verify.state_blocks = {}
        original(self, accepted)

    with (
        _broken(_spec.SpeculativeCalls, "accept", lengths_only),
        pytest.raises(AssertionError, match="state"),
    ):
        test_rollback_then_new_tokens_equals_never_seeing_the_drafts("hybrid-mamba2", 2)


def test_a_verify_step_without_per_position_states_is_caught() -> None:
    original = _spec.SpeculativeCalls._prepare_verify

    def whole_step(self: Any, drafts: Any, trees: Any, rows: Any, lens: Any) -> None:
        """State layers run the verify step whole: no state kept per draft position."""
        original(self, drafts, trees, rows, lens)
        if self._verify is not None:
            self._verify.sub_steps = {}

    with (
        _broken(_spec.SpeculativeCalls, "_prepare_verify", whole_step),
        pytest.raises(AssertionError, match="state"),
    ):
        test_rollback_then_new_tokens_equals_never_seeing_the_drafts("hybrid-gdn", 2)


# ------------------------------------- the kit's uniform-batch (verify) capture


class _FixedBuffersBuilder(ReferenceAttentionBuilder):
    """Claims UNIFORM_BATCH; capture builds copy the step's tensors into buffers kept
    from the first capture (what a captured graph reads on every replay)."""

    cudagraph_support = AttentionCGSupport.UNIFORM_BATCH
    written_per_request: int | None = None

    @override
    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> ReferenceAttentionMetadata:
        meta = super().build_for_cudagraph_capture(common_attn_metadata)
        kept: dict[str, torch.Tensor] = self.__dict__.setdefault("_kept", {})
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(meta):
            value = getattr(meta, f.name)
            if not isinstance(value, torch.Tensor) or not value.numel():
                continue
            if f.name == "slot_mapping" and self.written_per_request is not None:
                value = value.clone()  # a buffer that holds `written_per_request` per request
                qsl = common_attn_metadata.query_start_loc_cpu.tolist()
                for lo, hi in itertools.pairwise(qsl):
                    value[lo + self.written_per_request : hi] = -1
            if f.name == "block_table":  # as wide as the longest request can need
                width = -(-self.config.max_model_len // self.kv_cache_spec.block_size)
                wide = value.new_zeros((value.shape[0], width))
                wide[:, : value.shape[1]] = value
                value = wide
            buffer = kept.get(f.name)
            if buffer is None or buffer.shape != value.shape:
                kept[f.name] = buffer = value.clone()
            else:
                buffer.copy_(value)
            fields[f.name] = buffer
        return dataclasses.replace(meta, **fields)


class _OneDraftBuilder(_FixedBuffersBuilder):
    """Capture buffers sized for one draft per request (2 queries): at 1 + 4 the drafts'
    keys are never written."""

    written_per_request = 2


class CapturesVerifyBatches(ReferenceBackend):
    name = "captures_verify_batches"
    builders = bind_each((FullAttentionSpec,), _FixedBuffersBuilder, ReferenceAttentionImpl)


class CapturesOneDraft(ReferenceBackend):
    name = "captures_one_draft"
    builders = bind_each((FullAttentionSpec,), _OneDraftBuilder, ReferenceAttentionImpl)


def _graph_problem(backend: type[ReferenceBackend]) -> str | None:
    """The kit's UNIFORM_BATCH check on a full-attention layer (``check_cudagraph``, as
    ``check_backend`` runs it)."""
    registry = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    registry.register(backend, replace=True)
    choice = LayerChoice(KVCacheSpecKind.FULL_ATTENTION)
    _, problem, moved = check_cudagraph(
        choice, AttentionCGSupport.UNIFORM_BATCH, backend.name, registry, torch.device("cpu"), 0
    )
    assert not moved
    return problem


def test_the_kit_checks_uniform_batches_on_verify_shaped_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _graph_problem(CapturesVerifyBatches) is None
    # Buffers that hold 2 queries per request pass a batch of 2-query requests and
    # fail the kit's 1 + 4.
    problem = _graph_problem(CapturesOneDraft)
    assert problem is not None
    assert problem.startswith("claims UNIFORM_BATCH")
    # The kit's former uniform batches (2 queries per request) did not catch it.
    from attnkit.testing import _cases

    steps = {**_cases._GRAPH_STEPS, AttentionCGSupport.UNIFORM_BATCH: ((2, 2, 2), (2, 2, 2))}
    monkeypatch.setattr(_cases, "_GRAPH_STEPS", steps)
    assert _graph_problem(CapturesOneDraft) is None


# -------------------------------------------------- a state machine in lockstep


class AcceptReject(RuleBasedStateMachine):
    """Two runtimes: ``spec`` verifies drafts and takes rejected ones back; ``plain``
    only ever decodes the tokens ``spec`` kept. After every step they must agree."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model({"full": "cpu_attn", "window": "cpu_attn"}, state="gdn", k=4)
        self.spec = self.model.runtime(2**20)
        self.plain = self.model.runtime(2**20)
        self.length: dict[str, int] = {}
        self.next_id = 0

    @initialize()
    def start(self) -> None:
        self._admit(13)

    def _admit(self, n: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        for rt in (self.spec, self.plain):
            self.model.step(rt, [(rid, 0, n, 0)])
        self.length[rid] = n

    @rule(n=st.integers(1, 40))
    def admit(self, n: int) -> None:
        if len(self.length) < 4:
            self._admit(n)

    @rule(data=st.data())
    def verify(self, data: st.DataObject) -> None:
        rids = sorted(self.length)
        drafts = {r: data.draw(st.integers(0, 4), label=f"drafts {r}") for r in rids}
        accepted = {
            r: data.draw(st.integers(0, d), label=f"accepted {r}") for r, d in drafts.items()
        }
        self.model.step(self.spec, [(r, self.length[r], 1 + d, d) for r, d in drafts.items()])
        self.spec.accept(accepted)
        # Drafts have variant-1 rows: the plain runtime decodes the kept ones as such.
        self.model.step(self.plain, [(r, self.length[r], 1, 0) for r in rids])
        for i in range(1, 1 + max(accepted.values(), default=0)):
            batch = [(r, self.length[r] + i, 1, 0) for r in rids if accepted[r] >= i]
            self._plain_drafts(batch)
        for r in rids:
            self.length[r] += 1 + accepted[r]
        # A new token for everyone in both: the same outputs where rejected drafts were.
        batch = [(r, self.length[r], 1, 0) for r in rids]
        got, want = self.model.step(self.spec, batch), self.model.step(self.plain, batch)
        for name, per_request in want.items():
            for r, rows in per_request.items():
                _close(got[name][r], rows, f"{name} {r}")
        for r in rids:
            self.length[r] += 1

    def _plain_drafts(self, batch: list[tuple[str, int, int, int]]) -> None:
        """Decode accepted drafts (their variant-1 rows) one step in ``plain``."""
        self.model.step(self.plain, batch, 1)

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if len(self.length) > 1:
            rid = data.draw(st.sampled_from(sorted(self.length)))
            self.spec.free([rid])
            self.plain.free([rid])
            del self.length[rid]

    @invariant()
    def agree(self) -> None:
        check_same(self.spec, self.plain, sorted(self.length), True)
        for rid, n in self.length.items():
            assert self.spec.manager.num_tokens(rid) == n

    @invariant()
    def no_leak_no_double_owner(self) -> None:
        manager = self.spec.manager
        owned = manager.owned_blocks()
        seen: set[tuple[int, int]] = set()
        for blocks in owned.values():
            assert not blocks & seen, "a block held by two requests"
            seen |= blocks
        pages = manager.owned_pages()
        used = set().union(*pages.values()) if pages else set()
        assert manager.pool.num_free_blocks + len(used) == manager.pool.num_blocks - 1, "leak"


AcceptReject.TestCase.settings = settings(
    max_examples=12,
    stateful_step_count=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAcceptReject = AcceptReject.TestCase


# ----------------------------------------------------------------------- MLA


def _mla_runtime(backend: str, k: int) -> AttentionRuntime:
    from attnkit import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=BS, head_size=48, dtype=torch.float32)
    return AttentionRuntime(
        {"mla": spec},
        AttentionConfig(backend_per_kind={"mla_attention": backend}, num_speculative_tokens=k),
        device="cpu",
        memory_budget_bytes=2**21,
        layer_params={"mla": AttentionLayerParams(num_heads=HQ, v_head_size=32)},
        cache_fill=float("nan"),
    )


def _mla_step(rt: AttentionRuntime, rid: str, first: int, n: int, drafts: int) -> torch.Tensor:
    rt.begin_step([ScheduledRequest(rid, n, num_draft_tokens=drafts)])
    rows = [_gen("mla", rid, first + i) for i in range(n)]
    q = torch.stack([torch.randn(HQ, 48, generator=g) for g in rows])
    latent = torch.stack([torch.randn(1, 48, generator=g) for g in rows])
    return rt.forward("mla", q, latent, None).clone()


@pytest.mark.parametrize("backend", ["reference", "triton_mla"])
def test_mla_verify_step_equals_decodes(backend: str) -> None:
    if backend == "triton_mla":
        pytest.importorskip("triton")
    k = 5
    verify, decodes, oracle = (
        _mla_runtime(backend, k),
        _mla_runtime(backend, k),
        _mla_runtime("reference", k),
    )
    for rt in (verify, decodes, oracle):
        _mla_step(rt, "a", 0, 27, 0)
    got = _mla_step(verify, "a", 27, 1 + k, k)
    want = _mla_step(oracle, "a", 27, 1 + k, k)
    for i in range(1 + k):
        one = _mla_step(decodes, "a", 27 + i, 1, 0)
        _close(got[i], one[0], f"{backend} mla position {27 + i} (vs one decode)")
        _close(got[i], want[i], f"{backend} mla position {27 + i} (vs reference)")
    verify.accept({"a": 2})
    assert verify.manager.num_tokens("a") == 27 + 3


# ------------------------------------------------------------ prefix caching


def _token_rows(tok: int, pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A token's q/k/v rows: a function of its id and position (what a model gives)."""
    gen = _gen("token", tok, pos)
    return torch.randn(HQ, D, generator=gen), *torch.randn(2, HKV, D, generator=gen)


def _cached_runtime(on: bool) -> AttentionRuntime:
    return AttentionRuntime(
        # Full attention only: a window's generated blocks are released, not cached.
        {"attn.full": ATTENTION_SPECS["full"]},
        AttentionConfig(num_speculative_tokens=4, prefix_caching={"enabled": on}),
        device="cpu",
        memory_budget_bytes=2**21,
        layer_params={"attn.full": AttentionLayerParams(num_heads=HQ)},
        cache_fill=float("nan"),
    )


def _run_tokens(
    rt: AttentionRuntime, rid: str, start: int, toks: list[int], drafts: int = 0, **kw: Any
) -> dict[str, torch.Tensor]:
    rt.begin_step([ScheduledRequest(rid, len(toks), num_draft_tokens=drafts, **kw)])
    rows = [_token_rows(t, start + i) for i, t in enumerate(toks)]
    q, k, v = (torch.stack([r[j] for r in rows]) for j in range(3))
    return {"attn.full": rt.forward("attn.full", q, k, v).clone()}


def test_rolled_back_drafts_are_never_named_in_the_prefix_cache() -> None:
    _names_scenario(check_lengths=True)


def _keeps_lengths(self: KVCacheManager, rows: Any, num_tokens: Any) -> None:
    """take_back that gives blocks back but keeps the verify step's lengths."""


def test_naming_blocks_that_hold_rejected_drafts_is_caught() -> None:
    # The lengths check is left out: the hit's outputs alone catch it.
    with (
        _broken(KVCacheManager, "take_back", _keeps_lengths),
        pytest.raises(AssertionError, match="after a hit"),
    ):
        _names_scenario(check_lengths=False)


def _names_scenario(check_lengths: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 1000, (40,), generator=gen).tolist()
    truth = prompt + torch.randint(0, 1000, (40,), generator=gen).tolist()
    rt = _cached_runtime(True)
    _run_tokens(rt, "a", 0, prompt, prefix=rt.match_prefix(prompt))
    n = len(prompt)
    accepted_pattern = [0, 3, 1, 4, 2, 0, 4, 1, 3, 2, 2, 1]
    for kept in accepted_pattern:
        if n + 5 > len(truth):
            break
        # Root (true), then 4 drafts: the first `kept` true, the rest wrong ids.
        drafts = truth[n + 1 : n + 1 + kept] + [t + 1 for t in truth[n + 1 + kept : n + 5]]
        _run_tokens(rt, "a", n, [truth[n], *drafts], drafts=4)
        rt.accept({"a": kept})
        n += 1 + kept
    held = truth[:n]
    if check_lengths:
        assert rt.manager.num_tokens("a") == n
    rt.free(["a"], token_ids={"a": held})
    # A second request whose prompt is a's tokens: it hits the named blocks, and its
    # next tokens see the same K/V as a runtime that computes it from scratch.
    second = [*held, 7, 8, 9]
    match = rt.match_prefix(second)
    if check_lengths:
        assert match.num_tokens == n // BS * BS > len(prompt)  # generated blocks hit too
    fresh = _cached_runtime(False)
    _run_tokens(fresh, "b", 0, second[: match.num_tokens])
    got = _run_tokens(rt, "b", match.num_tokens, second[match.num_tokens :], prefix=match)
    want = _run_tokens(fresh, "b", match.num_tokens, second[match.num_tokens :])
    for name in got:
        _close(got[name], want[name], f"{name} after a hit on blocks a verified")
