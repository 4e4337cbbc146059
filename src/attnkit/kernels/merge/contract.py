"""The contract of merging two partial attentions by log-sum-exp: the argument checks
the torch oracle (:mod:`attnkit.kernels.merge.reference`) and the Triton launcher
(:mod:`attnkit.kernels.merge.triton`) share."""

from __future__ import annotations

import torch

from attnkit.kernels._checks import describe, require_tensor

__all__ = ["MERGE_DTYPES", "check_merge_inputs"]

MERGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_merge_inputs(
    out_a: object,
    lse_a: object,
    out_b: object,
    lse_b: object,
    output: object,
    output_lse: object,
) -> None:
    """Raise ``ValueError`` unless the arguments of ``merge_attn_states`` agree
    (``TypeError`` for an argument that is not a tensor).

    Shared by the torch reference and the Triton launcher, so both reject the same
    inputs with the same messages. Metadata only: no tensor value is read.
    """
    out_a = require_tensor("out_a", out_a, "a torch.Tensor [T, H, D]")
    out_b = require_tensor("out_b", out_b, "a torch.Tensor [T, H, D]")
    lse_a = require_tensor("lse_a", lse_a, "a torch.float32 tensor [T, H]")
    lse_b = require_tensor("lse_b", lse_b, "a torch.float32 tensor [T, H]")
    if output is not None:
        output = require_tensor("output", output, "a torch.Tensor [T, H, D] or None")
    if output_lse is not None:
        output_lse = require_tensor(
            "output_lse", output_lse, "a torch.float32 tensor [T, H] or None"
        )
    if out_a.dim() != 3:
        raise ValueError(f"out_a: expected shape [T, H, D], got {tuple(out_a.shape)}")
    if out_a.dtype not in MERGE_DTYPES:
        raise ValueError(f"out_a: expected dtype in {MERGE_DTYPES}, got {out_a.dtype}")
    shape, device = tuple(out_a.shape), out_a.device
    if tuple(out_b.shape) != shape:
        raise ValueError(
            f"out_b: expected shape {shape} (the out_a shape), got {tuple(out_b.shape)}"
        )
    if out_b.dtype != out_a.dtype:
        raise ValueError(
            f"out_b: expected dtype {out_a.dtype} (the out_a dtype), got {out_b.dtype}"
        )
    if out_b.device != device:
        raise ValueError(
            f"out_b: expected device {device} (the out_a device), got {describe(out_b)}"
        )
    lse_shape = shape[:2]
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b), ("output_lse", output_lse)):
        if t is None:
            continue
        if tuple(t.shape) != lse_shape:
            raise ValueError(f"{name}: expected shape {lse_shape} ([T, H]), got {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name}: expected dtype torch.float32, got {t.dtype}")
        if t.device != device:
            raise ValueError(
                f"{name}: expected device {device} (the out_a device), got {describe(t)}"
            )
    if output is not None:
        if tuple(output.shape) != shape:
            raise ValueError(
                f"output: expected shape {shape} (the out_a shape), got {tuple(output.shape)}"
            )
        if output.dtype not in MERGE_DTYPES:
            raise ValueError(f"output: expected dtype in {MERGE_DTYPES}, got {output.dtype}")
        if output.device != device:
            raise ValueError(
                f"output: expected device {device} (the out_a device), got {describe(output)}"
            )
