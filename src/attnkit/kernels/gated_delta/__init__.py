"""Gated DeltaNet (the gated delta rule) with per-request states in a cache.

``contract`` (the checks both implementations share), ``reference`` (pure torch, with
the token-by-token definition), ``triton`` (the launchers
``chunk_gated_delta_rule_varlen``, ``fused_recurrent_gated_delta_rule_update`` and the
design notes) and ``triton_kernels`` (their ``@triton.jit`` kernels).
"""
