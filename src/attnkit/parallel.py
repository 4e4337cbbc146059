"""Decode context parallelism: one request's KV cache sharded across ranks.

``AttentionRuntime(..., context_parallel=ContextParallel.from_process_group(group))``
makes the runtime one rank of a context-parallel group. Every rank runs the same
schedule with the same (replicated) queries, keys and values; the caches of the kinds in
``attnkit.kinds.CONTEXT_SHARDED_KINDS`` hold token ``t`` of a request on rank ``t mod
N`` only, so each rank allocates blocks for its share (``ceil((L - rank) / N)`` of an
``L``-token request), computes the partial attention over it with its log-sum-exp
(``AttentionImpl.forward_partial``), and the partials are combined after **one
all-gather** of ``(output, lse)`` per layer with ``merge_attn_states``. Every other kind
is replicated and runs as on one device.

Why an all-gather: every rank needs the whole merged output (the rest of the model runs
replicated), so with ``S`` bytes of partial state per rank an all-gather moves ``(N - 1)
S`` into each rank in one collective. Reducing instead (an all-reduce of the max lse,
then an all-reduce of the rescaled sums) moves ``2 (N - 1) / N * S`` per rank with a
ring but takes two dependent collectives; at decode sizes (``S`` = tokens x heads x
(head size + 1) x 4 bytes, about 1 MiB for 64 requests x 32 heads x 128) a collective's
latency, not its bytes, dominates, so one collective wins until ``N`` or the step's
token count grows large. An all-to-all would leave each rank a slice of the merged
output and need a second collective to replicate it.

Agreement: every ``begin_step`` first all-gathers a fingerprint of the step (a counter
and a hash of the scheduled and finished requests) and raises
``ContextParallelMismatchError`` on every rank when they differ, instead of running a
step whose collectives would pair different layers. A rank that stops calling makes the
others fail after the process group's timeout (``init_process_group(timeout=...)`` /
``new_group(timeout=...)``).

The communication goes through a small ``Communicator`` protocol; the default is
``torch.distributed`` (gloo on CPU, NCCL on CUDA), with no transport of attnkit's own.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from ._validation import is_int
from .errors import ContextParallelMismatchError, InvalidArgumentError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "Communicator",
    "ContextParallel",
    "ContextParallelMismatchError",
    "TorchDistributedCommunicator",
    "merge_partials",
    "step_fingerprint",
]


@runtime_checkable
class Communicator(Protocol):
    """The collectives a context-parallel runtime needs.

    Attributes:
        rank: this rank, ``0 <= rank < world_size``.
        world_size: ranks in the group.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on every rank), in rank order."""
        ...


class TorchDistributedCommunicator:
    """``Communicator`` over a ``torch.distributed`` process group (None: the world)."""

    def __init__(self, group: ProcessGroup | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgumentError(
                "context_parallel: torch.distributed must be initialised first "
                "(torch.distributed.init_process_group(backend='gloo' or 'nccl', ...)), "
                "got an uninitialised default group"
            )
        self.group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(out, tensor, group=self.group)  # pyright: ignore[reportUnknownMemberType]  # torch leaves its parameters unannotated
        return out


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """What makes an ``AttentionRuntime`` one rank of a decode context-parallel group.

    Attributes:
        communicator: the group's collectives (``from_process_group`` for
            ``torch.distributed``).
    """

    communicator: Communicator

    def __post_init__(self) -> None:
        comm: object = self.communicator
        if not isinstance(comm, Communicator):
            raise InvalidArgumentError(
                f"ContextParallel.communicator must implement Communicator (rank, "
                f"world_size, all_gather), got {type(comm).__name__}"
            )
        rank, world = comm.rank, comm.world_size
        if not (is_int(world) and world >= 1 and is_int(rank) and 0 <= rank < world):
            raise InvalidArgumentError(
                f"ContextParallel: the communicator must have world_size >= 1 and "
                f"0 <= rank < world_size, got rank={rank!r}, world_size={world!r}"
            )

    @classmethod
    def from_process_group(cls, group: ProcessGroup | None = None) -> ContextParallel:
        """The ranks of a ``torch.distributed`` group (None: the default world group)."""
        return cls(TorchDistributedCommunicator(group))

    @property
    def rank(self) -> int:
        return self.communicator.rank

    @property
    def world_size(self) -> int:
        return self.communicator.world_size


def step_fingerprint(
    step: int, scheduled: Sequence[tuple[str, int, int]], finished: Sequence[str]
) -> int:
    """A 63-bit hash of one step's schedule: ``(request id, new tokens, encoder tokens)``
    in order, and the finished ids (sorted: their order does not matter)."""
    text = repr((step, tuple(scheduled), tuple(sorted(finished))))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def merge_partials(
    outputs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    output: torch.Tensor,
    output_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Merge per-rank partial attentions ``outputs[i] [T, H, D]`` with their ``lses[i]
    [T, H]`` into ``output``, folding ``merge_attn_states`` over the ranks (Triton on
    CUDA, torch elsewhere); the merged log-sum-exp ``[T, H]`` into ``output_lse`` when
    given. A row no rank saw stays 0 (its lse -inf)."""
    if len(outputs) != len(lses) or not outputs:
        raise InvalidArgumentError(
            f"merge_partials: outputs and lses must be non-empty and of one length, got "
            f"{len(outputs)} and {len(lses)}"
        )
    if output.device.type == "cuda":
        from .kernels.merge.triton import merge_attn_states
    else:
        from .kernels.merge.reference import merge_attn_states
    if len(outputs) == 1:
        output.copy_(outputs[0])
        if output_lse is not None:
            output_lse.copy_(lses[0])
        return output
    acc = outputs[0].float()
    acc_lse = lses[0].float().clone()
    for out, lse in zip(outputs[1:], lses[1:], strict=True):
        merge_attn_states(acc, acc_lse, out.float(), lse, output=acc, output_lse=acc_lse)
    output.copy_(acc)
    if output_lse is not None:
        output_lse.copy_(acc_lse)
    return output
