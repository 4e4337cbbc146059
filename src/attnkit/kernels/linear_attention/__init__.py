"""Linear attention with a constant per-head decay (lightning attention), states in a cache.

``contract`` (the checks both implementations share), ``reference`` (pure torch, with the
token-by-token definition) and ``triton``: ``chunk_linear_attention_varlen`` and
``linear_attention_decode`` in both.
"""
