"""Merging two partial attentions of the same queries by their log-sum-exps.

``contract`` (the argument checks both implementations share), ``reference`` (pure
torch) and ``triton`` (the Triton kernel and its launcher), both ``merge_attn_states``.
"""
