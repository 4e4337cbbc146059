"""The ``flash_attn`` backend: flash-attn 2 or 4 ``flash_attn_varlen_func`` over the paged cache.

Serves ``full_attention``, ``sliding_window``, ``encoder_only_attention`` and
``cross_attention`` layers in fp16/bf16 on CUDA. Which flash-attn runs is chosen once
per group (``FlashAttentionOptions.version``, else by compute capability; every
version rule is in ``_versions``). The builder emits exactly the arguments
``flash_attn_varlen_func`` takes; ``forward`` writes the step's keys/values into the
cache and calls it with them unchanged. Two adjustments keep the real kernels' hidden
preconditions (docs/flash-attn.md): flash-attn 2 gets ``max_seqlen_q=2`` for a decode
step with zero-length query rows (``_fa2_max_seqlen_q``), and before a flash-attn 4
call the unused rows of each request's last page are zeroed (``_zero_page_tails``).

Not served: ``chunked_local_attention`` (neither version's ``window_size`` can express
a chunk mask, and a chunk-splitting rewrite of the batch is not "the call as it is"),
sink tokens, MLA, and fp8 caches.

Cache layout: attnkit's default ``[NB, 2, BS, Hkv, D]``; the kernels get
``cache[:, 0]`` and ``cache[:, 1]``, strided views of shape ``[NB, BS, Hkv, D]``
(both versions index pages through the tensor's strides and need only the last
dimension contiguous).

Importing this module does not import flash-attn: the impl imports it on its first
``forward``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, Literal, Protocol, cast, overload

import torch
from typing_extensions import override

from ...backend import AttentionBackend, BackendRequest
from ...binding import bind_each
from ...builder import AttentionCGSupport, AttentionMetadataBuilder
from ...capabilities import AttentionFeature, Determinism, SizeRange
from ...config import AttentionConfig, BackendOptions
from ...impl import AttentionImpl
from ...kinds import rules_for
from ...metadata import CommonAttentionMetadata
from ...params import AttentionLayerParams, attention_params_problems
from ...spec import (
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    SlidingWindowSpec,
)
from . import _versions
from ._versions import FlashAttnVersion

__all__ = [
    "FlashAttentionBackend",
    "FlashAttentionImpl",
    "FlashAttentionMetadata",
    "FlashAttentionMetadataBuilder",
    "FlashAttentionOptions",
]

_FEATURES = frozenset(
    {
        AttentionFeature.LOGITS_SOFT_CAP,
        AttentionFeature.ALIBI,
        AttentionFeature.ATTENTION_SINKS,
    }
)


class FlashAttn2VarlenFunc(Protocol):
    """flash-attn 2's ``flash_attn_varlen_func`` as this backend calls it (every argument
    it passes, typed as it passes them; flash-attn itself ships no type hints)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        /,
        *,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor | None,
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float,
        causal: bool,
        window_size: tuple[int | None, int | None],
        softcap: float,
        alibi_slopes: torch.Tensor | None,
        block_table: torch.Tensor | None,
    ) -> torch.Tensor: ...


class FlashAttn4VarlenFunc(Protocol):
    """flash-attn 4's ``flash_attn_varlen_func`` (``flash_attn.cute``) as this backend
    calls it. It returns ``(out, lse)``; an ``out`` alone is accepted too."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        /,
        *,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor | None,
        max_seqlen_q: int,
        max_seqlen_k: int,
        seqused_k: torch.Tensor | None,
        page_table: torch.Tensor | None,
        softmax_scale: float,
        causal: bool,
        window_size: tuple[int | None, int | None],
        learnable_sink: torch.Tensor | None,
        softcap: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | torch.Tensor: ...


VarlenFunc = FlashAttn2VarlenFunc | FlashAttn4VarlenFunc
"""A ``flash_attn_varlen_func`` of either version, or a stand-in with its arguments."""


class FlashAttentionOptions(BackendOptions):
    """Settings of the ``flash_attn`` backend: ``backend_options={"flash_attn": {...}}``.

    Attributes:
        version: which flash-attn to drive: 2 (``flash_attn``), 4 (``flash_attn.cute``,
            the ``flash-attn-4`` wheel), or ``None`` to choose by compute capability.
    """

    version: Literal[2, 4] | None = None


def _options(config: AttentionConfig | None) -> FlashAttentionOptions:
    if config is None:
        return FlashAttentionOptions()
    return config.options_for("flash_attn", FlashAttentionOptions)


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not _versions.cuda_available():
        return None
    return torch.cuda.get_device_capability(device)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class FlashAttentionMetadata:
    """One group's step, as ``flash_attn_varlen_func`` takes it.

    Attributes:
        version: which flash-attn the group runs (2 or 4).
        num_reqs: ``B``.
        num_actual_tokens: ``T``; rows of ``query``/``output`` past it are padding
            (not written to the cache, their output left untouched).
        cu_seqlens_q: int32 ``[B+1]``, the step's ``query_start_loc``.
        cu_seqlens_k: int32 ``[B+1]`` key offsets: flash-attn 2 with a block table, the
            cumulative ``seq_lens`` (its key lengths); encoder-only layers, the same
            tensor as ``cu_seqlens_q``; ``None`` for flash-attn 4 with a page table.
        seqused_k: int32 ``[B]`` keys per request (``seq_lens``) for flash-attn 4 with a
            page table; ``None`` otherwise.
        block_table: int32 ``[B, W]`` (``W`` may exceed the step's widest row; only the
            first ``ceil(seq_len / block_size)`` entries of a row are read):
            flash-attn 2's ``block_table``, flash-attn 4's ``page_table``; ``None`` for
            encoder-only layers.
        max_seqlen_q: the step's longest query (a Python int); flash-attn 2: 2 when the
            longest is 1 and some request has no query row (``_fa2_max_seqlen_q``).
        max_seqlen_k: the step's longest key range (a Python int; in a CUDA-graph
            capture, the longest the buffers hold).
        causal: ``causal=`` (False for encoder-only and cross attention).
        window_size: ``window_size=(left, right)`` as the version takes it.
        slot_mapping: int64 ``[T']`` cache slot of each new key/value, -1 = none.
        release: the installed release of ``version`` whose rules apply (``None``:
            unknown, the oldest rules); it decides the ``learnable_sink`` dtype.

    Tensors live in the builder's persistent buffers when the batch fits them, so a
    metadata object is valid until the builder's next ``build``.
    """

    version: FlashAttnVersion
    num_reqs: int
    num_actual_tokens: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor | None
    seqused_k: torch.Tensor | None
    block_table: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    window_size: tuple[int | None, int | None]
    slot_mapping: torch.Tensor
    release: str | None = None


class FlashAttentionMetadataBuilder(
    AttentionMetadataBuilder[FlashAttentionMetadata, AttentionSpec]
):
    """Copies the step into persistent buffers and emits flash-attn's arguments.

    Reads only Python ints and host copies from ``CommonAttentionMetadata``: no device
    sync. Buffers are allocated once, on the builder's device, for up to
    ``max_num_reqs`` requests, ``max_num_tokens`` slot-mapping entries and
    ``max_model_len`` tokens of context per request (block-table width
    ``ceil(max_model_len / block_size)``); a larger step uses the batch's own tensors
    (correct, but not capturable). Subclass to change the maxima.
    """

    max_num_reqs: ClassVar[int] = 256
    max_num_tokens: ClassVar[int] = 8192
    max_model_len: ClassVar[int] = 32768

    @classmethod
    @override
    def get_cudagraph_support(
        cls, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        # Every tensor the call and the KV write read sits in a buffer allocated in
        # __init__ (for batches within the maxima), so a replay reads the new step's
        # values at the captured addresses. What a capture bakes in are the Python
        # ints: the batch size and the row count (fixed by the captured shape),
        # max_seqlen_q (it sizes the kernels' grids: fixed only when every request has
        # the same query length) and max_seqlen_k (flash-attn 2 drops a window wider
        # than it and sizes its KV splits from it; a capture therefore passes the
        # longest context the buffers hold, see build_for_cudagraph_capture). Mixed
        # batches change max_seqlen_q from step to step, so UNIFORM_BATCH, not ALWAYS.
        # flash-attn 4 compiles on first use: warm up before capturing. Not yet
        # exercised on a GPU.
        return AttentionCGSupport.UNIFORM_BATCH

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        spec = kv_cache_spec
        choice = _versions.choose_version(
            _options(config).version,
            _capability(device),
            installed=_versions.installed_releases(),
        )
        if choice.version is None:
            raise ValueError(f"{type(self).__name__}: {_versions.NOT_INSTALLED_REASON}")
        self.version: FlashAttnVersion = choice.version
        self.release = choice.release
        self.kind = spec.kind
        rules = rules_for(spec)
        mask = rules.mask(spec)
        self.causal = mask.causal
        # The kernel reads keys/values from the paged cache (through a block table).
        self.paged = rules.has_cache
        self.window_size = _versions.window_size(self.version, mask.window)
        self.max_blocks = math.ceil(self.max_model_len / spec.block_size) if self.paged else 0
        # Batch-invariant: flash-attn 2 never gets max_seqlen_q == 1 (_fa2_max_seqlen_q).
        self.invariant = config.determinism >= Determinism.BATCH_INVARIANT

        def buffer(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        r = self.max_num_reqs
        self._cu_seqlens_q = buffer(r + 1, dtype=torch.int32)
        self._slot_mapping = buffer(self.max_num_tokens, dtype=torch.int64)
        self._seq_lens = buffer(r, dtype=torch.int32)
        # flash-attn 2's cu_seqlens_k: entry 0 stays 0, build() writes the rest.
        self._cu_seqlens_k = buffer(r + 1, dtype=torch.int32)
        self._block_table = buffer(r, self.max_blocks, dtype=torch.int32)

    def fits(self, common_attn_metadata: CommonAttentionMetadata) -> bool:
        """Whether the step fits the persistent buffers (else its own tensors are used)."""
        cm = common_attn_metadata
        return (
            cm.num_reqs <= self.max_num_reqs
            and cm.slot_mapping.shape[0] <= self.max_num_tokens
            and (not self.paged or cm.block_table_tensor.shape[1] <= self.max_blocks)
        )

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> FlashAttentionMetadata:
        cm = common_attn_metadata
        who = type(self).__name__
        if cm.causal is not self.causal:
            raise ValueError(
                f"{who}: common_attn_metadata.causal must be {self.causal} for "
                f"{self.kind.value} layers, got {cm.causal}"
            )
        b = cm.num_reqs
        if not self.paged and not torch.equal(
            cm.seq_lens_cpu, cm.query_lens_cpu
        ):
            raise ValueError(
                f"{who}: encoder_only_attention encodes each request whole in one step, so "
                f"seq_lens must equal the query lengths, got seq_lens="
                f"{cm.seq_lens_cpu.tolist()} and query lengths {cm.query_lens_cpu.tolist()}"  # pyright: ignore[reportUnknownMemberType]  # torch types tolist() as a bare List
            )
        fits = self.fits(cm)

        def staged(buf: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
            if not fits:
                return src
            view = buf[: src.shape[0]]
            view.copy_(src, non_blocking=True)
            return view

        cu_seqlens_q = staged(self._cu_seqlens_q, cm.query_start_loc)
        slot_mapping = staged(self._slot_mapping, cm.slot_mapping)
        cu_seqlens_k: torch.Tensor | None = None
        seqused_k: torch.Tensor | None = None
        block_table: torch.Tensor | None = None
        if not self.paged:  # encoder-only: keys are this step's own rows
            cu_seqlens_k = cu_seqlens_q
            max_seqlen_k = cm.max_query_len
        else:
            max_seqlen_k = cm.max_seq_len
            table = cm.block_table_tensor
            if fits:
                self._block_table[:b, : table.shape[1]].copy_(table, non_blocking=True)
                # Full width: the captured shape must not depend on the step's widest row.
                block_table = self._block_table[:b]
            else:
                block_table = table
            if self.version == 4:
                seqused_k = staged(self._seq_lens, cm.seq_lens)
            else:
                cu_seqlens_k = (
                    self._cu_seqlens_k[: b + 1]
                    if fits
                    else torch.zeros(b + 1, dtype=torch.int32, device=cm.seq_lens.device)
                )
                torch.cumsum(cm.seq_lens, 0, dtype=torch.int32, out=cu_seqlens_k[1:])
        max_seqlen_q = cm.max_query_len
        if self.version == 2:
            max_seqlen_q = _fa2_max_seqlen_q(cm)
            if self.invariant and max_seqlen_q == 1:
                # Batch-invariant: never the reshaped GQA decode path. It is also
                # flash-attn 2's only split-KV path ("Only apply split-k for decoding":
                # set_params_splitkv picks num_splits from the batch size and the
                # longest context) and it drops causal, so a decode row would take one
                # kernel in an all-decode step and another beside a prefill. With
                # max_seqlen_q >= 2 every step runs the one varlen kernel, num_splits
                # 1, each request's rows over its own keys.
                max_seqlen_q = 2
        return FlashAttentionMetadata(
            version=self.version,
            num_reqs=b,
            num_actual_tokens=cm.num_actual_tokens,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            seqused_k=seqused_k,
            block_table=block_table,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            causal=self.causal,
            window_size=self.window_size,
            slot_mapping=slot_mapping,
            release=self.release,
        )

    @override
    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> FlashAttentionMetadata:
        """As ``build``, for a capture: the batch must fit the buffers, and
        ``max_seqlen_k`` is the longest context they hold (a replay may see any)."""
        if not self.fits(common_attn_metadata):
            raise RuntimeError(
                f"{type(self).__name__} cannot capture this batch in a CUDA graph: it "
                f"exceeds the persistent buffers (max_num_reqs={self.max_num_reqs}, "
                f"max_num_tokens={self.max_num_tokens}, max_model_len={self.max_model_len})"
            )
        md = super().build_for_cudagraph_capture(common_attn_metadata)
        if self.paged:
            md = dataclasses.replace(
                md, max_seqlen_k=self.max_blocks * self.kv_cache_spec.block_size
            )
        return md


def _fa2_max_seqlen_q(cm: CommonAttentionMetadata) -> int:
    """flash-attn 2's ``max_seqlen_q`` for the step: the longest query, except 2 for a
    step whose longest query is 1 but where some request has none.

    With ``max_seqlen_q == 1`` (and GQA, no window, no ALiBi) flash-attn 2 reshapes ``q``
    to ``(batch, num_heads_k, ngroups, d)`` and ignores ``cu_seqlens_q`` (2.8.3
    ``csrc/flash_attn/flash_api.cpp``, ``mha_varlen_fwd``, lines 585-598): that needs
    ``total_q == batch``, which a zero-length query row breaks. ``max_seqlen_q`` is an
    upper bound (it sizes the grid: one query tile either way), so 2 takes the general
    varlen path, which reads ``cu_seqlens_q`` and skips empty rows; bottom-right causal
    alignment gives a one-token row every key, as before. Reads host data only.
    """
    longest = cm.max_query_len
    if longest == 1 and cm.num_actual_tokens < cm.num_reqs:
        return 2
    return longest


def _zero_page_tails(
    cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    """Zero the rows past ``seq_lens[r]`` in request ``r``'s last page (both planes).

    flash-attn 4 loads whole pages when they load by TMA: rows past ``seqused_k`` in a
    sequence's last, partly used page are read, their scores masked, but ``0 * NaN`` in
    ``P @ V`` is NaN, so they must be finite (b36 ``flash_attn_varlen_func`` docstring,
    ``page_table``). attnkit's cache is uninitialised memory (and a freed page may have
    held another group's bytes), so before each call the tail of every last page is
    zeroed: ``B * block_size`` rows per plane, whatever the step's token count. Every
    other row the kernel reads is a written key/value (rows below ``seq_len``) or the
    null block (zeros). No host sync, fixed shapes (CUDA-graph safe): rows not to clear
    (and requests with no keys, whose table row may be stale) rewrite the null block's
    first row with the zeros it holds.
    """
    if block_table.shape[0] == 0 or block_table.shape[1] == 0:
        return
    block_size = cache.shape[2]
    lens = seq_lens.long()
    last = torch.clamp(lens - 1, min=0) // block_size
    pages = block_table.long().gather(1, last[:, None])
    rows = torch.arange(block_size, device=cache.device)[None, :]
    tail = (rows >= (lens - last * block_size)[:, None]) & (lens > 0)[:, None]
    blocks = torch.where(tail, pages, torch.zeros_like(pages)).flatten()
    offsets = torch.where(tail, rows, torch.zeros_like(rows)).flatten()
    zero = torch.zeros((), dtype=cache.dtype, device=cache.device)
    for plane in (0, 1):
        cache[:, plane].index_put_((blocks, offsets), zero)


def _write_kv(
    key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``[N, Hkv, D]`` keys/values into ``cache`` ``[NB, 2, BS, Hkv, D]``; slot -1 is skipped.

    No host sync and fixed shapes (CUDA-graph safe): a -1 entry rewrites slot 0 (block 0,
    the null block no request owns) with the value it already holds.
    """
    block_size = cache.shape[2]
    valid = slot_mapping >= 0
    safe = torch.where(valid, slot_mapping, torch.zeros_like(slot_mapping))
    blocks = torch.div(safe, block_size, rounding_mode="floor")
    offsets = safe - blocks * block_size
    keep = valid[:, None, None]
    for plane, new in ((0, key), (1, value)):
        view = cache[:, plane]
        old = view[blocks, offsets]
        view[blocks, offsets] = torch.where(keep, new.to(cache.dtype), old)


@overload
def _import_varlen_func(version: Literal[2]) -> FlashAttn2VarlenFunc: ...
@overload
def _import_varlen_func(version: Literal[4]) -> FlashAttn4VarlenFunc: ...
def _import_varlen_func(version: FlashAttnVersion) -> VarlenFunc:
    """Import ``flash_attn_varlen_func`` of flash-attn ``version`` (on first use), and
    check that it takes every keyword the backend passes.

    The check catches a ``flash_attn.cute`` that is not flash-attn 4's: flash-attn
    2.8.0-2.8.3 ship a prototype ``flash_attn/cute`` package (no ``max_seqlen_q``), and
    it can shadow flash-attn-4's files when both distributions are installed.
    """
    module_name = "flash_attn.flash_attn_interface" if version == 2 else "flash_attn.cute"
    pip = _versions.FA2_PIP if version == 2 else _versions.FA4_PIP
    where = f"{module_name}.flash_attn_varlen_func"
    try:
        module = importlib.import_module(module_name)
        # Untyped package: the attribute is trusted to be the function the protocol of
        # ``version`` describes (the overloads above say which), once its keywords match.
        func: VarlenFunc = module.flash_attn_varlen_func
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"the flash_attn backend runs flash-attn {version}, but {where} could not be "
            f"imported ({exc}); install it with: {pip}"
        ) from exc
    protocol = FlashAttn2VarlenFunc if version == 2 else FlashAttn4VarlenFunc
    missing = _missing_keywords(func, protocol)
    if missing:
        raise ImportError(
            f"the flash_attn backend runs flash-attn {version}, but {where} does not take "
            f"{', '.join(missing)}: it is not flash-attn {version}'s interface (flash-attn "
            f"2.8.x ships a prototype flash_attn.cute); install it with: {pip}"
        )
    return func


def _missing_keywords(func: Callable[..., object], protocol: type) -> list[str]:
    """The keyword arguments of ``protocol.__call__`` that ``func`` does not take."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):  # no signature to read (a C function): trust it
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    wanted = [
        name
        for name, p in inspect.signature(protocol.__call__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    return [name for name in wanted if name not in params]


class FlashAttentionImpl(AttentionImpl[FlashAttentionMetadata, AttentionSpec, AttentionLayerParams]):
    """Writes the step's keys/values into the paged cache, then runs ``flash_attn_varlen_func``.

    Args:
        kv_cache_spec: the layer's spec (a kind the backend serves).
        layer_params: its ``AttentionLayerParams``.
        varlen_funcs: version -> function to call instead of importing flash-attn
            (2: a ``FlashAttn2VarlenFunc``, 4: a ``FlashAttn4VarlenFunc``). Given
            (tests of attnkit's side of the contract run a pure-torch model of the
            documented call this way), the impl also runs on CPU tensors.

    flash-attn is imported on the first ``forward`` of a version (the metadata says
    which); a missing package raises ``ImportError`` with the pip command.

    Raises at construction:
        ValueError: unfit ``layer_params``, or features the backend lacks.
    """

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_params: AttentionLayerParams,
        *,
        varlen_funcs: Mapping[int, VarlenFunc] | None = None,
    ) -> None:
        super().__init__(kv_cache_spec, layer_params)
        who = type(self).__name__
        params, spec = layer_params, kv_cache_spec
        problems = attention_params_problems(
            spec, params, backend="flash_attn", supported_features=_FEATURES
        )
        if problems:
            raise ValueError(f"{who}: " + "; ".join(problems))
        self.kind = spec.kind
        rules = rules_for(spec)
        self._has_cache = rules.has_cache
        self._encoder_keys = rules.writes == "encoder"  # cross attention
        self.num_heads = params.num_heads
        self.scale: float = params.scale if params.scale is not None else spec.head_size**-0.5
        self.softcap: float = params.logits_soft_cap or 0.0  # 0.0: off, in both versions
        self.features = params.features
        self._alibi = (
            torch.tensor(params.alibi_slopes, dtype=torch.float32)
            if params.alibi_slopes is not None
            else None
        )
        # The layer's sink logits as given; flash-attn 4 gets them in a dtype its release
        # accepts (``_versions.sink_dtypes``), converted once per dtype and device.
        self._sinks_given = params.sinks
        self._sinks: torch.Tensor | None = None
        funcs = varlen_funcs or {}
        # By the documented contract, key 2 holds a flash-attn 2 function and key 4 a
        # flash-attn 4 one; a mapping cannot say so per key, hence the casts.
        self._fa2 = cast("FlashAttn2VarlenFunc | None", funcs.get(2))
        self._fa4 = cast("FlashAttn4VarlenFunc | None", funcs.get(4))
        self._stand_in = varlen_funcs is not None

    def _check_version_features(self, version: FlashAttnVersion) -> None:
        missing = {2: AttentionFeature.ATTENTION_SINKS, 4: AttentionFeature.ALIBI}[version]
        if missing in self.features:
            raise ValueError(
                f"{type(self).__name__}: the layer needs {missing.value}, which "
                f"flash-attn {version} does not support"
            )

    def _fa2_kernel(self) -> FlashAttn2VarlenFunc:
        self._check_version_features(2)
        if self._fa2 is None:
            self._fa2 = _import_varlen_func(2)
        return self._fa2

    def _fa4_kernel(self) -> FlashAttn4VarlenFunc:
        self._check_version_features(4)
        if self._fa4 is None:
            self._fa4 = _import_varlen_func(4)
        return self._fa4

    def _layer_tensors(
        self, device: torch.device, release: str | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """ALiBi slopes and sink logits on ``device`` (moved once, on first use).

        Sinks keep their dtype when flash-attn 4 ``release`` accepts it (float16,
        bfloat16 or float32 from 4.0.0b30), else become bfloat16 (the only dtype before).
        """
        if self._alibi is not None and self._alibi.device != device:
            self._alibi = self._alibi.to(device)
        given = self._sinks_given
        if given is None:
            return self._alibi, None
        accepted = _versions.sink_dtypes(release)
        dtype = given.dtype if given.dtype in accepted else torch.bfloat16
        if self._sinks is None or self._sinks.dtype != dtype or self._sinks.device != device:
            self._sinks = given.to(device=device, dtype=dtype)
        return self._alibi, self._sinks

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        who = f"{type(self).__name__}.forward ({self.kind.value})"
        md = attn_metadata
        if not self._stand_in and query.device.type != "cuda":
            raise ValueError(f"{who}: flash-attn runs on CUDA tensors, got query on {query.device}")
        # The version's features are checked (and flash-attn imported) before any cache write.
        fa2 = self._fa2_kernel() if md.version == 2 else None
        fa4 = self._fa4_kernel() if md.version == 4 else None
        n = md.num_actual_tokens
        encoder_only = not self._has_cache
        if len(kv_cache) != (0 if encoder_only else 1):
            raise ValueError(
                f"{who}: kv_cache must hold {0 if encoder_only else 1} tensor(s), "
                f"got {len(kv_cache)}"
            )
        if (key is None) != (value is None) or (
            key is None and not self._encoder_keys
        ):
            raise ValueError(f"{who}: key and value must both be given")

        if encoder_only:
            assert key is not None  # checked above
            assert value is not None
            k, v = key[:n], value[:n]
        else:
            cache = kv_cache[0]
            if key is not None and value is not None:
                # Cross attention writes the E encoder rows given; the others the step's T.
                rows = key.shape[0] if self._encoder_keys else n
                _write_kv(key[:rows], value[:rows], cache, md.slot_mapping[:rows])
            k, v = cache[:, 0], cache[:, 1]
        if n == 0 or md.num_reqs == 0:
            return output
        if fa4 is not None and md.block_table is not None and md.seqused_k is not None:
            # Rows past seq_len in each last page must be finite (``_zero_page_tails``).
            _zero_page_tails(kv_cache[0], md.block_table, md.seqused_k)

        q = query[:n]
        alibi_slopes, learnable_sink = self._layer_tensors(q.device, md.release)
        if fa2 is not None:
            out = fa2(
                q,
                k,
                v,
                cu_seqlens_q=md.cu_seqlens_q,
                cu_seqlens_k=md.cu_seqlens_k,
                max_seqlen_q=md.max_seqlen_q,
                max_seqlen_k=md.max_seqlen_k,
                softmax_scale=self.scale,
                causal=md.causal,
                window_size=md.window_size,
                softcap=self.softcap,
                alibi_slopes=alibi_slopes,
                block_table=md.block_table,
            )
        else:
            assert fa4 is not None  # md.version is 2 or 4
            result = fa4(
                q,
                k,
                v,
                cu_seqlens_q=md.cu_seqlens_q,
                cu_seqlens_k=md.cu_seqlens_k,
                max_seqlen_q=md.max_seqlen_q,
                max_seqlen_k=md.max_seqlen_k,
                seqused_k=md.seqused_k,
                page_table=md.block_table,
                softmax_scale=self.scale,
                causal=md.causal,
                window_size=md.window_size,
                learnable_sink=learnable_sink,
                softcap=self.softcap,
            )
            out = result[0] if isinstance(result, tuple) else result
        # Neither version's varlen entry point takes an output buffer.
        output[:n].copy_(out)
        return output


class FlashAttentionBackend(AttentionBackend):
    """flash-attn 2 or 4 over the paged cache: full, sliding-window, encoder-only, cross.

    Declarations are the union over both versions; what one version lacks (and
    "not installed") is reported by ``extra_*_reasons`` from ``_versions``.
    """

    name = "flash_attn"
    description = (
        "flash-attn 2/4 varlen kernels: full, sliding-window, encoder-only and cross "
        "attention (CUDA, fp16/bf16)"
    )
    supported_devices = frozenset({"cuda"})
    min_compute_capability = (8, 0)
    supported_dtypes = frozenset({torch.float16, torch.bfloat16})
    supported_kv_cache_dtypes = frozenset({"auto"})
    supported_head_sizes = (SizeRange(8, 256),)
    supported_block_sizes = None  # flash-attn 2's multiple-of-256 rule is per version
    supported_features = _FEATURES
    options_type = FlashAttentionOptions
    # The forward kernels use no atomics. Batch-invariant with flash-attn 2 only: at that
    # level the builder keeps it off its batch-dependent GQA decode path (one kernel,
    # no split-KV; _fa2_max_seqlen_q), an argument from its source (2.8.3
    # mha_varlen_fwd) not yet run through check_invariance on a GPU. flash-attn 4 is
    # refused at batch_invariant (extra_not_supported_reasons): attnkit pins none of
    # its kernel heuristics.
    deterministic = True
    determinism: ClassVar[Mapping[KVCacheSpecKind, Determinism]] = {
        KVCacheSpecKind.FULL_ATTENTION: Determinism.BATCH_INVARIANT,
        KVCacheSpecKind.SLIDING_WINDOW: Determinism.BATCH_INVARIANT,
    }
    builders = bind_each(
        (FullAttentionSpec, SlidingWindowSpec, EncoderOnlyAttentionSpec, CrossAttentionSpec),
        FlashAttentionMetadataBuilder,
        FlashAttentionImpl,
    )

    @classmethod
    @override
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        """Nothing installed; a CUDA device asked for where there is none."""
        reasons: list[str] = []
        if not _versions.installed_releases():
            reasons.append(_versions.NOT_INSTALLED_REASON)
        if device.type == "cuda" and not _versions.cuda_available():
            reasons.append(_versions.NO_CUDA_REASON)
        return reasons

    @classmethod
    @override
    def device_reasons(cls, device: torch.device) -> list[str]:
        """No CUDA here (``NO_CUDA_REASON``, as ``extra_environment_reasons`` says), or
        the shared check (an index past the device count).

        Asks ``_versions.cuda_available`` first, the probe this backend's other reasons
        use, so a stand-in GPU (tests) answers consistently.
        """
        if device.type != "cuda":
            return []
        if not _versions.cuda_available():
            return [_versions.NO_CUDA_REASON]
        if not torch.cuda.is_available():
            return []  # a stand-in for a GPU (tests): nothing more to ask torch
        return super().device_reasons(device)

    @classmethod
    @override
    def extra_not_supported_reasons(cls, request: BackendRequest) -> list[str]:
        """What the chosen flash-attn version cannot do for this request."""
        spec = request.spec
        if not isinstance(spec, AttentionSpec):
            return []
        choice = _versions.choose_version(
            _options(request.config).version,
            request.capability if request.device.type == "cuda" else None,
            installed=_versions.installed_releases(),
            spec=spec,
            features=request.features,
        )
        reasons = list(choice.reasons)
        wanted = request.config.determinism if request.config is not None else Determinism.NONE
        if choice.version == 4 and wanted >= Determinism.BATCH_INVARIANT:
            reasons.append(
                f"determinism={wanted.label} is kept with flash-attn 2 only (attnkit pins "
                "none of flash-attn 4's kernel choices); set "
                'backend_options={"flash_attn": {"version": 2}}'
            )
        return reasons
