"""Mamba2's selective state space (SSD) with per-request states in a cache.

``contract`` (the checks both implementations share), ``reference`` (pure torch, with
the token-by-token definition), ``triton`` (the launchers ``ssd_chunked_varlen``,
``ssd_chunk_offsets``, ``selective_state_update`` and the design notes) and
``triton_kernels`` (their ``@triton.jit`` kernels).
"""
