"""The prefill-form FLOP model: what a step's prefill part costs absorbed and
up-projected (``mla_prefill_costs``), and the setting that picks the form
(``TritonMLAOptions.prefill_form``; ``"auto"`` asks the model)."""

from __future__ import annotations

from typing import Literal, NamedTuple

from ...config import BackendOptions

PrefillForm = Literal["auto", "absorbed", "up_projected"]


class TritonMLAOptions(BackendOptions):
    """Settings of ``triton_mla``: ``backend_options={"triton_mla": {...}}``.

    Attributes:
        prefill_form: how layers with ``mla_projection`` run a step's prefill part:
            ``"auto"`` (the form :func:`mla_prefill_costs` finds cheaper),
            ``"absorbed"`` or ``"up_projected"`` (for measuring both on a device; a
            layer whose widths the paged kernel cannot take then raises). Decodes
            always run absorbed; layers without a projection always run absorbed.
    """

    prefill_form: PrefillForm = "auto"


class MLAPrefillCosts(NamedTuple):
    """Multiply-adds per head of a step's prefill part in each form (see
    :func:`mla_prefill_costs`)."""

    absorbed: int
    up_projected: int


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def mla_prefill_costs(
    *,
    pairs: int,
    num_tokens: int,
    context_tokens: int,
    kv_lora_rank: int,
    rope_dim: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
) -> MLAPrefillCosts:
    """FLOPs per head (multiply-adds) of a prefill part in both forms, at the widths the
    kernels execute (each dot padded to a power of two, as their tiles are).

    Args:
        pairs: (query, key) pairs the prefills attend (causal, windowed).
        num_tokens: the prefills' query tokens.
        context_tokens: latent rows the up-projected form gathers and up-projects
            (whole blocks).
        kv_lora_rank, rope_dim, qk_nope_head_dim, v_head_dim: ``R``, ``P``, ``N``,
            ``V``.

    Absorbed: ``q_nope @ W_UK`` and ``o @ W_UV`` per query token (``R * (N + V)``), and
    per pair a score over ``R`` and ``P`` channels plus a value over ``R``.
    Up-projected: ``c @ W_UK`` and ``c @ W_UV`` per context row (``R * (N + V)``), and per
    pair a score and a value each over ``N + P`` channels (the value plane is padded to
    the key width).
    """
    rank, rope = kv_lora_rank, rope_dim
    projection = rank * (qk_nope_head_dim + v_head_dim)
    absorbed_pair = _pow2(rank) + (max(16, _pow2(rope)) if rope else 0) + _pow2(rank)
    up_pair = 2 * _pow2(qk_nope_head_dim + rope)
    return MLAPrefillCosts(
        absorbed=num_tokens * projection + pairs * absorbed_pair,
        up_projected=context_tokens * projection + pairs * up_pair,
    )
