"""The ``triton_mla`` backend: multi-head latent attention with attnkit's Triton kernels.

Serves ``mla_attention`` and ``sliding_window_mla`` layers (DeepSeek-V2/V3's MLA,
arXiv:2405.04434 section 2.1, in its weight-absorbed form) with
``kernels.triton.mla_attention``. The cache ``[NB, BS, D]`` holds one latent per token,
``D = R + rope``: the first ``R = kv_lora_rank`` channels are the compressed KV (the
value of every head), the last ``rope`` channels the shared rotary key. The caller
absorbs ``W_UK`` into the query, so every head scores its ``[D]`` query against the
whole latent, and up-projects the ``[T, H, R]`` output with ``W_UV`` afterwards.

The contract is the reference backend's MLA path: ``query [T, H, D]`` (absorbed),
``key [T, 1, D]`` the step's new latents, ``value`` ``None`` or the latents again,
``output [T, H, R]`` with ``R = layer_params.v_head_size`` (``None``: ``D``),
``scale`` default ``D ** -0.5``. An fp8_e4m3 cache stores ``latent / k_scale`` (one
scale for the whole latent: it is both key and value).

The builder plans each step once with ``plan_paged_attention`` (one KV head, the
layer's window), exactly as ``triton_attn`` plans a one-KV-head layer: the one-pass
kernel for mixed prefill, chunked prefill and decode, or split-KV (flash-decoding)
for plain-decode batches whose few requests would leave SMs idle. Every layer of the
group launches with that plan.

Importing this module does not import triton: the builder and impl import the kernel
modules when they are constructed. On CPU the kernels run only under the Triton
interpreter (``TRITON_INTERPRET=1`` before triton is first imported).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from typing_extensions import override

from ..._validation import describe_tensor, dtype_name
from ...backend import AttentionBackend, BackendRequest
from ...binding import bind_each
from ...builder import AttentionCGSupport, AttentionMetadataBuilder
from ...capabilities import AttentionFeature, SizeRange, SizeRule
from ...config import AttentionConfig
from ...impl import AttentionImpl
from ...metadata import CommonAttentionMetadata, host_to_device
from ...params import AttentionLayerParams, attention_params_problems
from ...spec import (
    AttentionSpec,
    KVCacheDType,
    KVCacheSpec,
    KVCacheSpecKind,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from .._triton_env import triton_cpu_reasons
from .._triton_paged import GraphBuffers, fp8_e4m3_capability_reasons, num_sms

if TYPE_CHECKING:  # the kernel modules import triton; annotations only
    from ...kernels.triton.paged_attention import PagedAttentionPlan, SplitKVWorkspace

__all__ = [
    "TritonMLABackend",
    "TritonMLAImpl",
    "TritonMLAMetadata",
    "TritonMLAMetadataBuilder",
    "mla_params_problems",
]

_MLA_KINDS = frozenset({KVCacheSpecKind.MLA_ATTENTION, KVCacheSpecKind.SLIDING_WINDOW_MLA})

# What the launchers accept; kept here as literals because reading them from the kernel
# module would import triton. The test suite checks they still agree.
# Head size: the latent width D = R + rope, up to the launcher's MAX_LATENT_DIM (the
# kernel pads R and rope separately, to at least 16 each, so small widths work too).
_HEAD_SIZES: SizeRule = (SizeRange(16, 1024),)
_BLOCK_SIZES: SizeRule = (16, 32, 64, 128)
_KERNEL_MODULE = "attnkit.kernels.triton.mla_attention"
# No optional feature: soft-cap, ALiBi and sink logits are not part of MLA models, and
# forward() has no way to hand a log-sum-exp back (return_lse).
_FEATURES: frozenset[AttentionFeature] = frozenset()


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TritonMLAMetadata:
    """One MLA group's step, exactly as the Triton kernels take it.

    Attributes:
        query_start_loc: int32 ``[B+1]``.
        seq_lens: int32 ``[B]``.
        block_table: int32 ``[B, MB]``.
        slot_mapping: int64 ``[T']``; -1 = padding.
        max_query_len, max_seq_len: bounds that size the grid (Python ints).
        num_actual_tokens: ``T``; rows past it are padding.
        sliding_window: the group's window, or ``None``.
        num_splits: 0 for the one-pass kernel, ``S >= 2`` for split-KV decode (the
            plan's choice, repeated here).
        plan: the step's ``PagedAttentionPlan`` (validated metadata, path, grid); every
            layer of the group launches with it.

    In eager builds the tensors are ``CommonAttentionMetadata``'s own (no copies); in
    CUDA-graph builds they are views of the builder's fixed-address buffers, valid
    until its next build.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    sliding_window: int | None = None
    num_splits: int = 0
    plan: PagedAttentionPlan


class TritonMLAMetadataBuilder(AttentionMetadataBuilder[TritonMLAMetadata, AttentionSpec]):
    """Plans an MLA group's step: ``plan_paged_attention`` with one KV head and the
    group's window.

    Eager ``build`` passes the step's tensors through (reads only Python ints and the
    CPU offsets: no device sync, no per-request loop); ``build_for_cudagraph_capture``
    copies them into fixed-address buffers first.

    ``reorder_batch_threshold`` stays ``None``: the one-pass kernel takes prefills and
    decodes in any order (each query tile belongs to one request, found by a binary
    search over the tile offsets), and split-KV is chosen for batches that are all
    single-token decodes, which ordering does not change. Asking the runtime to reorder
    would buy nothing and cost every mixed step a permutation.

    Attributes:
        num_sms: streaming multiprocessors of the device (1 off CUDA); the split-KV
            heuristic fills them.
    """

    @classmethod
    @override
    def get_cudagraph_support(
        cls, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        # ALWAYS: graph builds copy the step into fixed-address buffers and plan with
        # grid bounds that depend only on the captured batch's shape (max_query_len = its
        # token count, the block table's full width, tile offsets computed on the
        # device), so any batch of that shape replays; the kernels read every
        # per-request value (offsets, lengths, blocks, slots, the fp8 scale) from
        # tensors and skip empty tiles.
        if kv_cache_spec.kind in _MLA_KINDS:
            return AttentionCGSupport.ALWAYS
        return AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        spec = kv_cache_spec
        self.sliding_window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        self.num_sms: int = num_sms(device)
        # Imported here (after selection): importing the backend must not import triton.
        # Assigned unannotated, so the attribute keeps the function's own signature.
        from ...kernels.triton.paged_attention import plan_paged_attention

        self._plan_paged_attention = plan_paged_attention
        self._graph: GraphBuffers | None = None

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TritonMLAMetadata:
        cm = common_attn_metadata
        if not cm.causal:
            raise ValueError(
                f"{type(self).__name__}: a {self.kv_cache_spec.kind.value} group needs "
                f"causal=True, got causal={cm.causal}"
            )
        plan = self._plan_paged_attention(
            cm.query_start_loc,
            cm.seq_lens,
            cm.block_table_tensor,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            block_size=self.kv_cache_spec.block_size,
            num_kv_heads=1,
            causal=True,
            sliding_window=self.sliding_window,
            num_tokens=cm.num_actual_tokens,
            # Split-KV for plain decode when the heuristic fills more SMs with it.
            num_splits=None,
            num_sms=self.num_sms,
            query_start_loc_cpu=cm.query_start_loc_cpu,
            copy_to_device=host_to_device,
        )
        return TritonMLAMetadata(
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens,
            sliding_window=self.sliding_window,
            num_splits=plan.num_splits,
            plan=plan,
        )

    @override
    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> TritonMLAMetadata:
        """Copy the step into fixed-address buffers; call it for the capture and before
        every replay of a batch of the same shape (``num_reqs`` and token count).

        Raises:
            ValueError: a non-causal batch.
            RuntimeError: a step larger than the config's ``max_num_reqs`` /
                ``max_num_batched_tokens`` / ``max_model_len``.
        """
        cm = common_attn_metadata
        if not cm.causal:
            raise ValueError(
                f"{type(self).__name__}: a {self.kv_cache_spec.kind.value} group needs "
                f"causal=True, got causal={cm.causal}"
            )
        step = self._graph_buffers().load(type(self).__name__, cm)
        # Tile offsets computed on the device into a fixed buffer; the grid is the
        # plan's shape-only bound, so every batch of this shape replays.
        plan = self._plan_paged_attention(
            step.query_start_loc,
            step.seq_lens,
            step.block_table,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            block_size=self.kv_cache_spec.block_size,
            num_kv_heads=1,
            causal=True,
            sliding_window=self.sliding_window,
            num_tokens=step.num_tokens,
            num_splits=0,
            tile_offsets_out=step.tile_offsets,
        )
        return TritonMLAMetadata(
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            block_table=step.block_table,
            slot_mapping=step.slot_mapping,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens,
            sliding_window=self.sliding_window,
            num_splits=0,
            plan=plan,
        )

    def _graph_buffers(self) -> GraphBuffers:
        if self._graph is None:
            self._graph = GraphBuffers.allocate(
                self.config, self.kv_cache_spec.block_size, self.device
            )
        return self._graph


def mla_params_problems(spec: AttentionSpec, params: AttentionLayerParams) -> list[str]:
    """What keeps ``triton_mla`` from running an MLA layer with ``params`` (empty: nothing).

    The generic checks (features, sink tokens, head counts) of
    ``attention_params_problems``, plus MLA's own: the values are the latent's first
    ``v_head_size`` channels, so ``v_head_size`` (the kv_lora_rank) must be at most the
    latent width.
    """
    # v_head_size is checked here: narrower values are what MLA is.
    generic = dataclasses.replace(params, v_head_size=None)
    problems = attention_params_problems(
        spec, generic, backend="triton_mla", supported_features=_FEATURES
    )
    rank = params.v_head_size
    if rank is not None and rank > spec.head_size:
        problems.append(
            f"v_head_size (the kv_lora_rank) must be at most the latent width "
            f"head_size={spec.head_size}, got {rank}"
        )
    return problems


def _check_tensor(
    owner: str,
    name: str,
    t: object,
    *,
    layout: str,
    shape: tuple[int | None, ...],
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check ``t``'s rank, sizes (``None`` = any), dtype and device.

    Raises:
        TypeError: ``t`` is not a tensor.
        ValueError: naming ``owner``, ``name``, what was expected and what was given.
    """
    want = (
        f"{dtype_name(dtype)} {layout}=[{', '.join('*' if d is None else str(d) for d in shape)}]"
    )
    if device is not None:
        want = f"{want} on {device}"
    if not isinstance(t, torch.Tensor):
        got = "None" if t is None else f"a {type(t).__name__}"
        raise TypeError(f"{owner}: {name} must be a torch.Tensor {want}, got {got}")
    if (
        t.dim() != len(shape)
        or any(w is not None and g != w for g, w in zip(t.shape, shape, strict=True))
        or t.dtype != dtype
        or (device is not None and t.device != device)
    ):
        raise ValueError(f"{owner}: {name} must be {want}, got {describe_tensor(t)}")
    return t


class TritonMLAImpl(AttentionImpl[TritonMLAMetadata, AttentionSpec, AttentionLayerParams]):
    """Writes the step's latents with ``write_mla_latents``, then runs ``mla_attention``
    with the step's plan (the one-pass kernel, or split-KV when the plan chose it).

    Attributes:
        kv_lora_rank: ``R``, the value width (``layer_params.v_head_size``, or the
            whole latent when it is ``None``).
        scale: the softmax scale (``layer_params.scale``, default ``D ** -0.5`` with
            ``D`` the latent width, as in the reference backend).

    Raises at construction (so a bad layer fails before its first step):
        ValueError: ``layer_params`` asks for a feature the backend does not declare,
            or does not fit the spec.
    """

    def __init__(self, kv_cache_spec: AttentionSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        problems = mla_params_problems(kv_cache_spec, layer_params)
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        self.num_heads = layer_params.num_heads
        self.head_size = kv_cache_spec.head_size
        self.kv_lora_rank: int = (
            layer_params.v_head_size if layer_params.v_head_size is not None else self.head_size
        )
        self.scale: float = (
            layer_params.scale if layer_params.scale is not None else self.head_size**-0.5
        )
        self.fp8 = kv_cache_spec.kv_cache_dtype == "fp8_e4m3"
        # The fp8 scale on the layer's device, made on the first forward (the device is
        # not known before) and reused, so later steps and graph replays allocate nothing.
        self._kv_scale: torch.Tensor | None = None
        self._workspace: SplitKVWorkspace | None = None
        # Imported here, not at module level: importing the backend must not import
        # triton (and on CPU, triton must be imported after TRITON_INTERPRET is set).
        # Assigned unannotated, so each attribute keeps the launcher's own signature.
        from ...kernels.triton.mla_attention import (
            mla_attention,
            mla_split_workspace,
            write_mla_latents,
        )

        self._mla_attention = mla_attention
        self._mla_split_workspace = mla_split_workspace
        self._write_mla_latents = write_mla_latents

    def _scale_tensor(self, device: torch.device) -> torch.Tensor | None:
        """float32 ``[1]`` holding ``k_scale`` on ``device`` for fp8 caches, else None."""
        if not self.fp8:
            return None
        if self._kv_scale is None or self._kv_scale.device != device:
            self._kv_scale = torch.tensor(
                [float(self.layer_params.k_scale)], dtype=torch.float32, device=device
            )
        return self._kv_scale

    def _split_workspace(
        self, num_splits: int, num_tokens: int, device: torch.device
    ) -> SplitKVWorkspace:
        """Scratch of the split path, grown when a step needs more (reused otherwise)."""
        ws = self._workspace
        if ws is None or ws[0].shape[0] < num_splits or ws[0].shape[1] < num_tokens:
            splits = max(num_splits, ws[0].shape[0] if ws else 0)
            tokens = max(num_tokens, ws[0].shape[1] if ws else 0)
            ws = self._mla_split_workspace(
                splits, tokens, self.num_heads, self.kv_lora_rank, device=device
            )
            self._workspace = ws
        return ws

    def _check_inputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: object,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Check every argument (shapes, dtypes, devices only: no device reads); return
        the cache tensor."""
        spec = self.kv_cache_spec
        owner = f"{type(self).__name__}.forward ({spec.kind.value})"
        if not isinstance(attn_metadata, TritonMLAMetadata):
            raise TypeError(
                f"{owner}: attn_metadata must be TritonMLAMetadata, "
                f"got {type(attn_metadata).__name__}"
            )
        d = self.head_size
        query = _check_tensor(
            owner,
            "query (absorbed)",
            query,
            layout="[T, H, D]",
            shape=(None, self.num_heads, d),
            dtype=spec.dtype,
        )
        device, tokens = query.device, query.shape[0]
        if tokens < attn_metadata.num_actual_tokens:
            raise ValueError(
                f"{owner}: query must have at least num_actual_tokens="
                f"{attn_metadata.num_actual_tokens} rows, got {describe_tensor(query)}"
            )
        _check_tensor(
            owner,
            "output",
            output,
            layout="[T, H, R]",
            shape=(tokens, self.num_heads, self.kv_lora_rank),
            dtype=query.dtype,
            device=device,
        )
        _check_tensor(
            owner,
            "key (the new latents)",
            key,
            layout="[T, 1, D]",
            shape=(tokens, 1, d),
            dtype=query.dtype,
            device=device,
        )
        if value is not None:
            _check_tensor(
                owner,
                "value (None or the latents again)",
                value,
                layout="[T, 1, D]",
                shape=(tokens, 1, d),
                dtype=query.dtype,
                device=device,
            )
        if len(kv_cache) != 1:
            raise ValueError(f"{owner}: kv_cache must hold 1 tensor, got {len(kv_cache)}")
        return _check_tensor(
            owner,
            "kv_cache[0]",
            kv_cache[0],
            layout="[NB, BS, D]",
            shape=(None, spec.block_size, d),
            dtype=spec.cache_torch_dtype,
            device=device,
        )

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonMLAMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Write the new latents (``key[:T, 0]``) into the cache, then attend.

        ``value`` is ignored (the latents are written once, from ``key``).
        """
        cache = self._check_inputs(query, key, value, kv_cache, attn_metadata, output)
        assert key is not None  # checked above
        m = attn_metadata
        n = m.num_actual_tokens
        kv_scale = self._scale_tensor(query.device)
        self._write_mla_latents(key[:n, 0], cache, m.slot_mapping[:n], kv_scale=kv_scale)
        plan = m.plan
        workspace = (
            self._split_workspace(plan.num_splits, query.shape[0], query.device)
            if plan.num_splits
            else None
        )
        self._mla_attention(
            query,
            cache,
            plan,
            kv_lora_rank=self.kv_lora_rank,
            scale=self.scale,
            kv_scale=kv_scale,
            output=output,
            workspace=workspace,
        )
        return output


class TritonMLABackend(AttentionBackend):
    """Multi-head latent attention (DeepSeek-V2/V3) in Triton: full and sliding-window MLA."""

    name = "triton_mla"
    description = (
        "Triton multi-head latent attention (absorbed MLA): full and sliding-window, "
        "fp8 latent cache, split-KV decode, CUDA graphs"
    )
    supported_devices = frozenset({"cpu", "cuda"})
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto", "fp8_e4m3"})
    supported_head_sizes = _HEAD_SIZES
    supported_block_sizes = _BLOCK_SIZES
    supported_features = _FEATURES
    required_packages: ClassVar[Mapping[str, str]] = {"triton": "triton>=3.0"}
    builders = bind_each(
        (MLAAttentionSpec, SlidingWindowMLASpec), TritonMLAMetadataBuilder, TritonMLAImpl
    )

    @classmethod
    @override
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        """On CPU, the Triton interpreter must be on (read from the environment now)."""
        return triton_cpu_reasons(device, _KERNEL_MODULE)

    @classmethod
    @override
    def extra_not_supported_reasons(cls, request: BackendRequest) -> list[str]:
        """fp8_e4m3 caches need compute capability >= 8.9 on CUDA (see
        ``fp8_e4m3_capability_reasons``; the rule ``triton_attn`` declares)."""
        return fp8_e4m3_capability_reasons(request)
