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
* ``k_scale``, ``v_scale``: one-element float32 tensors (shape ``[]`` or ``[1]``), or
  float32 ``[Hkv]`` (one per K/V head, fp8 caches), required with an fp8 cache,
  optional otherwise. When given, the cache stores ``key / k_scale`` (float32 division,
  then for fp8 a clamp to the finite e4m3 range ``[-448, 448]`` and a
  round-to-nearest-even cast); when absent, ``key`` unchanged.
* ``kv_scales``: float32 ``[NB, 2, BS, Hkv]``, contiguous, for an fp8 e4m3 or int8 cache
  with per-token-head scales (the op contract's rule): each (token, head) vector is
  stored as ``x / s`` with ``s = amax(|x|) / QMAX`` written here (int8: rounded to
  nearest, ties to even).
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
from attnkit.kernels.attention.contract import (
    DYNAMIC_QMAX,
    FP8_DTYPE,
    check_head_scale,
    check_kv_scales_cache,
    check_scale_tensor,
)

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
    scales_ptr,
    num_slots,
    stride_ks,
    stride_vs,
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
    stride_sb,
    stride_skv,
    stride_ss,
    stride_sh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_K_SCALE: tl.constexpr,
    USE_V_SCALE: tl.constexpr,
    TO_FP8: tl.constexpr,
    FP8_BITS: tl.constexpr,
    QMAX: tl.constexpr,
    TO_INT8: tl.constexpr,
):
    # tl.arange needs power-of-two extents; the launcher pads and the masks below
    # keep the padding lanes from touching memory.
    tl.static_assert(HEADS_PAD >= NUM_KV_HEADS)
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM)
    # Per-token-head scales (QMAX > 0) replace the static ones; int8 needs them.
    tl.static_assert(QMAX == 0 or not (USE_K_SCALE or USE_V_SCALE))
    tl.static_assert(not TO_INT8 or QMAX > 0)

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
        head_valid = heads < NUM_KV_HEADS
        if USE_K_SCALE:
            # One scale per K/V head (stride 1) or one for the tensor (stride 0).
            ks = tl.load(k_scale_ptr + heads * stride_ks, mask=head_valid, other=1.0)
            k = tl.math.div_rn(k.to(tl.float32), ks[:, None])
        if USE_V_SCALE:
            vs = tl.load(v_scale_ptr + heads * stride_vs, mask=head_valid, other=1.0)
            v = tl.math.div_rn(v.to(tl.float32), vs[:, None])
        if QMAX > 0:
            # Per-token-head: s = amax(|x|) / QMAX per head (1 for a zero vector),
            # written beside the cache, and x / s stored.
            k = tl.where(mask, k.to(tl.float32), 0.0)
            v = tl.where(mask, v.to(tl.float32), 0.0)
            k_amax = tl.max(tl.abs(k), axis=1)
            v_amax = tl.max(tl.abs(v), axis=1)
            k_s = tl.where(k_amax > 0, tl.math.div_rn(k_amax, QMAX), 1.0)
            v_s = tl.where(v_amax > 0, tl.math.div_rn(v_amax, QMAX), 1.0)
            k = tl.math.div_rn(k, k_s[:, None])
            v = tl.math.div_rn(v, v_s[:, None])
            s_dst = scales_ptr + block * stride_sb + offset * stride_ss + heads * stride_sh
            tl.store(s_dst, k_s, mask=head_valid)
            tl.store(s_dst + stride_skv, v_s, mask=head_valid)
        if TO_INT8:
            k = tl.minimum(tl.maximum(k, -QMAX), QMAX)
            v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
            # 1.5 * 2**23 + y rounds y (|y| <= 127) to an integer, ties to even, in
            # float32 arithmetic: torch.round's rule.
            k = (k + 12582912.0) - 12582912.0
            v = (v + 12582912.0) - 12582912.0
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
    if kv_cache.dtype not in (*_SUPPORTED_DTYPES, _FP8_DTYPE, torch.int8):
        raise ValueError(
            f"kv_cache: expected dtype in {(*_SUPPORTED_DTYPES, _FP8_DTYPE, torch.int8)}, "
            f"got {kv_cache.dtype}"
        )
    # Each block contiguous; blocks may sit apart (a page holding the per-token-head
    # scales after the values): the kernels step blocks by stride(0).
    if kv_cache.shape[0] > 0 and not kv_cache[0].is_contiguous():
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
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping``, in place.

    Tokens whose slot is ``-1`` (or outside ``[0, NB * BS)``) are skipped. Slots must be
    distinct among real tokens; the launcher never reads slot values back to the host.

    With a ``torch.float8_e4m3fn`` cache, ``k_scale`` and ``v_scale`` (one-element
    float32 tensors, read on the device) are required and the cache stores
    ``clamp(key / k_scale, -448, 448)`` rounded to e4m3 (likewise for values); ``key``
    and ``value`` are then float32, float16 or bfloat16. Otherwise ``key``/``value`` have
    the cache dtype and the scales are optional: when given, the cache stores
    ``key / k_scale`` cast back to the cache dtype (meant for scales of 1). ``k_scale``
    and ``v_scale`` may be float32 ``[Hkv]``: head ``n`` is divided by its own scale.

    With ``kv_scales`` (float32 ``[NB, 2, BS, Hkv]``, an fp8 e4m3 or int8 cache) the
    scales are computed per token and head and written there; ``k_scale`` and
    ``v_scale`` are then None.
    """
    kv_cache = _check_kv_cache(kv_cache)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    is_fp8 = kv_cache.dtype == _FP8_DTYPE
    device = kv_cache.device
    kv_scales = check_kv_scales_cache(kv_scales, kv_cache)
    quantised = is_fp8 or kv_cache.dtype == torch.int8

    key = require_tensor("key", key, "a torch.Tensor [T, Hkv, D]")
    value = require_tensor("value", value, "a torch.Tensor [T, Hkv, D]")
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name}: expected shape [T, {num_kv_heads}, {head_dim}] to match kv_cache, "
                f"got {tuple(t.shape)}"
            )
        if quantised and t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(
                f"{name}: expected dtype in {_SUPPORTED_DTYPES} for a {kv_cache.dtype} "
                f"kv_cache, got {t.dtype}"
            )
        if not quantised and t.dtype != kv_cache.dtype:
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
    for name, given in (("k_scale", k_scale), ("v_scale", v_scale)):
        if given is None:
            continue
        if kv_scales is not None:
            raise ValueError(
                f"{name}: expected None with kv_scales (the write computes a scale per "
                f"token and head), got {describe(given)}"
            )
        given_obj: object = given  # untyped callers may pass anything
        if (
            not isinstance(given_obj, torch.Tensor)
            or given_obj.dim() != 1
            or given_obj.numel() == 1
        ):
            check_scale_tensor(name, given_obj, device, "kv_cache")
            continue
        if not is_fp8:
            raise ValueError(
                f"{name}: per-head [Hkv] scales need a {_FP8_DTYPE} kv_cache, "
                f"got {kv_cache.dtype}"
            )
        check_head_scale(name, given_obj, num_kv_heads, device)
    if kv_scales is not None and kv_scales.shape[0] > 0 and not kv_scales[0].is_contiguous():
        raise ValueError(f"kv_scales: expected contiguous blocks, got strides {tuple(kv_scales.stride())}")
    if is_fp8 and kv_scales is None and (k_scale is None or v_scale is None):
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
        scales_ptr=kv_scales,
        num_slots=kv_cache.shape[0] * block_size,
        stride_ks=1 if k_scale is not None and k_scale.numel() > 1 else 0,
        stride_vs=1 if v_scale is not None and v_scale.numel() > 1 else 0,
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
        stride_sb=kv_scales.stride(0) if kv_scales is not None else 0,
        stride_skv=kv_scales.stride(1) if kv_scales is not None else 0,
        stride_ss=kv_scales.stride(2) if kv_scales is not None else 0,
        stride_sh=kv_scales.stride(3) if kv_scales is not None else 0,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        USE_K_SCALE=k_scale is not None,
        USE_V_SCALE=v_scale is not None,
        TO_FP8=is_fp8,
        FP8_BITS=fp8_bits,
        QMAX=DYNAMIC_QMAX[kv_cache.dtype] if kv_scales is not None else 0.0,
        TO_INT8=kv_cache.dtype == torch.int8,
        # Explicit, not Triton's default: Triton 3.9 warns when the option is left unset
        # (its default flips in 3.10), and the test suite turns warnings into errors.
        enable_fp_fusion=True,
    )
