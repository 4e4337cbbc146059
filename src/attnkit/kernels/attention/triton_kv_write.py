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
  Either the dtype of ``key``/``value`` or ``torch.float8_e4m3fn``.
* ``k_scale``, ``v_scale``: one-element float32 tensors (shape ``[]`` or ``[1]``),
  required with an fp8 cache, optional otherwise. When given, the cache stores
  ``key / k_scale`` (float32 division, then for fp8 a clamp to the finite e4m3 range
  ``[-448, 448]`` and a round-to-nearest-even cast); when absent, ``key`` unchanged.
* ``slot_mapping``: int64 ``[T]`` with unit stride; token ``t`` goes to physical slot
  ``slot_mapping[t] = block * BS + offset``. ``-1`` marks a padding token whose K/V is
  dropped.

One program copies one token (all its heads at once): the slot is read once per token
and the ``[Hkv, D]`` rows are contiguous in both the source row and the cache slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.kernels._checks import FLOAT_DTYPES, check_device, describe, require_tensor
from attnkit.kernels._triton.fp8 import f32_to_e4m3_bits, saturate_e4m3
from attnkit.kernels._triton.interpret import INTERPRETED
from attnkit.kernels.attention.contract import FP8_DTYPE, check_scale_tensor

__all__ = ["write_kv_cache"]

# Dtypes of key/value, and of the cache when it is not fp8.
_SUPPORTED_DTYPES = FLOAT_DTYPES
_FP8_DTYPE = FP8_DTYPE


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    USE_K_SCALE: tl.constexpr,
    USE_V_SCALE: tl.constexpr,
    TO_FP8: tl.constexpr,
    FP8_BITS: tl.constexpr,
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
        if USE_K_SCALE:
            k = tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr))
        if USE_V_SCALE:
            v = tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr))
        if TO_FP8:
            k = saturate_e4m3(k.to(tl.float32))
            v = saturate_e4m3(v.to(tl.float32))
        if FP8_BITS:
            k = f32_to_e4m3_bits(k)
            v = f32_to_e4m3_bits(v)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


# Under the Triton interpreter the fp8 cache is written through a uint8 view with the
# exact integer encoder f32_to_e4m3_bits (bit-identical to torch's cast, which the tests
# check; see attnkit.kernels._triton.fp8); compiled kernels store through the fp8
# pointer with Triton's native round-to-nearest-even conversion (hardware cvt on
# sm_89+). Under the interpreter a float32 -> bfloat16 cast truncates, so a non-unit
# scale with a bfloat16 cache can differ from torch by one bf16 ulp there; with the
# intended scale of 1 the division is exact and nothing is rounded.


def _check_kv_cache(kv_cache: object) -> torch.Tensor:
    kv_cache = require_tensor("kv_cache", kv_cache, "a torch.Tensor [NB, 2, BS, Hkv, D]")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache: expected shape [NB, 2, BS, Hkv, D], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in (*_SUPPORTED_DTYPES, _FP8_DTYPE):
        raise ValueError(
            f"kv_cache: expected dtype in {(*_SUPPORTED_DTYPES, _FP8_DTYPE)}, got {kv_cache.dtype}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError(
            "kv_cache: expected a contiguous tensor, got a non-contiguous one "
            f"({describe(kv_cache)}, strides {tuple(kv_cache.stride())})"
        )
    # A zero block size, head count or head size leaves nothing to write (and no valid
    # Triton tile shape); zero blocks would silently drop every token.
    if 0 in kv_cache.shape:
        raise ValueError(
            f"kv_cache: expected NB, BS, Hkv and D >= 1 in [NB, 2, BS, Hkv, D], "
            f"got {describe(kv_cache)}"
        )
    return kv_cache


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping``, in place.

    Tokens whose slot is ``-1`` (or outside ``[0, NB * BS)``) are skipped. Slots must be
    distinct among real tokens; the launcher never reads slot values back to the host.

    With a ``torch.float8_e4m3fn`` cache, ``k_scale`` and ``v_scale`` (one-element
    float32 tensors, read on the device) are required and the cache stores
    ``clamp(key / k_scale, -448, 448)`` rounded to e4m3 (likewise for values); ``key``
    and ``value`` are then float32, float16 or bfloat16. Otherwise ``key``/``value`` have
    the cache dtype and the scales are optional: when given, the cache stores
    ``key / k_scale`` cast back to the cache dtype (meant for scales of 1).
    """
    kv_cache = _check_kv_cache(kv_cache)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    is_fp8 = kv_cache.dtype == _FP8_DTYPE
    device = kv_cache.device

    key = require_tensor("key", key, "a torch.Tensor [T, Hkv, D]")
    value = require_tensor("value", value, "a torch.Tensor [T, Hkv, D]")
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name}: expected shape [T, {num_kv_heads}, {head_dim}] to match kv_cache, "
                f"got {tuple(t.shape)}"
            )
        if is_fp8 and t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(
                f"{name}: expected dtype in {_SUPPORTED_DTYPES} for a {_FP8_DTYPE} kv_cache, "
                f"got {t.dtype}"
            )
        if not is_fp8 and t.dtype != kv_cache.dtype:
            raise ValueError(
                f"{name}: expected dtype {kv_cache.dtype} (the kv_cache dtype), got {t.dtype}"
            )
        check_device(name, t, device, "kv_cache")
    if value.dtype != key.dtype:
        raise ValueError(f"value: expected dtype {key.dtype} (the key dtype), got {value.dtype}")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"value: expected {key.shape[0]} tokens (as key), got {value.shape[0]}")
    num_tokens = key.shape[0]
    slot_mapping = require_tensor("slot_mapping", slot_mapping, "an int64 torch.Tensor [T]")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping: expected dtype torch.int64, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping: expected shape [{num_tokens}] (one slot per token), "
            f"got {tuple(slot_mapping.shape)}"
        )
    check_device("slot_mapping", slot_mapping, device, "kv_cache")
    # The kernel reads slot_mapping[t] at offset t: a strided view would be misread.
    if num_tokens > 1 and slot_mapping.stride(0) != 1:
        raise ValueError(
            f"slot_mapping: expected unit stride, got stride {slot_mapping.stride(0)} "
            f"({describe(slot_mapping)})"
        )
    if k_scale is not None:
        check_scale_tensor("k_scale", k_scale, device, "kv_cache")
    if v_scale is not None:
        check_scale_tensor("v_scale", v_scale, device, "kv_cache")
    if is_fp8 and (k_scale is None or v_scale is None):
        missing = "k_scale" if k_scale is None else "v_scale"
        raise ValueError(
            f"{missing}: expected a one-element torch.float32 tensor with a "
            f"{_FP8_DTYPE} kv_cache, got None"
        )
    if num_tokens == 0:
        return

    fp8_bits = is_fp8 and INTERPRETED
    _write_kv_cache_kernel[(num_tokens,)](
        key_ptr=key,
        value_ptr=value,
        # A uint8 view shares the storage (no copy); see the note on INTERPRETED.
        cache_ptr=kv_cache.view(torch.uint8) if fp8_bits else kv_cache,
        slot_mapping_ptr=slot_mapping,
        k_scale_ptr=k_scale,
        v_scale_ptr=v_scale,
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
        USE_K_SCALE=k_scale is not None,
        USE_V_SCALE=v_scale is not None,
        TO_FP8=is_fp8,
        FP8_BITS=fp8_bits,
        # Explicit, not Triton's default: Triton 3.9 warns when the option is left unset
        # (its default flips in 3.10), and the test suite turns warnings into errors.
        enable_fp_fusion=True,
    )
