"""Scatter this step's new keys and values into the paged KV cache.

Shapes (fixed letters used throughout ``attnkit.kernels``):

* ``T``   total new tokens in the batch (padding tokens included)
* ``Hkv`` key/value heads
* ``D``   head size
* ``NB``  physical blocks in the cache
* ``BS``  tokens per block

Tensors:

* ``key``, ``value``: ``[T, Hkv, D]``, any strides.
* ``kv_cache``: ``[NB, 2, BS, Hkv, D]``, contiguous; index 0 of dim 1 holds keys, 1 values.
* ``slot_mapping``: int64 ``[T]``; token ``t`` goes to physical slot
  ``slot_mapping[t] = block * BS + offset``. ``-1`` marks a padding token whose K/V is
  dropped.

One program copies one token (all its heads at once): the slot is read once per token
and the ``[Hkv, D]`` rows are contiguous in both the source row and the cache slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_kv_cache"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _write_kv_cache_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_cd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    # tl.arange needs power-of-two extents; the launcher pads and the masks below
    # keep the padding lanes from touching memory.
    tl.static_assert(HEADS_PAD >= NUM_KV_HEADS)
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM)

    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    # -1 is a padding token. Slots past the cache end are dropped as well: the launcher
    # cannot check slot values without a device-to-host sync, and an unchecked slot
    # would be an out-of-bounds write into someone else's memory.
    if (slot >= 0) & (slot < num_slots):
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE

        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, HEAD_DIM_PAD)
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

        k = tl.load(
            key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
            mask=mask,
        )
        v = tl.load(
            value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
            mask=mask,
        )

        dst = (
            cache_ptr
            + block * stride_cb
            + offset * stride_cs
            + heads[:, None] * stride_ch
            + dims[None, :] * stride_cd
        )
        tl.store(dst, k, mask=mask)
        tl.store(dst + stride_ckv, v, mask=mask)


def _check_kv_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache: expected shape [NB, 2, BS, Hkv, D], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"kv_cache: expected dtype in {_SUPPORTED_DTYPES}, got {kv_cache.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache: expected a contiguous tensor, got a non-contiguous one")


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping``, in place.

    Tokens whose slot is ``-1`` (or outside ``[0, NB * BS)``) are skipped. Slots must be
    distinct among real tokens; the launcher never reads slot values back to the host.
    """
    _check_kv_cache(kv_cache)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape

    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name}: expected shape [T, {num_kv_heads}, {head_dim}] to match kv_cache, "
                f"got {tuple(t.shape)}"
            )
        if t.dtype != kv_cache.dtype:
            raise ValueError(
                f"{name}: expected dtype {kv_cache.dtype} (the kv_cache dtype), got {t.dtype}"
            )
        if t.device != kv_cache.device:
            raise ValueError(
                f"{name}: expected device {kv_cache.device} (the kv_cache device), got {t.device}"
            )
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"value: expected {key.shape[0]} tokens (as key), got {value.shape[0]}")
    num_tokens = key.shape[0]
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping: expected dtype torch.int64, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping: expected shape [{num_tokens}] (one slot per token), "
            f"got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.device != kv_cache.device:
        raise ValueError(
            f"slot_mapping: expected device {kv_cache.device} (the kv_cache device), "
            f"got {slot_mapping.device}"
        )
    if num_tokens == 0:
        return

    _write_kv_cache_kernel[(num_tokens,)](
        key_ptr=key,
        value_ptr=value,
        cache_ptr=kv_cache,
        slot_mapping_ptr=slot_mapping,
        num_slots=kv_cache.shape[0] * block_size,
        stride_kt=key.stride(0),
        stride_kh=key.stride(1),
        stride_kd=key.stride(2),
        stride_vt=value.stride(0),
        stride_vh=value.stride(1),
        stride_vd=value.stride(2),
        stride_cb=kv_cache.stride(0),
        stride_ckv=kv_cache.stride(1),
        stride_cs=kv_cache.stride(2),
        stride_ch=kv_cache.stride(3),
        stride_cd=kv_cache.stride(4),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        # Explicit, not Triton's default: Triton 3.9 warns when the option is left unset
        # (its default flips in 3.10), and the test suite turns warnings into errors.
        enable_fp_fusion=True,
    )
