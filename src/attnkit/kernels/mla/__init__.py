"""Multi-head latent attention (MLA) in its absorbed form over a latent paged cache.

``contract`` (the argument rules, on top of the attention contract's scales) and
``triton`` (``mla_attention`` and ``write_mla_latents``; the batch plan and the split-KV
merge are paged attention's, :mod:`attnkit.kernels.attention.triton_plan`). The torch
reference of MLA is paged attention's over the latents (the reference backend).
"""
