"""Paged-attention plumbing shared by the Triton attention backends (``triton_attn``,
``triton_mla``): the fp8 capability rule, the SM count the split-KV heuristic fills,
and the fixed-address buffers a CUDA-graph build copies each step into.

Backends do not import each other (``tests/test_layering.py``); what two of them share
lives in a private module of ``attnkit.backends`` like this one. Importing it does not
import triton.
"""

from __future__ import annotations

import dataclasses

import torch

from ..backend import BackendRequest
from ..config import AttentionConfig
from ..metadata import CommonAttentionMetadata
from ..spec import AttentionSpec

__all__ = [
    "FP8_E4M3_MIN_CAPABILITY",
    "GraphBuffers",
    "GraphStep",
    "fp8_e4m3_capability_reasons",
    "num_sms",
]

FP8_E4M3_MIN_CAPABILITY = (8, 9)
"""The first compute capability whose Triton target has the fp8 e4m3 type (Ada)."""


def fp8_e4m3_capability_reasons(request: BackendRequest) -> list[str]:
    """Why an fp8_e4m3 cache cannot run on the request's CUDA device (empty: it can).

    Triton compiles the e4m3 type (``fp8e4nv``) only for sm_89 and newer; sm_80-sm_87
    have ``fp8e4b15`` and ``fp8e5`` only (``triton/backends/nvidia/compiler.py``,
    ``supported_fp8_dtypes``; an ahead-of-time compile for sm_80 fails with "type
    fp8e4nv not supported in this architecture"). A decode path that widens e4m3 bytes
    by hand on sm_80 would cost a bit-manipulation per element on the hottest loop for
    GPUs whose fp8 cache saves memory but not bandwidth-bound time, so the limit is
    declared instead.
    """
    spec = request.spec
    capability = request.capability
    if (
        isinstance(spec, AttentionSpec)
        and spec.kv_cache_dtype in ("fp8_e4m3", "fp8_e4m3_per_token_head")
        and request.device.type == "cuda"
        and capability is not None
        and capability < FP8_E4M3_MIN_CAPABILITY
    ):
        major, minor = FP8_E4M3_MIN_CAPABILITY
        return [
            f"kv_cache_dtype={spec.kv_cache_dtype!r} needs compute capability >= {major}.{minor} "
            f"(Triton has no e4m3 type before sm_89), got {capability[0]}.{capability[1]}"
        ]
    return []


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for any other device."""
    if device.type != "cuda":
        return 1
    # torch declares the properties' class only in CUDA builds, so pyright sees Unknown.
    props = torch.cuda.get_device_properties(device)  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
    return int(props.multi_processor_count)  # pyright: ignore[reportUnknownMemberType, reportUnknownArgumentType]


@dataclasses.dataclass(frozen=True)
class GraphStep:
    """One step copied into the graph buffers: views of them, and the grid bounds."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    tile_offsets: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class GraphBuffers:
    """Fixed-address copies of a step's metadata, sized by the config's engine limits."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    tile_offsets: torch.Tensor
    block_size: int

    @classmethod
    def allocate(
        cls, config: AttentionConfig, block_size: int, device: torch.device
    ) -> GraphBuffers:
        reqs = config.max_num_reqs
        width = -(-config.max_model_len // block_size)
        return cls(
            query_start_loc=torch.zeros(reqs + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(reqs, dtype=torch.int32, device=device),
            block_table=torch.zeros((reqs, width), dtype=torch.int32, device=device),
            slot_mapping=torch.full(
                (config.max_num_batched_tokens,), -1, dtype=torch.int64, device=device
            ),
            tile_offsets=torch.zeros(reqs + 1, dtype=torch.int32, device=device),
            block_size=block_size,
        )

    def load(self, owner: str, cm: CommonAttentionMetadata) -> GraphStep:
        """Copy ``cm`` in (asynchronously) and return the step's views and grid bounds.

        The bounds depend on the batch's shape only, not its contents: ``max_seq_len``
        is the block table's full width in tokens (a replay may need more blocks than
        the captured step had; the kernels read only the blocks each ``seq_len``
        needs), and ``max_query_len`` the token count (a causal request's queries fit
        in its context, so it is capped by ``max_seq_len``).

        Raises:
            RuntimeError: a step larger than the config's ``max_num_reqs`` /
                ``max_num_batched_tokens`` / ``max_model_len``.
        """
        num_reqs, num_tokens = cm.num_reqs, cm.slot_mapping.shape[0]
        width = cm.block_table_tensor.shape[1]
        limits = (
            ("num_reqs", num_reqs, self.seq_lens.shape[0], "max_num_reqs"),
            ("tokens", num_tokens, self.slot_mapping.shape[0], "max_num_batched_tokens"),
            ("block-table width", width, self.block_table.shape[1], "max_model_len"),
        )
        for what, value, capacity, setting in limits:
            if value > capacity:
                raise RuntimeError(
                    f"{owner}: the step's {what} {value} exceeds the CUDA-graph "
                    f"buffers ({capacity}); raise AttentionConfig.{setting}"
                )
        self.query_start_loc[: num_reqs + 1].copy_(cm.query_start_loc, non_blocking=True)
        self.seq_lens[:num_reqs].copy_(cm.seq_lens, non_blocking=True)
        self.block_table[:num_reqs, :width].copy_(cm.block_table_tensor, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(cm.slot_mapping, non_blocking=True)
        max_seq_len = self.block_table.shape[1] * self.block_size
        return GraphStep(
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_table=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens],
            tile_offsets=self.tile_offsets[: num_reqs + 1],
            max_query_len=min(cm.num_actual_tokens, max_seq_len),
            max_seq_len=max_seq_len,
            num_tokens=num_tokens,
        )
