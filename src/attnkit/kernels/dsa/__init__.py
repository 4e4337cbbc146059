"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): the indexer over a paged fp8 index-key
cache, the top-k selection, and sparse MLA over the latent cache.

``contract`` (the argument rules and the index-row format), ``reference`` (the torch
oracle of each op: ``write_index_cache``, ``indexer_logits``, ``topk_select``,
``sparse_mla_attention``) and ``triton`` (a Triton kernel for each, the same results:
bytes, slots and order equal, scores and outputs within rounding).
"""
