"""Bad inputs to specs, layer parameters, state inputs, the config, the KV cache and the
runtime: each gets the attnkit error for its problem, a message that names the bad value
and what is allowed, and leaves every piece of state as it was.

Each case is one parametrised test; the state checks compare a snapshot taken before
the bad call with one taken after (free blocks, live requests, their token counts and
block tables, the current step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from attnkit import (
    ArgumentTypeError,
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    DeviceUnavailableError,
    DuplicateRequestError,
    EncoderOnlyAttentionSpec,
    EngineLimitError,
    FullAttentionSpec,
    GatedDeltaNetInputs,
    InvalidArgumentError,
    KVCacheSpecKind,
    Mamba2Inputs,
    MambaSpec,
    OutOfBlocksError,
    ScheduledRequest,
    ShortConvInputs,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    StaleStepError,
    UnknownLayerError,
    UnknownRequestError,
)
from attnkit.demo import DemoModel
from attnkit.kv_cache import BlockPool, KVCacheManager, group_layers, num_blocks_for_budget

F32 = torch.float32
Call = Callable[[], object]


def attn(**overrides: Any) -> Call:
    fields: dict[str, Any] = {"block_size": 16, "num_kv_heads": 2, "head_size": 16, "dtype": F32}
    fields.update(overrides)
    return lambda: FullAttentionSpec(**fields)


# ------------------------------------------------------------------ no state involved

STATELESS: list[Any] = [
    # Specs.
    pytest.param(attn(block_size=0), InvalidArgumentError, r"block_size must be a positive int, got 0", id="spec-block-size-0"),
    pytest.param(attn(block_size=-16), InvalidArgumentError, r"block_size must be a positive int, got -16", id="spec-block-size-negative"),
    pytest.param(attn(block_size=16.0), InvalidArgumentError, r"block_size must be a positive int, got 16.0", id="spec-block-size-float"),
    pytest.param(attn(block_size=True), InvalidArgumentError, r"block_size must be a positive int, got True", id="spec-block-size-bool"),
    pytest.param(attn(num_kv_heads=0), InvalidArgumentError, r"num_kv_heads must be a positive int, got 0", id="spec-heads-0"),
    pytest.param(attn(head_size=0), InvalidArgumentError, r"head_size must be a positive int, got 0", id="spec-head-size-0"),
    pytest.param(attn(dtype="float32"), InvalidArgumentError, r"dtype must be a torch.dtype among \(bfloat16, float16, float32\), got 'float32'", id="spec-dtype-str"),
    pytest.param(attn(dtype=torch.int32), InvalidArgumentError, r"dtype must be a torch.dtype among .*got torch.int32", id="spec-dtype-int"),
    pytest.param(attn(kv_cache_dtype="int4"), InvalidArgumentError, r"kv_cache_dtype must be one of \('auto', .*'int8_per_token_head'\), got 'int4'", id="spec-kv-dtype"),
    pytest.param(lambda: SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=F32, sliding_window=0), InvalidArgumentError, r"sliding_window must be a positive int, got 0", id="spec-window-0"),
    pytest.param(lambda: SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=F32, sliding_window=None), InvalidArgumentError, r"sliding_window must be a positive int, got None", id="spec-window-none"),
    pytest.param(lambda: ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=F32, attention_chunk_size=-1), InvalidArgumentError, r"attention_chunk_size must be a positive int, got -1", id="spec-chunk-negative"),
    pytest.param(lambda: SinkFullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=F32, sink_len=0), InvalidArgumentError, r"sink_len must be a positive int, got 0", id="spec-sink-0"),
    pytest.param(lambda: MambaSpec(block_size=16, shapes=(), dtypes=(), mamba_type="mamba2"), InvalidArgumentError, r"shapes must be a non-empty tuple of shapes, got \(\)", id="spec-mamba-no-shapes"),
    # Layer parameters.
    pytest.param(lambda: AttentionLayerParams(num_heads=0), InvalidArgumentError, r"num_heads must be a positive int, got 0", id="params-heads-0"),
    pytest.param(lambda: AttentionLayerParams(num_heads=True), InvalidArgumentError, r"num_heads must be a positive int, got True", id="params-heads-bool"),
    pytest.param(lambda: AttentionLayerParams(num_heads=2, scale=-1.0), InvalidArgumentError, r"scale must be a finite float > 0, got -1.0", id="params-scale-negative"),
    pytest.param(lambda: AttentionLayerParams(num_heads=2, scale=float("nan")), InvalidArgumentError, r"scale must be a finite float > 0, got nan", id="params-scale-nan"),
    pytest.param(lambda: AttentionLayerParams(num_heads=2, logits_soft_cap=-1.0), InvalidArgumentError, r"logits_soft_cap must be a finite float > 0 or None, got -1.0", id="params-softcap-negative"),
    # State-layer inputs.
    pytest.param(lambda: Mamba2Inputs(xBC=[1.0], dt=torch.zeros(1, 1)), ArgumentTypeError, r"Mamba2Inputs.xBC must be a torch.Tensor, got list", id="inputs-list"),
    pytest.param(lambda: GatedDeltaNetInputs(qkv=torch.zeros(2, 4), g=None, beta=torch.zeros(2, 1)), ArgumentTypeError, r"GatedDeltaNetInputs.g must be a torch.Tensor, got NoneType", id="inputs-none"),
    pytest.param(lambda: ShortConvInputs(b=torch.zeros(2, 4), c=torch.zeros(3, 4), x=torch.zeros(2, 4)), InvalidArgumentError, r"ShortConvInputs.*rows", id="inputs-row-mismatch"),
    # Scheduled requests.
    pytest.param(lambda: ScheduledRequest(None, 1), ArgumentTypeError, r"req_id must be a str, got None \(NoneType\)", id="request-id-none"),
    pytest.param(lambda: ScheduledRequest(7, 1), ArgumentTypeError, r"req_id must be a str, got 7 \(int\)", id="request-id-int"),
    pytest.param(lambda: ScheduledRequest("", 1), InvalidArgumentError, r"req_id must be a non-empty str, got ''", id="request-id-empty"),
    pytest.param(lambda: ScheduledRequest("a", 0), InvalidArgumentError, r"request 'a': num_new_tokens must be an int >= 1, got 0", id="request-zero-tokens"),
    pytest.param(lambda: ScheduledRequest("a", 1.5), InvalidArgumentError, r"num_new_tokens must be an int >= 1, got 1.5", id="request-float-tokens"),
    pytest.param(lambda: ScheduledRequest("a", True), InvalidArgumentError, r"num_new_tokens must be an int >= 1, got True", id="request-bool-tokens"),
    pytest.param(lambda: ScheduledRequest("a", 1, encoder_len=-1), InvalidArgumentError, r"encoder_len must be an int >= 0, got -1", id="request-encoder-negative"),
    # The config (pydantic's ValidationError, a ValueError, lists every problem).
    pytest.param(lambda: AttentionConfig(max_num_reqs=0), ValidationError, r"max_num_reqs\n.*greater than or equal to 1", id="config-max-reqs-0"),
    pytest.param(lambda: AttentionConfig(max_num_reqs=True), ValidationError, r"max_num_reqs must be an int >= 1, got True", id="config-max-reqs-bool"),
    pytest.param(lambda: AttentionConfig(max_model_len=False), ValidationError, r"max_model_len must be an int >= 1, got False", id="config-max-len-bool"),
    pytest.param(lambda: AttentionConfig(max_num_batched_tokens=-5), ValidationError, r"max_num_batched_tokens\n.*greater than or equal to 1", id="config-max-tokens-negative"),
    pytest.param(lambda: AttentionConfig(backend_per_kind="bogus=reference"), ValidationError, r"unknown kind 'bogus'; valid kinds: full_attention, sliding_window", id="config-unknown-kind"),
    pytest.param(lambda: AttentionConfig(backend_per_kind="full_attention"), ValidationError, r"entry 'full_attention' must look like 'kind=backend'", id="config-per-kind-no-equals"),
    pytest.param(lambda: AttentionConfig(backend_per_kind=5), ValidationError, r"backend_per_kind must be a mapping or a 'kind=backend,...' string, got int", id="config-per-kind-int"),
    pytest.param(lambda: AttentionConfig(backend="no such"), ValidationError, r"backend must be a backend name, got 'no such'", id="config-backend-name"),
    pytest.param(lambda: AttentionConfig(bogus=1), ValidationError, r"bogus\n.*Extra inputs are not permitted", id="config-unknown-field"),
    pytest.param(lambda: AttentionConfig.model_validate({"backend": "nope"}, context={"known_backends": ["reference"]}), ValidationError, r"'nope'.*reference", id="config-unknown-backend"),
    # Block pool and budget helpers.
    pytest.param(lambda: BlockPool(1), InvalidArgumentError, r"num_blocks must be an int >= 2 \(block 0 is reserved\), got 1", id="pool-too-small"),
    pytest.param(lambda: BlockPool(5).allocate(-1), InvalidArgumentError, r"n must be an int >= 0, got -1", id="pool-allocate-negative"),
    pytest.param(lambda: BlockPool(5).allocate(9), OutOfBlocksError, r"need 9 free block\(s\) but only 4 of 4 are free", id="pool-allocate-too-many"),
    pytest.param(lambda: num_blocks_for_budget(group_layers({"a": attn()()}), 4096, 0), InvalidArgumentError, r"memory_budget_bytes must be a positive int, got 0", id="budget-zero"),
]


@pytest.mark.parametrize(("make", "error", "match"), STATELESS)
def test_stateless_bad_input(make: Call, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_frozen_config_cannot_be_mutated() -> None:
    config = AttentionConfig(
        backend_per_kind={"sliding_window": "reference"},
        backend_options={"flash_attn": {"version": 2}},
    )
    read_only = (
        r"^AttentionConfig\.{shown} is read-only \(a validated config is frozen\); make a "
        r"changed copy instead: config\.model_copy\(update=\{{'{field}': \.\.\.\}}\) "
        r"validates the new value as the constructor does$"
    )
    per_kind = read_only.format(shown="backend_per_kind", field="backend_per_kind")
    with pytest.raises(ArgumentTypeError, match=per_kind):
        config.backend_per_kind[next(iter(config.backend_per_kind))] = "triton_attn"  # type: ignore[index]  # the mutation is the test
    with pytest.raises(ArgumentTypeError, match=per_kind):
        del config.backend_per_kind[next(iter(config.backend_per_kind))]  # type: ignore[attr-defined]  # the mutation is the test
    options = read_only.format(shown=r"backend_options\['flash_attn'\]", field="backend_options")
    with pytest.raises(ArgumentTypeError, match=options):
        config.backend_options["flash_attn"]["version"] = 4  # type: ignore[index]  # the mutation is the test
    # The copy the message names is validated as the constructor validates.
    changed = config.model_copy(update={"backend_per_kind": "full_attention=reference"})
    assert dict(changed.backend_per_kind) == {KVCacheSpecKind.FULL_ATTENTION: "reference"}
    assert changed.backend_options == config.backend_options
    with pytest.raises(ValidationError, match=r"unknown kind 'attention'"):
        config.model_copy(update={"backend_per_kind": {"attention": "reference"}})
    with pytest.raises(ValidationError, match=r"bogus\n.*Extra inputs are not permitted"):
        config.model_copy(update={"bogus": 1})
    with pytest.raises(ValidationError, match=r"frozen"):
        config.backend = "triton_attn"  # type: ignore[misc]  # the mutation is the test
    assert dict(config.backend_per_kind) == {
        next(iter(config.backend_per_kind)): "reference"
    }


# ------------------------------------------------------------------ the runtime


MODEL = DemoModel(layout=("full", "mamba", "window"), window=8, block_size=16)
LIMITS = {"max_num_reqs": 4, "max_num_batched_tokens": 48, "max_model_len": 64}


def make_runtime() -> AttentionRuntime:
    """Two live requests after two steps; the second step is the current one."""
    runtime = AttentionRuntime(
        MODEL.specs,
        AttentionConfig(**LIMITS),
        device="cpu",
        memory_budget_bytes=40 * next(iter(MODEL.specs.values())).page_size_bytes * 4,
        layer_params=MODEL.params,
    )
    runtime.begin_step([ScheduledRequest("a", 20), ScheduledRequest("b", 5)])
    runtime.begin_step([ScheduledRequest("a", 1), ScheduledRequest("b", 3)])
    return runtime


def snapshot(runtime: AttentionRuntime) -> dict[str, object]:
    mgr = runtime.manager
    live = sorted(r for r in ("a", "b", "c", "x") if r in mgr)
    return {
        "free": mgr.pool.num_free_blocks,
        "live": live,
        "tokens": {r: mgr.num_tokens(r) for r in live},
        "tables": {
            (layer, r): runtime.block_table(layer, r) for layer in MODEL.specs for r in live
        },
        "owned": mgr.owned_blocks(),
        "step": runtime._step,
    }


def hidden(rows: int) -> torch.Tensor:
    return torch.zeros(rows, 4, 16)


R = ScheduledRequest
BEGIN_STEP: list[Any] = [
    # Types at the boundary.
    pytest.param(lambda rt: rt.begin_step([("a", 3)]), ArgumentTypeError, r"scheduled must hold ScheduledRequest objects, got \('a', 3\)", id="step-tuple-entry"),
    pytest.param(lambda rt: rt.begin_step(R("a", 1)), ArgumentTypeError, r"scheduled must be a sequence .* got ScheduledRequest \(wrap it in a list\)", id="step-bare-request"),
    pytest.param(lambda rt: rt.begin_step("ab"), ArgumentTypeError, r"scheduled must be a sequence .* got str", id="step-string"),
    pytest.param(lambda rt: rt.begin_step(None), ArgumentTypeError, r"scheduled must be a sequence .* got NoneType", id="step-none"),
    pytest.param(lambda rt: rt.begin_step([R("a", 1)], finished="b"), ArgumentTypeError, r"finished must be an iterable of request ids .* got 'b'", id="finished-string"),
    pytest.param(lambda rt: rt.begin_step([R("a", 1)], finished=[1]), ArgumentTypeError, r"finished must hold request ids \(str\), got 1 \(int\)", id="finished-int"),
    pytest.param(lambda rt: rt.begin_step([R("a", 1)], finished=7), ArgumentTypeError, r"finished must be an iterable of request ids .* got 7", id="finished-not-iterable"),
    # Ids.
    pytest.param(lambda rt: rt.begin_step([R("a", 1), R("a", 1)]), DuplicateRequestError, r"request 'a' is scheduled twice in one step", id="step-scheduled-twice"),
    pytest.param(lambda rt: rt.begin_step([R("a", 1)], finished=["b", "b"]), DuplicateRequestError, r"finished names request\(s\) \['b'\] twice", id="finished-twice"),
    pytest.param(lambda rt: rt.begin_step([R("a", 1)], finished=["zz"]), UnknownRequestError, r"unknown request 'zz': it was never scheduled", id="finished-unknown"),
    pytest.param(lambda rt: rt.begin_step([R("a", 1), R("a", 2)], finished=["b"]), DuplicateRequestError, r"scheduled twice", id="finished-with-bad-step"),
    # Engine limits (max_num_reqs=4, max_num_batched_tokens=48, max_model_len=64).
    pytest.param(lambda rt: rt.begin_step([R(f"n{i}", 1) for i in range(5)]), EngineLimitError, r"schedules 5 requests; AttentionConfig.max_num_reqs=4", id="limit-requests"),
    pytest.param(lambda rt: rt.begin_step([R("a", 30), R("c", 19)]), EngineLimitError, r"schedules 49 tokens; AttentionConfig.max_num_batched_tokens=48", id="limit-tokens"),
    pytest.param(lambda rt: rt.begin_step([R("a", 44)]), EngineLimitError, r"request 'a' would reach 65 tokens \(21 cached \+ 44 new\); AttentionConfig.max_model_len=64", id="limit-model-len"),
    pytest.param(lambda rt: rt.begin_step([R("c", 48), R("a", 1)], finished=["b"]), EngineLimitError, r"schedules 49 tokens", id="limit-with-finished"),
    # The cache cannot hold it.
    pytest.param(lambda rt: rt.begin_step([R("c", 48)]), OutOfBlocksError, r"nothing was allocated or freed", id="out-of-blocks"),
]


def _fill_cache(runtime: AttentionRuntime) -> None:
    """Take most free blocks, so a 48-token request cannot fit (for out-of-blocks)."""
    runtime.manager.pool.take(runtime.manager.pool.num_free_blocks - 2)


@pytest.mark.parametrize(("call", "error", "match"), BEGIN_STEP)
def test_begin_step_bad_input_changes_nothing(
    call: Callable[[AttentionRuntime], object], error: type[Exception], match: str
) -> None:
    runtime = make_runtime()
    if error is OutOfBlocksError:
        _fill_cache(runtime)
    before = snapshot(runtime)
    with pytest.raises(error, match=match):
        call(runtime)
    assert snapshot(runtime) == before
    # The current step is still usable: its layers run.
    n = before["step"].num_tokens  # type: ignore[attr-defined]
    runtime.forward("layers.0", hidden(n), hidden(n)[:, :2], hidden(n)[:, :2])


def _mamba(rows: int) -> Mamba2Inputs:
    width = MODEL.params["layers.1"].conv_dim  # type: ignore[attr-defined]
    heads = MODEL.params["layers.1"].num_heads  # type: ignore[attr-defined]
    return Mamba2Inputs(xBC=torch.zeros(rows, width), dt=torch.zeros(rows, heads))


LAYER_CALLS: list[Any] = [
    pytest.param(lambda rt: rt.forward("layers.0", [[0.0]]), ArgumentTypeError, r"layers.0: query must be a torch.Tensor \[T, Hq, D\], got list", id="forward-query-list"),
    pytest.param(lambda rt: rt.forward("layers.0", hidden(4), key=[1]), ArgumentTypeError, r"layers.0: key must be a torch.Tensor \[T, Hkv, D\], got list", id="forward-key-list"),
    pytest.param(lambda rt: rt.forward("layers.0", hidden(4), output="out"), ArgumentTypeError, r"layers.0: output must be a torch.Tensor \[T, Hq, Dv\] or None, got str", id="forward-output-str"),
    pytest.param(lambda rt: rt.forward("layers.0", torch.zeros(4, 64)), InvalidArgumentError, r"layers.0: query has 2 dimension\(s\), not 3; query must be float32 \[T, Hq, D\]=\[>=4, 4, 16\] on cpu, got float32 \[4, 64\] on cpu", id="forward-query-2d"),
    pytest.param(lambda rt: rt.forward("layers.0", hidden(3)), InvalidArgumentError, r"layers.0: query has 3 rows but the step has 4 tokens; query must be float32 \[T, Hq, D\]=\[>=4, 4, 16\] on cpu, got float32 \[3, 4, 16\] on cpu", id="forward-too-few-rows"),
    pytest.param(lambda rt: rt.forward("layers.0", hidden(4).to("meta")), InvalidArgumentError, r"layers.0: query is on meta, the runtime on cpu; query must be float32 \[T, Hq, D\]=\[>=4, 4, 16\] on cpu, got float32 \[4, 4, 16\] on meta", id="forward-other-device"),
    pytest.param(lambda rt: rt.forward("layers.9", hidden(4)), UnknownLayerError, r"unknown layer 'layers.9'; layers: layers.0, layers.1, layers.2", id="forward-unknown-layer"),
    pytest.param(lambda rt: rt.forward(["layers.0"], hidden(4)), UnknownLayerError, r"unknown layer \['layers.0'\]; layers:", id="forward-layer-list"),
    pytest.param(lambda rt: rt.forward("layers.1", hidden(4)), ArgumentTypeError, r"layers.1 is a state layer: call forward_state\('layers.1', Mamba2Inputs\(...\)\)", id="forward-state-layer"),
    pytest.param(lambda rt: rt.forward_state("layers.0", _mamba(4)), ArgumentTypeError, r"layers.0 is an attention layer: call forward\('layers.0', query, key, value\)", id="forward-state-attention-layer"),
    pytest.param(lambda rt: rt.forward_state("layers.1", GatedDeltaNetInputs(qkv=torch.zeros(4, 8), g=torch.zeros(4, 2), beta=torch.zeros(4, 2))), ArgumentTypeError, r"layers.1 is a mamba2 layer: inputs must be Mamba2Inputs, got GatedDeltaNetInputs", id="forward-state-wrong-inputs"),
    pytest.param(lambda rt: rt.forward_state("layers.1", hidden(4)), ArgumentTypeError, r"inputs must be Mamba2Inputs, got Tensor", id="forward-state-tensor"),
    pytest.param(lambda rt: rt.forward_state("layers.1", _mamba(2)), InvalidArgumentError, r"layers.1: inputs.xBC has 2 rows but the step has 4 tokens; inputs.xBC must be float32 \[T, C\]=\[>=4, 96\] on cpu, got float32 \[2, 96\] on cpu", id="forward-state-too-few-rows"),
    pytest.param(lambda rt: rt.forward_state("layers.1", _mamba(4), output=[0]), ArgumentTypeError, r"layers.1: output must be a torch.Tensor or None, got list", id="forward-state-output-list"),
    pytest.param(lambda rt: rt.state_layer("layers.1", GatedDeltaNetInputs), ArgumentTypeError, r"layers.1 is a mamba2 layer taking Mamba2Inputs, not GatedDeltaNetInputs", id="state-layer-wrong-type"),
    pytest.param(lambda rt: rt.state_layer("layers.2", Mamba2Inputs), ArgumentTypeError, r"layers.2 is an attention layer, not a state layer", id="state-layer-attention"),
    pytest.param(lambda rt: rt.block_table("layers.0", "zz"), UnknownRequestError, r"unknown request 'zz': it was never scheduled", id="block-table-unknown-request"),
    pytest.param(lambda rt: rt.block_table("nope", "a"), UnknownLayerError, r"unknown layer 'nope'", id="block-table-unknown-layer"),
    pytest.param(lambda rt: rt.metadata_for("nope"), UnknownLayerError, r"unknown layer 'nope'", id="metadata-unknown-layer"),
    pytest.param(lambda rt: rt.free("a"), ArgumentTypeError, r"req_ids must be an iterable of request ids .* got 'a'", id="free-string"),
    pytest.param(lambda rt: rt.free(["a", None]), ArgumentTypeError, r"req_ids must hold request ids \(str\), got None \(NoneType\)", id="free-none-id"),
    pytest.param(lambda rt: rt.free(["a", "zz"]), UnknownRequestError, r"unknown request 'zz': it was never scheduled", id="free-unknown-keeps-a"),
    pytest.param(lambda rt: rt.free(["a", "a"]), DuplicateRequestError, r"req_ids names request\(s\) \['a'\] twice", id="free-twice-in-one-call"),
]


@pytest.mark.parametrize(("call", "error", "match"), LAYER_CALLS)
def test_layer_calls_bad_input_changes_nothing(
    call: Callable[[AttentionRuntime], object], error: type[Exception], match: str
) -> None:
    runtime = make_runtime()
    before = snapshot(runtime)
    with pytest.raises(error, match=match):
        call(runtime)
    assert snapshot(runtime) == before


def test_free_of_a_freed_request_says_so_and_changes_nothing() -> None:
    runtime = make_runtime()
    runtime.free(["b"])
    before = snapshot(runtime)
    with pytest.raises(UnknownRequestError, match=r"request 'b' was already freed"):
        runtime.free(["b"])
    with pytest.raises(UnknownRequestError, match=r"request 'b' was already freed"):
        runtime.begin_step([R("a", 1)], finished=["b"])
    assert snapshot(runtime) == before
    # Scheduled again, the id starts anew and is live (not "already freed") again.
    runtime.begin_step([R("b", 2)])
    assert runtime.manager.num_tokens("b") == 2


@pytest.mark.parametrize("how", ["free", "manager"])
def test_a_step_whose_requests_were_freed_is_stale(how: str) -> None:
    """The step scheduled ``a``; once ``a`` is freed its metadata points into blocks
    back in the pool, so forward refuses instead of writing there."""
    runtime = make_runtime()
    n = runtime._step.num_tokens  # type: ignore[union-attr]
    if how == "free":
        runtime.free(["a"])
    else:
        runtime.manager.free_request("a")
    free_after = runtime.manager.pool.num_free_blocks
    cache = [t.clone() for t in runtime.kv_caches["layers.0"]]
    with pytest.raises(StaleStepError, match=r"(freed after begin_step|requests gained or lost)"):
        runtime.forward("layers.0", hidden(n), hidden(n)[:, :2], hidden(n)[:, :2])
    with pytest.raises(StaleStepError):
        runtime.forward_state("layers.1", _mamba(n))
    with pytest.raises(StaleStepError):
        runtime.metadata_for("layers.2")
    # Bytes, not values: the unwritten cache may hold NaN.
    after = runtime.kv_caches["layers.0"]
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(cache, after, strict=True)
    )
    assert runtime.manager.pool.num_free_blocks == free_after
    # A new step is fine.
    runtime.begin_step([R("b", 1)])
    runtime.forward("layers.0", hidden(1), hidden(1)[:, :2], hidden(1)[:, :2])


def test_freeing_an_unrelated_request_keeps_the_step() -> None:
    runtime = make_runtime()
    runtime.begin_step([R("a", 1)])  # b is live but not in this step
    runtime.free(["b"])
    runtime.forward("layers.0", hidden(1), hidden(1)[:, :2], hidden(1)[:, :2])


def test_forward_before_any_step_is_stale() -> None:
    runtime = AttentionRuntime(
        MODEL.specs,
        AttentionConfig(),
        device="cpu",
        memory_budget_bytes=1 << 22,
        layer_params=MODEL.params,
    )
    with pytest.raises(StaleStepError, match=r"forward\(\) called before begin_step\(\)"):
        runtime.forward("layers.0", hidden(1))
    with pytest.raises(StaleStepError, match=r"before begin_step"):
        runtime.metadata_for("layers.0")


def _runtime_with(**overrides: Any) -> AttentionRuntime:
    args: dict[str, Any] = {
        "layer_specs": MODEL.specs,
        "config": AttentionConfig(),
        "device": "cpu",
        "memory_budget_bytes": 1 << 22,
        "layer_params": MODEL.params,
    }
    args.update(overrides)
    specs = args.pop("layer_specs")
    config = args.pop("config")
    return AttentionRuntime(specs, config, **args)


CONSTRUCTOR: list[Any] = [
    pytest.param({"config": {"backend": "reference"}}, ArgumentTypeError, r"config must be an AttentionConfig, got dict", id="ctor-config-dict"),
    pytest.param({"layer_specs": []}, ArgumentTypeError, r"layer_specs must be a non-empty mapping of layer name -> KVCacheSpec, got \[\]", id="ctor-specs-list"),
    pytest.param({"layer_specs": {}}, ArgumentTypeError, r"layer_specs must be a non-empty mapping", id="ctor-specs-empty"),
    pytest.param({"layer_specs": {"l0": "full"}}, ArgumentTypeError, r"layer_specs must map layer names \(str\) to KVCacheSpec, got 'l0': str", id="ctor-spec-str"),
    pytest.param({"layer_specs": {0: attn()()}}, ArgumentTypeError, r"got 0: FullAttentionSpec", id="ctor-layer-name-int"),
    pytest.param({"layer_params": [1]}, ArgumentTypeError, r"layer_params must be a mapping of layer name -> LayerParams or None, got list", id="ctor-params-list"),
    pytest.param({"layer_params": {"nope": AttentionLayerParams(num_heads=2)}}, InvalidArgumentError, r"layer_params names layers that layer_specs lacks: \['nope'\]; layers: layers.0", id="ctor-params-unknown-layer"),
    pytest.param({"memory_budget_bytes": 0}, InvalidArgumentError, r"memory_budget_bytes must be a positive int, got 0", id="ctor-budget-0"),
    pytest.param({"memory_budget_bytes": 1.5e9}, InvalidArgumentError, r"memory_budget_bytes must be a positive int, got 1500000000.0", id="ctor-budget-float"),
    pytest.param({"memory_budget_bytes": 100}, InvalidArgumentError, r"memory_budget_bytes=100 holds 0 block\(s\)", id="ctor-budget-too-small"),
    pytest.param({"cache_fill": "nan"}, ArgumentTypeError, r"cache_fill must be a float or None, got 'nan'", id="ctor-fill-str"),
    pytest.param({"device": "tpu"}, InvalidArgumentError, r"device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'", id="ctor-device-tpu"),
    pytest.param({"device": "meta"}, InvalidArgumentError, r"got 'meta' \(attnkit runs on cpu, cuda\)", id="ctor-device-meta"),
    pytest.param({"device": 0}, ArgumentTypeError, r"device must be a torch.device or a string .* got 0 \(int\)", id="ctor-device-int"),
]

if not torch.cuda.is_available():
    CONSTRUCTOR += [
        pytest.param({"device": "cuda"}, DeviceUnavailableError, r"device 'cuda' is not available", id="ctor-device-absent-cuda"),
        pytest.param({"device": "cuda:7"}, DeviceUnavailableError, r"device 'cuda:7' is not available", id="ctor-device-absent-cuda-7"),
    ]


@pytest.mark.parametrize(("overrides", "error", "match"), CONSTRUCTOR)
def test_runtime_constructor_bad_input(
    overrides: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        _runtime_with(**overrides)


def test_layer_params_of_the_wrong_kind() -> None:
    params = dict(MODEL.params)
    params["layers.1"] = AttentionLayerParams(num_heads=2)  # a mamba layer
    with pytest.raises(InvalidArgumentError, match=r"layers.1"):
        _runtime_with(layer_params=params)


def test_manager_calls_validate_before_changing() -> None:
    specs = {
        "e": EncoderOnlyAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=F32),
        "x": CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=F32),
        "f": attn(block_size=4)(),
    }
    mgr = KVCacheManager(group_layers(specs), num_blocks=6)
    mgr.allocate_step([("a", 3, 2)])
    state = (mgr.pool.num_free_blocks, mgr.owned_blocks(), mgr.num_tokens("a"))
    with pytest.raises(OutOfBlocksError, match=r"nothing was allocated or freed"):
        mgr.allocate_step([("a", 1, 0), ("b", 30, 4)])
    with pytest.raises(UnknownRequestError, match=r"unknown request 'zz'"):
        mgr.free_request("zz")
    with pytest.raises(ArgumentTypeError, match=r"request ids are strings, got \['a'\] \(list\)"):
        mgr.row_of(["a"])  # type: ignore[arg-type]  # the wrong type is the test
    assert (mgr.pool.num_free_blocks, mgr.owned_blocks(), mgr.num_tokens("a")) == state


def test_a_builder_that_fails_leaves_no_half_built_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A builder error after allocation (a backend bug) must not let layers run on a
    mix of this step's and the last step's metadata."""
    runtime = make_runtime()
    group = runtime._groups[runtime._layer_group["layers.2"]]

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("builder bug")

    monkeypatch.setattr(group.builder, "build", broken)
    with pytest.raises(RuntimeError, match=r"builder bug"):
        runtime.begin_step([R("a", 1), R("b", 1)])
    with pytest.raises(StaleStepError, match=r"failed while building metadata \(RuntimeError: builder bug\)"):
        runtime.forward("layers.0", hidden(2), hidden(2)[:, :2], hidden(2)[:, :2])
    monkeypatch.undo()
    runtime.begin_step([R("a", 1)])
    runtime.forward("layers.0", hidden(1), hidden(1)[:, :2], hidden(1)[:, :2])
