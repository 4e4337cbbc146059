"""Capacity planning: a model's layers -> groups, backends, and what fits in memory.

``plan_model`` answers, for a model (a ``ModelLayout`` from ``layout_from_hf_config``,
or layer specs) on a device, without allocating anything: which backend serves each
layer and why the others were skipped, the groups and the unified page size (the
block sizes the runtime's kernels will run, and how many blocks a page holds), the bytes
a token and a request cost, and how many
blocks, tokens and requests of ``max_model_len`` tokens fit in a memory budget::

    layout = attnkit.layout_from_hf_config("path/to/model")
    plan = plan_model(layout, AttentionConfig(max_model_len=8192), device="cpu",
                      memory_bytes=parse_memory_size("80GiB"))
    plan.groups[0].spec.block_size, plan.num_blocks, plan.max_concurrency

It shares the runtime's code paths: ``kv_cache.unified_groups`` for grouping and
page-size unification, ``select_backend`` with the features and head counts the
runtime asks for (``runtime.group_features``), and ``kv_cache.num_blocks_for_budget``
for the pool. The arithmetic (docs/models.md, "Capacity planning"):

* a block id names one page of ``P`` bytes in every layer buffer of every buffer set
  in use, so a block costs ``bytes_per_block = P * buffers`` and the pool holds
  ``num_blocks = memory // bytes_per_block`` blocks, block 0 (the null block) included;
* a request of up to ``max_model_len`` tokens holds at most
  ``blocks_per_request = sum over cached groups of ceil(kernel blocks /
  blocks_per_page)`` pages, its kernel blocks being ``spec.max_memory_usage_bytes(...) /
  spec.page_size_bytes``: ``ceil(max_model_len / block_size)`` for full attention, the
  window (or chunk) plus one step of ``max_num_batched_tokens`` tokens for windowed
  (chunked) layers, one block (a page) for a state layer;
* ``max_concurrency = (num_blocks - 1) // blocks_per_request``;
  ``tokens_that_fit = (num_blocks - 1) * max_model_len // blocks_per_request`` (the
  context tokens the pool holds at that per-request cost; for a model of full
  attention layers only, ``(num_blocks - 1) * block_size``).

With ``tensor_parallel`` and ``context_parallel`` ranks, ``ModelPlan.per_rank`` repeats
the arithmetic for one rank (docs/parallel.md): each group's
heads or state split over the tensor-parallel ranks (K/V heads replicated when fewer
than the ranks, MLA latents on every rank), the rank's specs grouped and unified as
the runtime does, full and MLA caches sharded token by token over the
context-parallel ranks (every other kind replicated), and the budget taken as each
rank's.

The package: ``_types`` (the plan types and their JSON keys), ``_capacity`` (the
arithmetic above), ``_per_rank`` (the per-rank plan), ``_plan`` (``plan_model``),
``_sizes`` (``parse_memory_size``, ``format_bytes``).
"""

from ._plan import plan_model
from ._sizes import format_bytes, parse_memory_size
from ._types import (
    PER_RANK_JSON_KEYS,
    PLAN_JSON_KEYS,
    ContextPlacement,
    GroupPlan,
    GroupSplit,
    LayerPlan,
    ModelPlan,
    PrefixPlan,
    RankGroupPlan,
    RankPlan,
)

__all__ = [
    "PER_RANK_JSON_KEYS",
    "PLAN_JSON_KEYS",
    "ContextPlacement",
    "GroupPlan",
    "GroupSplit",
    "LayerPlan",
    "ModelPlan",
    "PrefixPlan",
    "RankGroupPlan",
    "RankPlan",
    "format_bytes",
    "parse_memory_size",
    "plan_model",
]
