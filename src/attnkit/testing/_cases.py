"""Running one conformance case: the backend under test beside ``reference``.

Both run the same case through their own ``AttentionRuntime`` (caches filled with NaN,
block pools shuffled by the case's seed, so blocks are neither contiguous nor in
order) of ``case.layers`` layers in one KV-cache group (two in the fixed ragged case:
they share the step's metadata, so a layer that corrupts it fails the next one), with
identical inputs per layer, request and step; outputs are compared per layer and
request with the dtype's tolerance. After every ``forward`` of the backend under test,
its inputs, the step's metadata and every cache slot outside the step's writes must be
unchanged (``_guards``); with ``twice=True`` each call also runs a second time on a
copy of the cache as it was, and must give the same bits. ``run_case`` returns ``None`` when all holds and the first
problem, as text, otherwise. Anything the backend under test raises is a failure;
anything ``reference`` raises is a problem of the kit (``KitError``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import torch

from ..builder import AttentionCGSupport
from ..capabilities import AttentionFeature
from ..config import AttentionConfig
from ..kinds import rules_for, rules_for_kind
from ..metadata import SparseSelection
from ..params import (
    AttentionLayerParams,
    LayerParams,
    MLAProjection,
    StateLayerParams,
)
from ..registry import BackendRegistry
from ..runtime import AttentionRuntime, ScheduledRequest, StepBatch
from ..spec import IndexerSpec, KVCacheSpec, KVCacheSpecKind, MambaSpec, MLAAttentionSpec
from ..state_inputs import StateInputs
from ..state_types import StateType, state_type_of
from ._guards import CacheGeometry, Guard, compare_runs, write_slots
from .strategies import Case, LayerChoice, Step
from .tolerances import Tolerance, tolerance_for

__all__ = [
    "KitError",
    "check_cudagraph",
    "config_for",
    "make_layer",
    "run_case",
    "run_sparse_case",
    "tolerance_of",
]

REFERENCE = "reference"
SOFT_CAP = 1.5
"""Small enough that the cap changes scores of the kit's inputs by several percent."""


def _layers(case: Case) -> tuple[str, ...]:
    """The case's layers, all of its kind: one KV-cache group, whose metadata all read."""
    return tuple(f"layer{i}" for i in range(case.layers))


class KitError(Exception):
    """The reference side of a case failed: a problem of the kit or of the case, not of
    the backend under test."""


def config_for(
    kind: KVCacheSpecKind,
    backend: str,
    *,
    max_model_len: int = 160,
    max_num_batched_tokens: int = 256,
) -> AttentionConfig:
    """Small engine limits (they size CUDA-graph buffers and bound the interpreter's
    grids); cases with longer requests or larger steps raise them (``_limits``)."""
    return AttentionConfig(
        backend_per_kind={kind: backend},
        max_num_reqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
    )


def _limits(case: Case) -> dict[str, int]:
    """``config_for`` limits that hold ``case``: its longest request, its largest step."""
    totals: dict[str, int] = {}
    largest = longest = 0
    for step in case.steps:
        for rid in step.finished:
            totals.pop(rid, None)
        for rid, n, _ in step.scheduled:
            totals[rid] = totals.get(rid, 0) + n
            longest = max(longest, totals[rid])
        largest = max(largest, sum(n for _, n, _ in step.scheduled))
    return {
        "max_model_len": max(160, longest),
        "max_num_batched_tokens": max(256, largest),
    }


def tolerance_of(choice: LayerChoice) -> Tolerance:
    if choice.kind is KVCacheSpecKind.MAMBA:
        return tolerance_for(torch.float32)
    cache = choice.kv_cache_dtype
    if not rules_for_kind(choice.kind).has_cache:
        cache = "auto"  # no cache: nothing is quantised
    return tolerance_for(choice.dtype, cache)


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def mla_projection_widths(head_size: int) -> tuple[int, int, int]:
    """``(N, P, V)`` of the kit's MLA projection for a latent of ``head_size``: a quarter
    of the latent is rope (``R = D - P``), and 16-wide no-rope keys and values."""
    return 16, max(1, head_size // 4), 16


def make_layer(case: Case, device: torch.device) -> tuple[KVCacheSpec, LayerParams]:
    """The case's spec and layer parameters (weights drawn from the case's seed)."""
    choice = case.choice
    gen = torch.Generator().manual_seed(case.seed + 1)
    if choice.kind is KVCacheSpecKind.MAMBA:
        return _state_layer(choice, gen, device)
    rules = rules_for_kind(choice.kind)  # an unknown kind: an error naming the known ones
    spec = rules.example_spec(
        block_size=choice.block_size,
        num_kv_heads=case.num_kv_heads,
        head_size=choice.head_size,
        dtype=choice.dtype,
        kv_cache_dtype=choice.kv_cache_dtype,
        extent=case.window if case.window is not None else 1,
    )
    hq = case.num_heads
    features = choice.features
    extra = rules.example_layer_params(
        spec, lambda *shape: _randn(gen, *shape).to(device, choice.dtype)
    )
    projection = None
    if AttentionFeature.MLA_PROJECTION in features:
        nope, rope, v_dim = mla_projection_widths(choice.head_size)
        rank = choice.head_size - rope
        projection = MLAProjection(
            w_uk=_randn(gen, hq, rank, nope, scale=rank**-0.5).to(device, choice.dtype),
            w_uv=_randn(gen, hq, rank, v_dim, scale=rank**-0.5).to(device, choice.dtype),
        )
    params = AttentionLayerParams(
        num_heads=hq,
        scale=choice.scale,
        mla_projection=projection,
        logits_soft_cap=SOFT_CAP if AttentionFeature.LOGITS_SOFT_CAP in features else None,
        alibi_slopes=(
            tuple(2.0 ** (-(i + 1) / 2) for i in range(hq))
            if AttentionFeature.ALIBI in features
            else None
        ),
        sinks=(
            _randn(gen, hq).to(device) if AttentionFeature.ATTENTION_SINKS in features else None
        ),
        return_lse=AttentionFeature.RETURN_LSE in features,
        # Static scales: a per-token-head cache computes its own.
        k_scale=0.5 if choice.kv_cache_dtype in ("fp8_e4m3", "fp8_e5m2") else 1.0,
        v_scale=2.0 if choice.kv_cache_dtype in ("fp8_e4m3", "fp8_e5m2") else 1.0,
        **extra,
    )
    return spec, params


def _state_type(choice: LayerChoice) -> StateType[Any, Any]:
    if choice.mamba_type is None:
        raise KitError(f"a {choice.kind.value} layer choice needs a mamba_type, got None")
    return state_type_of(choice.mamba_type)


def _state_layer(
    choice: LayerChoice, gen: torch.Generator, device: torch.device
) -> tuple[KVCacheSpec, LayerParams]:
    """The type's example layer (``StateType.example``), every state in float32."""
    state_type = _state_type(choice)
    params: StateLayerParams = state_type.example(gen, device)
    spec = MambaSpec(
        block_size=choice.block_size,
        shapes=params.state_shapes,
        dtypes=state_type.state_dtypes(torch.float32),
        mamba_type=state_type.name,
    )
    return spec, params


@dataclasses.dataclass
class _Inputs:
    """One request's inputs of one step (attention: q, k, v; state: the input class)."""

    tensors: dict[str, torch.Tensor]
    encoder: tuple[torch.Tensor, torch.Tensor] | None = None


def _request_inputs(
    case: Case,
    params: LayerParams,
    n: int,
    encoder_len: int,
    gen: torch.Generator,
    device: torch.device,
) -> _Inputs:
    choice = case.choice
    if choice.kind is KVCacheSpecKind.MAMBA:
        return _Inputs(_state_inputs(choice, params, n, gen, device))
    d, hkv, hq = choice.head_size, case.num_kv_heads, case.num_heads

    def t(*shape: int) -> torch.Tensor:
        return _randn(gen, *shape).to(device, choice.dtype)

    q_size = d
    if AttentionFeature.MLA_PROJECTION in choice.features:
        nope, rope, _ = mla_projection_widths(d)
        q_size = nope + rope  # the un-absorbed query: q_nope, then q_pe
    tensors = {"q": t(n, hq, q_size), "k": t(n, hkv, d), "v": t(n, hkv, d)}
    encoder = (t(encoder_len, hkv, d), t(encoder_len, hkv, d)) if encoder_len else None
    return _Inputs(tensors, encoder)


def _state_inputs(
    choice: LayerChoice, params: LayerParams, n: int, gen: torch.Generator, device: torch.device
) -> dict[str, torch.Tensor]:
    """The type's example inputs for ``n`` tokens (``StateType.example_inputs``), by field."""
    inputs = _state_type(choice).example_inputs(params, n, gen, device)
    return {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}


def _as_state_inputs(choice: LayerChoice, tensors: dict[str, torch.Tensor]) -> StateInputs:
    inputs: StateInputs = _state_type(choice).inputs_type(**tensors)
    return inputs


def _budget(spec: KVCacheSpec, case: Case) -> int:
    live = max(len(s.scheduled) + len(s.finished) for s in case.steps)
    longest = sum(n + enc for s in case.steps for _, n, enc in s.scheduled)
    per_request = -(-(longest + rules_for(spec).shift(spec)) // spec.block_size) + 2
    return spec.page_size_bytes * (live * per_request + 8) * case.layers


class _Side:
    """One runtime of a case (the backend under test or reference), ``case.layers`` layers."""

    def __init__(
        self,
        backend: str,
        case: Case,
        spec: KVCacheSpec,
        params: LayerParams,
        registry: BackendRegistry,
        device: torch.device,
    ) -> None:
        self.layers = _layers(case)
        self.runtime = AttentionRuntime(
            dict.fromkeys(self.layers, spec),
            config_for(case.choice.kind, backend, **_limits(case)),
            device=device,
            memory_budget_bytes=_budget(spec, case),
            layer_params=dict.fromkeys(self.layers, params),
            registry=registry,
            cache_fill=float("nan"),
        )
        self.params = params
        # Blocks handed out in a shuffled order: tables are neither contiguous nor sorted.
        random.Random(case.seed).shuffle(self.runtime.manager.pool._free)
        entry = self.runtime._groups[0]
        group_spec = entry.group.spec
        rules = rules_for(group_spec)
        layout = self.runtime.backend_for(self.layers[0]).kv_cache_layout
        # The cache tensors count kernel blocks: a page of the pool may hold several.
        num_blocks = self.runtime.num_blocks * entry.group.blocks_per_page
        self.geometry = CacheGeometry(
            num_blocks=num_blocks,
            block_size=group_spec.block_size,
            layout=layout,
            latent=rules.latent,
            state=case.choice.kind is KVCacheSpecKind.MAMBA,
            default_shapes=rules.cache_shapes(group_spec, num_blocks, layout)
            if rules.has_cache
            else (),
        )

    def begin(self, step: Step) -> StepBatch:
        return self.runtime.begin_step(
            [ScheduledRequest(rid, n, enc) for rid, n, enc in step.scheduled],
            finished=step.finished,
        )

    def _call(self, case: Case, layer: str, batch: StepBatch, inputs: _Joined) -> torch.Tensor:
        choice = case.choice
        if choice.kind is KVCacheSpecKind.MAMBA:
            return self.runtime.forward_state(layer, _as_state_inputs(choice, inputs.tensors))
        if rules_for_kind(choice.kind).writes == "encoder":  # keys from the encoder
            return self.runtime.forward(layer, inputs.tensors["q"], inputs.key, inputs.value)
        t = inputs.tensors
        if AttentionFeature.RETURN_LSE not in choice.features:
            return self.runtime.forward(layer, t["q"], t["k"], t["v"])
        # The lse is compared with the output: its Hq columns after the output's.
        q = t["q"]
        lse = torch.full((q.shape[0], q.shape[1]), float("nan"), device=q.device)
        out = self.runtime.forward(layer, q, t["k"], t["v"], lse=lse)
        seen = torch.where(lse == float("-inf"), -1e4, lse)  # a row with no key: -inf
        return torch.cat([out.flatten(1).float(), seen], dim=1)

    def forward(
        self,
        case: Case,
        batch: StepBatch,
        inputs: dict[str, dict[str, _Inputs]],
        *,
        guard: bool = False,
        twice: bool = False,
    ) -> tuple[dict[str, dict[str, torch.Tensor]], str | None]:
        """Each layer's output per request (rows of ``batch.order``), and the first
        problem the guards found (``guard``: inputs, metadata and cache slots outside
        the step's writes unchanged; ``twice``: a second run gives the same bits)."""
        outputs: dict[str, dict[str, torch.Tensor]] = {}
        for index, layer in enumerate(self.layers):
            joined = _join(case, batch, inputs[layer])
            caches = self.runtime.kv_caches.get(layer, ())
            checks = None
            if guard or twice:
                common = self.runtime._groups[0].common
                assert common is not None  # begin_step built it
                checks = Guard(
                    inputs=joined.named(), common=common, caches=caches, geometry=self.geometry
                )
            out = self._call(case, layer, batch, joined)
            problem = checks.problems() if checks is not None and guard else None
            if problem is None and checks is not None and twice:
                first, after = out.clone(), [c.clone() for c in caches]
                checks.restore_cache()
                again = self._call(case, layer, batch, joined)
                problem = compare_runs(first, again, after, caches)
            if problem is not None:
                return outputs, f"layer {index}: {problem}"
            outputs[layer] = {rid: out[rows] for rid, rows in batch.token_slices().items()}
        return outputs, None

    def write(self, case: Case, batch: StepBatch, inputs: dict[str, dict[str, _Inputs]]) -> bool:
        """Write the step's keys and values into every layer's cache, as a ``forward``
        would, without attending (``Step.written``); ``False`` when the cache is not in
        the kind's own shapes (then nothing was written)."""
        common = self.runtime._groups[0].common
        assert common is not None  # begin_step built it
        slots = common.slot_mapping[: batch.num_tokens]
        done = True
        for layer in self.layers:
            t = _join(case, batch, inputs[layer]).tensors
            caches = self.runtime.kv_caches.get(layer, ())
            done = write_slots(caches, self.geometry, slots, t["k"], t["v"]) and done
        return done


@dataclasses.dataclass
class _Joined:
    """One layer's inputs of one step, in batch order (``batch.order``)."""

    tensors: dict[str, torch.Tensor]
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None

    def named(self) -> dict[str, torch.Tensor]:
        """The tensors as the caller passes them, named as in the layer call."""
        names = {"q": "query", "k": "key", "v": "value"}
        found = {names.get(k, f"inputs.{k}"): t for k, t in self.tensors.items()}
        if self.key is not None and self.value is not None:  # cross attention
            found["key"], found["value"] = self.key, self.value
        return found


def _join(case: Case, batch: StepBatch, inputs: dict[str, _Inputs]) -> _Joined:
    order = batch.order
    keys = list(inputs[order[0]].tensors)
    joined = {k: torch.cat([inputs[r].tensors[k] for r in order]) for k in keys}
    if (
        case.choice.kind is not KVCacheSpecKind.MAMBA
        and rules_for_kind(case.choice.kind).writes == "encoder"
    ):
        enc = [e for r in batch.encoder_order if (e := inputs[r].encoder) is not None]
        key = torch.cat([e[0] for e in enc]) if enc else None
        value = torch.cat([e[1] for e in enc]) if enc else None
        tensors = {"q": joined["q"]}
        return _Joined(tensors, key, value)
    return _Joined(joined)


def _compare(where: str, got: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> str | None:
    if got.shape != expected.shape:
        return f"{where}: output shape {list(got.shape)}, expected {list(expected.shape)}"
    g, e = got.double(), expected.double()
    if e.isnan().any():
        raise KitError(f"{where}: the reference output holds NaN")
    bad = ~((g - e).abs() <= tol.atol + tol.rtol * e.abs())  # NaN compares False: bad
    if not bad.any():
        return None
    nan = int(g.isnan().sum())
    err = (g - e).abs().nan_to_num(float("inf")).max().item()
    what = f"{nan} NaN value(s)" if nan else f"max abs error {err:.3g}"
    return (
        f"{where}: {int(bad.sum())} of {bad.numel()} values differ from reference "
        f"({what}; tolerance {tol})"
    )


def _step_inputs(
    case: Case, step: Step, gen: torch.Generator, device: torch.device, params: LayerParams
) -> dict[str, dict[str, _Inputs]]:
    """Each layer's inputs per request, drawn in the schedule's order, so both sides
    get the same tensors whatever order their runtimes lay the batch out in."""
    return {
        layer: {
            rid: _request_inputs(case, params, n, enc, gen, device)
            for rid, n, enc in step.scheduled
        }
        for layer in _layers(case)
    }


def _sides(
    case: Case, backend: str, registry: BackendRegistry, device: torch.device
) -> tuple[_Side, _Side] | str:
    spec, params = make_layer(case, device)
    try:
        ref = _Side(REFERENCE, case, spec, params, registry, device)
    except Exception as exc:
        raise KitError(f"reference cannot run the case: {exc}") from exc
    try:
        test = _Side(backend, case, spec, params, registry, device)
    except Exception as exc:
        return f"rejected at run time: {type(exc).__name__}: {exc}"
    return test, ref


def run_case(
    case: Case,
    backend: str,
    registry: BackendRegistry,
    device: torch.device,
    *,
    twice: bool = False,
) -> str | None:
    """``None`` when ``backend`` agrees with reference on every step and layer of
    ``case`` and its guards hold; else the first problem (or what ``backend`` raised).
    ``twice``: run every call of the backend twice and compare the bits."""
    sides = _sides(case, backend, registry, device)
    if isinstance(sides, str):
        return sides
    test, ref = sides
    gen = torch.Generator().manual_seed(case.seed)
    tol = tolerance_of(case.choice)
    cached: dict[str, int] = {}
    for i, step in enumerate(case.steps):
        for rid in step.finished:
            cached.pop(rid, None)
        inputs = _step_inputs(case, step, gen, device, ref.params)
        try:
            ref_batch = ref.begin(step)
            if step.written and ref.write(case, ref_batch, inputs):
                expected = None
            else:
                expected, _ = ref.forward(case, ref_batch, inputs)
        except Exception as exc:
            raise KitError(f"step {i}: reference failed: {type(exc).__name__}: {exc}") from exc
        try:
            batch = test.begin(step)
            if expected is None:
                if not test.write(case, batch, inputs):
                    raise KitError(
                        f"step {i}: the kit writes this step's context itself, which needs "
                        f"the kind's own cache shapes {list(test.geometry.default_shapes)}"
                    )
                got: dict[str, dict[str, torch.Tensor]] = {}
                problem = None
            else:
                got, problem = test.forward(case, batch, inputs, guard=True, twice=twice)
        except KitError:
            raise
        except Exception as exc:
            return f"step {i}: {type(exc).__name__}: {exc}"
        if problem is not None:
            return f"step {i}, {problem}"
        for rid, n, _ in step.scheduled:
            before = cached.get(rid, 0)
            cached[rid] = before + n
            if expected is None:
                continue
            for index, layer in enumerate(test.layers):
                where = f"step {i}, layer {index}, request {rid} ({_role(before, n)})"
                problem = _compare(where, got[layer][rid], expected[layer][rid], tol)
                if problem is not None:
                    return problem
    return None


def _role(cached: int, n: int) -> str:
    """What a request does in a step, in the words of the report."""
    if not cached:
        return f"prefill of {n} token(s)"
    if n == 1:
        return f"decode after {cached} token(s)"
    return f"chunked prefill of {n} token(s) after {cached}"


# ---------------------------------------------------------------- CUDA graphs

_GRAPH_STEPS: dict[AttentionCGSupport, tuple[tuple[int, ...], tuple[int, ...]]] = {
    # Two batches of one shape (requests, tokens), other lengths and blocks.
    AttentionCGSupport.ALWAYS: ((1, 5, 2), (3, 1, 4)),
    # Uniform batches as speculative verify steps make them: 1 + 4 queries per request.
    AttentionCGSupport.UNIFORM_BATCH: ((5, 5, 5), (5, 5, 5)),
    AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE: ((1, 1, 1), (1, 1, 1)),
}


def _tensor_fields(meta: object) -> dict[str, torch.Tensor]:
    fields: dict[str, Any] = (
        {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
        if dataclasses.is_dataclass(meta)
        else dict(getattr(meta, "__dict__", {}))
    )
    return {k: v for k, v in fields.items() if isinstance(v, torch.Tensor) and v.numel()}


def check_cudagraph(
    choice: LayerChoice,
    level: AttentionCGSupport,
    backend: str,
    registry: BackendRegistry,
    device: torch.device,
    seed: int,
) -> tuple[Case, str | None, list[str]]:
    """Two capture builds of batches of one shape; the first build's metadata (what a
    captured graph would read) replayed on the second batch must match reference.

    Returns the case, the failure (``None`` if none) and the tensor fields whose
    address moved between the two builds.
    """
    first, second = _GRAPH_STEPS[level]
    ids = [f"r{i}" for i in range(3)]
    rules = rules_for_kind(choice.kind)
    enc = 4 if rules.writes == "encoder" else 0
    steps: tuple[Step, ...]
    if not rules.has_cache:
        # Requests come whole: two batches of new requests, the second after the first.
        later = [f"r{i}" for i in range(3, 6)]
        steps = (
            Step(tuple((r, n, 0) for r, n in zip(ids, first, strict=True))),
            Step(tuple((r, n, 0) for r, n in zip(later, second, strict=True)), tuple(ids)),
        )
    else:
        steps = (
            Step(tuple((r, n, enc) for r, n in zip(ids, (6, 3, 9), strict=True))),
            Step(tuple((r, n, 0) for r, n in zip(ids, first, strict=True))),
            Step(tuple((r, n, 0) for r, n in zip(ids, second, strict=True))),
        )
    capture_from = len(steps) - 2
    window = 2 * choice.block_size - 1 if rules.extent is not None else None
    # MLA specs have one latent "head" by definition.
    heads = 1 if rules.latent else 2
    case = Case(
        choice, heads, 1 if choice.kind is KVCacheSpecKind.MAMBA else 2, window, steps, seed, 2
    )
    sides = _sides(case, backend, registry, device)
    if isinstance(sides, str):
        return case, sides, []
    test, ref = sides
    entry = test.runtime._groups[0]
    gen = torch.Generator().manual_seed(seed)
    tol = tolerance_of(choice)
    captured: Any = None
    addresses: dict[str, int] = {}
    moved: list[str] = []
    for i, step in enumerate(steps):
        inputs = _step_inputs(case, step, gen, device, ref.params)
        expected, _ = ref.forward(case, ref.begin(step), inputs)
        replay = " (replaying the first capture's metadata)" if i == len(steps) - 1 else ""
        try:
            batch = test.begin(step)
            if i >= capture_from:
                assert entry.common is not None
                try:
                    meta = entry.builder.build_for_cudagraph_capture(entry.common)
                except Exception as exc:
                    lens = [n for _, n, _ in step.scheduled]
                    return (
                        case,
                        (
                            f"claims {level.name} but cannot build a capture of a batch with "
                            f"query lengths {lens}: {type(exc).__name__}: {exc}"
                        ),
                        moved,
                    )
                if captured is None:
                    captured = meta
                    addresses = {k: v.data_ptr() for k, v in _tensor_fields(meta).items()}
                else:
                    now = _tensor_fields(meta)
                    moved = sorted(
                        k for k, ptr in addresses.items() if k in now and now[k].data_ptr() != ptr
                    )
                # A captured graph reads the first capture's addresses on every replay.
                entry.metadata = captured
            got, problem = test.forward(case, batch, inputs, guard=True)
        except Exception as exc:
            return case, f"step {i}: {type(exc).__name__}: {exc}", moved
        if problem is not None:
            problem = f"step {i}, {problem}{replay}"
        for rid, _, _ in step.scheduled:
            for index, layer in enumerate(test.layers):
                if problem is None:
                    where = f"step {i}, layer {index}, request {rid}{replay}"
                    problem = _compare(where, got[layer][rid], expected[layer][rid], tol)
        if problem is not None:
            if moved:
                problem += f"; tensors reallocated between capture builds: {', '.join(moved)}"
            return case, f"claims {level.name}: {problem}", moved
    return case, None, moved


# ------------------------------------------------------------------ DeepSeek sparse attention

_SPARSE_LAYERS = ("mla", "indexer")
_SPARSE_RANK, _SPARSE_ROPE, _SPARSE_HEADS, _SPARSE_INDEX_HEADS = 32, 16, 4, 3


def _sparse_runtime(
    choice: LayerChoice, per_kind: dict[str, str], registry: BackendRegistry, device: torch.device
) -> tuple[AttentionRuntime, int]:
    bs, dtype = choice.block_size, choice.dtype
    topk = max(2, bs // 2)
    specs: dict[str, KVCacheSpec] = {
        "mla": MLAAttentionSpec(block_size=bs, head_size=_SPARSE_RANK + _SPARSE_ROPE, dtype=dtype),
        "indexer": IndexerSpec(
            block_size=bs, head_size=_index_dim(choice), dtype=dtype, index_topk=topk
        ),
    }
    params: dict[str, LayerParams] = {
        "mla": AttentionLayerParams(
            num_heads=_SPARSE_HEADS, v_head_size=_SPARSE_RANK, scale=choice.scale, index_topk=topk
        ),
        "indexer": AttentionLayerParams(num_heads=_SPARSE_INDEX_HEADS),
    }
    runtime = AttentionRuntime(
        specs,
        AttentionConfig(backend_per_kind=per_kind),
        device=device,
        # Unified pages are the least common multiple of the two: a few dozen of them.
        memory_budget_bytes=math.lcm(*(s.page_size_bytes for s in specs.values())) * 48,
        layer_params=params,
        registry=registry,
        cache_fill=float("nan"),
    )
    return runtime, topk


def _ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.flatten().cpu()]


def _index_dim(choice: LayerChoice) -> int:
    """The index key width: the choice's head size rounded down to the scale block."""
    return 128 * max(1, choice.head_size // 128)


def run_sparse_case(
    choice: LayerChoice, backend: str, registry: BackendRegistry, device: torch.device, seed: int
) -> str | None:
    """DeepSeek sparse attention: an indexer layer and its sparse MLA layer, served by
    the backend under test where it declares them (``indexer`` kind, the
    ``sparse_attention`` feature) and by reference otherwise, against both on
    reference: the selections must be equal (global slots, -1 padding, counts) and the
    MLA outputs within the dtype's tolerance. Two requests, one longer than
    ``index_topk`` (a prefill in two chunks, then decodes) and one shorter; caches
    filled with NaN, block pools shuffled."""
    served = registry.get(backend)
    per_kind = {
        "indexer": backend if KVCacheSpecKind.INDEXER in served.supported_kinds() else REFERENCE,
        "mla_attention": backend
        if AttentionFeature.SPARSE_ATTENTION in served.supported_features
        and KVCacheSpecKind.MLA_ATTENTION in served.supported_kinds()
        else REFERENCE,
    }
    try:
        ref, topk = _sparse_runtime(choice, dict.fromkeys(per_kind, REFERENCE), registry, device)
    except Exception as exc:
        raise KitError(f"reference cannot run the case: {exc}") from exc
    try:
        test, _ = _sparse_runtime(choice, per_kind, registry, device)
    except Exception as exc:
        return f"building the runtime failed: {type(exc).__name__}: {exc}"
    for side in (ref, test):
        random.Random(seed).shuffle(side.manager.pool._free)
    bs = choice.block_size
    long_len = 3 * topk + bs + 1
    steps = [
        [("a", long_len - bs - 1), ("b", 1)],
        [("a", bs), ("b", 1)],
        [("a", 1)],
        [("a", 1), ("b", 1)],
    ]
    gen = torch.Generator().manual_seed(seed)
    tol = tolerance_of(choice)
    for number, step in enumerate(steps):
        scheduled = [ScheduledRequest(rid, n) for rid, n in step]
        batches = (ref.begin_step(scheduled), test.begin_step(scheduled))
        dtype, widths = choice.dtype, _SPARSE_RANK + _SPARSE_ROPE
        # Per request, then laid out in each runtime's batch order (a backend may put
        # decodes first).
        parts = {
            rid: (
                _randn(gen, n, _SPARSE_HEADS, widths).to(device, dtype),
                _randn(gen, n, 1, widths).to(device, dtype),
                _randn(gen, n, _SPARSE_INDEX_HEADS, _index_dim(choice)).to(device, dtype),
                _randn(gen, n, 1, _index_dim(choice)).to(device, dtype),
                _randn(gen, n, _SPARSE_INDEX_HEADS).to(device),
            )
            for rid, n in step
        }
        where = f"step {number} ({', '.join(f'{r}: {n}' for r, n in step)})"
        results: list[tuple[dict[str, slice], SparseSelection, torch.Tensor]] = []
        for side, batch in zip((ref, test), batches, strict=True):
            q, latent, qi, ki, w = (
                torch.cat([parts[rid][i] for rid in batch.order]) for i in range(5)
            )
            try:
                sel = side.select("indexer", qi, ki, w)
                out = side.forward("mla", q, latent, selection=sel)
            except Exception as exc:
                if side is ref:
                    raise KitError(f"reference cannot run the case: {exc}") from exc
                return f"{where}: {type(exc).__name__}: {exc}"
            results.append((batch.token_slices(), sel, out))
        (ref_rows, want, want_out), (got_rows, got, got_out) = results
        for rid, _ in step:
            mine, theirs = got_rows[rid], ref_rows[rid]
            here = f"{where} request {rid}"
            if not torch.equal(got.lens[mine].cpu(), want.lens[theirs].cpu()):
                return (
                    f"{here}: selection lens {_ints(got.lens[mine])}, expected "
                    f"{_ints(want.lens[theirs])}"
                )
            if not torch.equal(got.indices[mine].cpu(), want.indices[theirs].cpu()):
                bad = int((got.indices[mine] != want.indices[theirs]).any(dim=1).nonzero()[0, 0])
                return (
                    f"{here}: selection of its token {bad} is "
                    f"{_ints(got.indices[mine][bad])}, expected "
                    f"{_ints(want.indices[theirs][bad])} (topk={topk})"
                )
            problem = _compare(f"{here} mla output", got_out[mine], want_out[theirs], tol)
            if problem is not None:
                return problem
    return None
