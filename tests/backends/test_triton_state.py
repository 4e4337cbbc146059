"""The Triton state backends: declarations, routing by mamba_type, builder metadata,
CUDA-graph mechanics. Numerics are covered per kernel (tests/kernels) and end to end
through the runtime against dense recomputes (tests/test_runtime_state.py); a Gated
DeltaNet layer with fewer key heads than value heads is checked here through the impl
against the layer's token-by-token definition."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from attnkit import (
    AttentionCGSupport,
    AttentionConfig,
    BackendRegistry,
    GatedDeltaNetInputs,
    GatedDeltaNetLayerParams,
    LinearAttentionLayerParams,
    Mamba1LayerParams,
    MambaSpec,
    NoBackendError,
    select_backend,
)
from attnkit.backend_api import BackendRequest, CommonAttentionMetadata
from attnkit.backends.triton_state import (
    TritonGatedDeltaNetBackend,
    TritonGatedDeltaNetImpl,
    TritonLinearAttentionBackend,
    TritonLinearAttentionImpl,
    TritonMamba1Backend,
    TritonMamba1Impl,
    TritonMamba2Backend,
    TritonMamba2Impl,
    TritonShortConvBackend,
    TritonStateMetadataBuilder,
)
from attnkit.registry import BUILTIN_BACKENDS

CPU = torch.device("cpu")
CONFIG = AttentionConfig.model_validate({"max_num_reqs": 4}, context={"known_backends": []})
BACKENDS = {
    "mamba1": TritonMamba1Backend,
    "mamba2": TritonMamba2Backend,
    "gdn": TritonGatedDeltaNetBackend,
    "linear": TritonLinearAttentionBackend,
    "short_conv": TritonShortConvBackend,
}


def spec(mamba_type: str, dtypes: tuple[torch.dtype, ...] | None = None) -> MambaSpec:
    shapes: dict[str, tuple[tuple[int, ...], ...]] = {
        "mamba1": ((32, 3), (32, 16)),
        "mamba2": ((96, 3), (4, 16, 16)),
        "gdn": ((192, 3), (4, 16, 16)),
        "linear": ((4, 16, 16),),
        "short_conv": ((64, 2),),
    }
    default = (torch.float32,) * len(shapes[mamba_type])
    return MambaSpec(
        block_size=16, shapes=shapes[mamba_type], dtypes=dtypes or default, mamba_type=mamba_type
    )  # type: ignore[arg-type]  # a literal from the dict keys


def test_declarations_are_valid_and_one_type_each() -> None:
    for mamba_type, backend in BACKENDS.items():
        assert backend.declaration_problems() == []
        assert backend.supported_mamba_types == frozenset({mamba_type})
        assert (
            backend.not_supported_reasons(BackendRequest(spec=spec(mamba_type), device=CPU)) == []
        )
        other = next(t for t in BACKENDS if t != mamba_type)
        assert backend.not_supported_reasons(BackendRequest(spec=spec(other), device=CPU)) == [
            f"mamba_type={other} not supported (supported: {mamba_type})"
        ]


def test_state_dtype_reason() -> None:
    reasons = TritonMamba2Backend.not_supported_reasons(
        BackendRequest(spec=spec("mamba2", (torch.float32, torch.bfloat16)), device=CPU)
    )
    assert reasons == ["mamba2 ssm state dtype (dtypes[1]) must be float32, got bfloat16"]


def test_mamba1_state_dtype_reason_and_impl_checks() -> None:
    reasons = TritonMamba1Backend.not_supported_reasons(
        BackendRequest(spec=spec("mamba1", (torch.float32, torch.float16)), device=CPU)
    )
    assert reasons == ["mamba1 ssm state dtype (dtypes[1]) must be float32, got float16"]
    params = Mamba1LayerParams(
        d_inner=32,
        d_state=16,
        conv_weight=torch.zeros(32, 4),
        x_proj_weight=torch.zeros(2 + 32, 32),
        dt_proj_weight=torch.zeros(32, 2),
        A=-torch.ones(32, 16),
    )
    TritonMamba1Impl(spec("mamba1"), params)  # the spec fits
    with pytest.raises(
        ValueError,
        match=r"^TritonMamba1Impl: kv_cache_spec\.mamba_type must be 'mamba1', got 'mamba2'$",
    ):
        TritonMamba1Impl(spec("mamba2"), params)
    wide = MambaSpec(
        block_size=16, shapes=((32, 2), (32, 16)), dtypes=(torch.float32,) * 2, mamba_type="mamba1"
    )
    with pytest.raises(
        ValueError,
        match=r"TritonMamba1Impl: kv_cache_spec\.shapes must be layer_params\.state_shapes",
    ):
        TritonMamba1Impl(wide, params)


def test_interpreter_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert TritonGatedDeltaNetBackend.not_supported_reasons(
        BackendRequest(spec=spec("gdn"), device=CPU)
    ) == [
        "device=cpu needs the Triton interpreter (set TRITON_INTERPRET=1 before importing triton)"
    ]


def test_each_type_routes_to_its_backend_by_priority() -> None:
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    config = AttentionConfig.model_validate({}, context={"registry": reg})
    order = {
        "cpu": (
            "triton_mamba1",
            "triton_mamba2",
            "triton_gdn",
            "triton_linear_attn",
            "triton_short_conv",
            "reference",
        )
    }
    for mamba_type, backend in BACKENDS.items():
        chosen = select_backend(
            spec(mamba_type), config, device="cpu", registry=reg, priority=order
        )
        assert chosen.backend is backend
    # Naming one for the whole mamba kind fails loudly for the other types.
    forced = AttentionConfig.model_validate(
        {"backend_per_kind": "mamba=triton_gdn"}, context={"registry": reg}
    )
    with pytest.raises(NoBackendError, match=r"mamba_type=linear not supported \(supported: gdn\)"):
        select_backend(spec("linear"), forced, device="cpu", registry=reg)


def metadata(
    query_lens: list[int], seq_lens: list[int], blocks: list[int]
) -> CommonAttentionMetadata:
    return CommonAttentionMetadata.from_lists(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_table=[[b] for b in blocks],
        slot_mapping=[-1] * sum(query_lens),
    )


def test_builder_splits_decodes_from_the_rest() -> None:
    builder = TritonStateMetadataBuilder(spec("mamba2"), ["m"], CONFIG, CPU)
    assert builder.kv_cache_spec.mamba_type == "mamba2"
    # Two decodes, then a new one-token request (no state yet), then a prefill chunk.
    md = builder.build(0, metadata([1, 1, 1, 5], [9, 4, 1, 12], [7, 3, 5, 2]))
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (2, 2, 2)
    assert md.state_indices.tolist() == [7, 3, 5, 2]
    assert md.has_initial_state.tolist() == [True, True, False, True]
    assert md.prefill_query_start_loc.tolist() == [0, 1, 6]
    assert TritonStateMetadataBuilder.reorder_batch_threshold == 1


def test_cudagraph_capture_uses_fixed_addresses() -> None:
    builder = TritonStateMetadataBuilder(spec("gdn"), ["g"], CONFIG, CPU)
    assert (
        builder.get_cudagraph_support(CONFIG, spec("gdn"))
        is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )
    first = builder.build_for_cudagraph_capture(metadata([1, 1], [5, 9], [4, 6]))
    second = builder.build_for_cudagraph_capture(metadata([1, 1], [7, 2], [8, 1]))
    assert first.state_indices.data_ptr() == second.state_indices.data_ptr()
    assert second.state_indices.tolist() == [8, 1]
    with pytest.raises(RuntimeError, match=r"only batches where every request decodes one token"):
        builder.build_for_cudagraph_capture(metadata([2, 1], [5, 9], [4, 6]))
    with pytest.raises(
        RuntimeError,
        match=r"5 requests exceed the CUDA-graph buffer \(4\); raise AttentionConfig.max_num_reqs",
    ):
        builder.build_for_cudagraph_capture(metadata([1] * 5, [3] * 5, [1, 2, 3, 4, 5]))


def test_impl_checks_kernel_limits() -> None:
    gdn = GatedDeltaNetLayerParams(
        num_heads=4, key_dim=16, value_dim=16, conv_weight=torch.zeros(192, 4), chunk_size=8
    )
    with pytest.raises(
        ValueError, match=r"TritonGatedDeltaNetImpl: gdn chunk_size must be 16, 32 or 64, got 8"
    ):
        TritonGatedDeltaNetImpl(spec("gdn"), gdn)
    linear = LinearAttentionLayerParams(
        num_heads=4, key_dim=16, value_dim=16, decay=torch.ones(4), chunk_size=256
    )
    with pytest.raises(
        ValueError,
        match=r"TritonLinearAttentionImpl: linear-attention chunk_size must be <= 128, got 256",
    ):
        TritonLinearAttentionImpl(spec("linear"), linear)
    # One impl per type: the binding refuses another type's parameters before construction.
    (binding,) = TritonMamba2Backend.builders
    assert binding.impl_type is TritonMamba2Impl
    with pytest.raises(
        TypeError,
        match=r"TritonMamba2Impl takes layer_params of type Mamba2LayerParams, "
        r"got LinearAttentionLayerParams",
    ):
        binding.create_impl(spec("mamba2"), linear)


def test_import_does_not_pull_triton() -> None:
    code = (
        "import sys, attnkit.backends.triton_state as t, torch;"
        "from attnkit import MambaSpec; from attnkit.backend_api import BackendRequest;"
        "t.TritonMamba2Backend.not_supported_reasons(BackendRequest(spec=MambaSpec(block_size=1, shapes=((2, 2),), dtypes=(torch.float32,), mamba_type='short_conv'), device=torch.device('cpu')));"
        "print('triton' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_ssd_chunk_bookkeeping_is_planned_once_per_step() -> None:
    """Two Mamba2 layers in one group: the first plans the chunk offsets, the second reuses them."""
    import random

    from attnkit.demo import PRIORITIES, DemoModel
    from attnkit.runtime import AttentionRuntime, ScheduledRequest

    model = DemoModel(layout=("mamba", "mamba"))
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    config = AttentionConfig.model_validate({}, context={"registry": reg})
    runtime = AttentionRuntime(
        model.specs,
        config,
        device="cpu",
        memory_budget_bytes=2**20,
        layer_params=model.params,
        registry=reg,
        priority={"cpu": PRIORITIES["triton"]},
        cache_fill=float("nan"),
    )
    random.Random(0).shuffle(runtime.manager.pool._free)
    calls: list[int] = []
    impl = runtime._state_impls["layers.0"]
    assert isinstance(impl, TritonMamba2Impl)
    plan = impl._ssd_chunk_offsets

    def counting(qsl: torch.Tensor, num_tokens: int, chunk_size: int) -> torch.Tensor:
        calls.append(chunk_size)
        return plan(qsl, num_tokens, chunk_size)

    for name in ("layers.0", "layers.1"):
        layer_impl = runtime._state_impls[name]
        assert isinstance(layer_impl, TritonMamba2Impl)
        layer_impl._ssd_chunk_offsets = counting
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    batch = runtime.begin_step([ScheduledRequest("a", len(prompt)), ScheduledRequest("b", 5)])
    tokens = torch.tensor(
        [*prompt, *prompt[:5]] if batch.order[0] == "a" else [*prompt[:5], *prompt]
    )
    hidden = model.forward_step(runtime, tokens)
    assert calls == [model.params["layers.0"].chunk_size]  # type: ignore[union-attr]  # Mamba2LayerParams
    md = runtime.metadata_for("layers.1")
    cs = calls[0]
    assert batch.order == ("a", "b")
    assert md.chunk_offsets[cs].tolist() == [0, -(-20 // cs), -(-20 // cs) - (-5 // cs)]
    for rid, rows in batch.token_slices().items():
        seq = prompt if rid == "a" else prompt[:5]
        torch.testing.assert_close(
            hidden[rows], model.forward_dense(torch.tensor(seq)), atol=3e-5, rtol=3e-5
        )


def gdn_definition(
    p: GatedDeltaNetLayerParams, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through a GDN layer's core from zero states, token by token, float64:
    causal conv (SiLU) over ``qkv = q [Hk*K] | k [Hk*K] | v [H*V]``, q and k L2-normalised
    per key head, then the gated delta rule per value head ``h`` reading query/key head
    ``h // (H // Hk)``. Returns ``o`` ``[L, H, V]`` and the final state ``[H, K, V]``."""
    hk, h, kd, vd = p.key_heads, p.num_heads, p.key_dim, p.value_dim
    weight = p.conv_weight.double()
    history = torch.zeros(int(weight.shape[1]) - 1, p.conv_dim, dtype=torch.float64)
    state = torch.zeros(h, kd, vd, dtype=torch.float64)
    scale = kd**-0.5 if p.scale is None else p.scale
    outs = []
    for t in range(qkv.shape[0]):
        window = torch.cat([history, qkv[t : t + 1].double()])  # [W, C], oldest first
        history = window[1:]
        conv = torch.nn.functional.silu((window.T * weight).sum(dim=1))
        q = conv[: hk * kd].reshape(hk, kd)
        k = conv[hk * kd : 2 * hk * kd].reshape(hk, kd)
        v = conv[2 * hk * kd :].reshape(h, vd)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        o = torch.zeros(h, vd, dtype=torch.float64)
        for head in range(h):
            j = head // (h // hk)
            decayed = torch.exp(g[t, head].double()) * state[head]
            u = v[head] - decayed.T @ k[j]
            state[head] = decayed + beta[t, head].double() * torch.outer(k[j], u)
            o[head] = scale * (state[head].T @ q[j])
        outs.append(o)
    return torch.stack(outs), state


def test_gdn_impl_with_shared_key_heads_matches_definition() -> None:
    """Hk = 2 key heads shared by H = 4 value heads (Qwen3-Next's 16/32, small): the impl
    splits ``qkv`` as ``Hk*K | Hk*K | H*V`` and runs multi-chunk prefills, decodes and a
    continuing prefill next to decodes, as the float64 definition does."""
    gen = torch.Generator().manual_seed(5)
    key_heads, heads, key_dim, value_dim, width = 2, 4, 16, 16, 4
    conv_dim = 2 * key_heads * key_dim + heads * value_dim  # 128
    params = GatedDeltaNetLayerParams(
        num_heads=heads,
        num_key_heads=key_heads,
        key_dim=key_dim,
        value_dim=value_dim,
        conv_weight=torch.randn(conv_dim, width, generator=gen) * 0.5,
        chunk_size=16,
    )
    gdn_spec = MambaSpec(
        block_size=16,
        shapes=params.state_shapes,
        dtypes=(torch.float32, torch.float32),
        mamba_type="gdn",
    )
    assert gdn_spec.shapes == ((conv_dim, width - 1), (heads, key_dim, value_dim))
    builder = TritonStateMetadataBuilder(gdn_spec, ["layers.0.linear_attn"], CONFIG, CPU)
    impl = TritonGatedDeltaNetImpl(gdn_spec, params)

    # Tokens per request and step; continuing one-token requests go first in a batch
    # (the builder's decodes), so step 3 runs two decodes, then a 17-token prefill.
    steps = [((0, 20), (1, 5)), ((0, 1), (1, 1), (2, 6)), ((0, 1), (1, 1), (2, 1))]
    steps.append(((1, 1), (2, 1), (0, 17)))
    lengths = [sum(n for step in steps for r2, n in step if r2 == r) for r in range(3)]
    assert lengths == [39, 8, 8]
    blocks = [2, 5, 0]
    qkv_all = [torch.randn(n, conv_dim, generator=gen) for n in lengths]
    g_all = [
        torch.nn.functional.logsigmoid(torch.randn(n, heads, generator=gen) + 2) for n in lengths
    ]
    beta_all = [torch.sigmoid(torch.randn(n, heads, generator=gen)) for n in lengths]
    want = [gdn_definition(params, *parts) for parts in zip(qkv_all, g_all, beta_all, strict=True)]
    conv_states = torch.full((6, *gdn_spec.shapes[0]), float("nan"))
    states = torch.full((6, *gdn_spec.shapes[1]), float("nan"))
    done = [0] * len(lengths)
    for step in steps:
        md = builder.build(
            0,
            CommonAttentionMetadata.from_lists(
                query_lens=[n for _, n in step],
                seq_lens=[done[r] + n for r, n in step],
                block_table=[[blocks[r]] for r, _ in step],
                slot_mapping=[-1] * sum(n for _, n in step),
            ),
        )
        # The leading continuing one-token requests run the decode kernel.
        assert md.num_decodes == sum(1 for r, n in step if n == 1 and done[r] > 0)
        qkv, g, beta = (
            torch.cat([parts[r][done[r] : done[r] + n] for r, n in step])
            for parts in (qkv_all, g_all, beta_all)
        )
        output = torch.full((qkv.shape[0], heads, value_dim), float("nan"))
        impl.forward(
            GatedDeltaNetInputs(qkv=qkv, g=g, beta=beta), [conv_states, states], md, output
        )
        row = 0
        for r, n in step:
            torch.testing.assert_close(
                output[row : row + n].double(),
                want[r][0][done[r] : done[r] + n],
                atol=5e-5,
                rtol=5e-5,
            )
            row += n
            done[r] += n
    assert done == lengths
    for r, block in enumerate(blocks):
        torch.testing.assert_close(states[block].double(), want[r][1], atol=5e-5, rtol=5e-5)
