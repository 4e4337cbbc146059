"""The kernel limits ``triton_mla`` declares (head and block sizes, features) and the
paged-attention head sizes its impl checks for the up-projected prefill."""

from __future__ import annotations

from ...capabilities import AttentionFeature, SizeRange, SizeRule

# What the launchers accept; kept here as literals because reading them from the kernel
# module would import triton. The test suite checks they still agree.
# Head size: the latent width D = R + rope, up to the launcher's MAX_LATENT_DIM (the
# kernel pads R and rope separately, to at least 16 each, so small widths work too).
_HEAD_SIZES: SizeRule = (SizeRange(16, 1024),)
_BLOCK_SIZES: SizeRule = (16, 32, 64, 128)
# Soft-cap, ALiBi and sink logits are not part of MLA models, and forward() has no way
# to hand a log-sum-exp back (return_lse). The projection is served (both forms).
_FEATURES: frozenset[AttentionFeature] = frozenset(
    {AttentionFeature.MLA_PROJECTION, AttentionFeature.SPARSE_ATTENTION}
)
# What the paged-attention kernel (the up-projected prefill) accepts; literals for the
# same reason as above, checked against the kernel module by the tests.
_PAGED_MIN_HEAD_DIM, _PAGED_MAX_HEAD_DIM = 16, 256
