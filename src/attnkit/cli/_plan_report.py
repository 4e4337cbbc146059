"""``attnkit plan``'s text report: the layers table, the groups with their backends and
skipped candidates, the capacity lines, and with tensor or context parallelism what
each rank holds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from ..kinds import rules_for
from ..kv_cache import KVCacheGroup
from ..planner import GroupSplit, ModelPlan, RankPlan, format_bytes
from ..spec import AttentionSpec, KVCacheSpec

_ORACLE = "reference"
"""The built-in pure-torch backend: every kind, correct everywhere, never fast."""


def layer_list(names: Sequence[str]) -> str:
    """Layer names for a group's header: all of them, or the first two and the last."""
    if len(names) <= 4:
        return ", ".join(names)
    return f"{names[0]}, {names[1]}, ..., {names[-1]} ({len(names)} layers)"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _bytes(value: int) -> str:
    shown = format_bytes(value)
    return f"{value} B" if shown.endswith(" B") else f"{value} B ({shown})"


def _pool_lines(
    pool: ModelPlan | RankPlan, memory_bytes: int, num_blocks: int
) -> list[tuple[str, str]]:
    """The memory and capacity lines of a pool with a budget (one device or one rank)."""
    lines = [
        (
            "memory",
            f"{_bytes(memory_bytes)} -> {num_blocks} blocks "
            f"({pool.usable_blocks} usable; block 0 is the null block)",
        )
    ]
    if pool.max_concurrency is None:
        lines.append(("capacity", "unbounded by the cache (the model caches nothing)"))
    else:
        lines.append(("tokens that fit", str(pool.tokens_that_fit)))
        lines.append(
            ("concurrent requests", f"{pool.max_concurrency} of {pool.max_model_len} tokens")
        )
    return lines


def write_plan(out: TextIO, plan: ModelPlan, title: str) -> None:
    """The plan as text: layers, groups with their backends, capacity."""
    out.write(f"{title}\n")
    dtype = str(plan.dtype).removeprefix("torch.") if plan.dtype is not None else None
    if dtype is not None:
        out.write(f"dtype {dtype}\n")
    out.write("\nlayers:\n")
    rows = [("layer", "kind", "state", "window", "chunk", "group", "backend")]
    for layer in plan.layers:
        rows.append(
            (
                layer.name,
                layer.kind,
                layer.mamba_type or "-",
                str(layer.sliding_window or "-"),
                str(layer.attention_chunk_size or "-"),
                str(layer.group),
                plan.groups[layer.group].backend_name or "NONE",
            )
        )
    out.writelines(line + "\n" for line in _table(rows))
    for g in plan.groups:
        # Falling back to the oracle is correct but slow: say so under the table, with
        # the reasons of each candidate tried first that serves the kind.
        group = g.group
        other_kind = f"kind={group.kind.value} not supported"
        refused = [
            r for r in g.rejected if not any(why.startswith(other_kind) for why in r.reasons)
        ]
        if g.backend_name == _ORACLE and refused:
            out.write(
                f"note: group {group.group_id} ({len(group.layer_names)} layer(s), "
                f"{group.kind.value}) runs on {_ORACLE}, the pure-torch oracle (correct, "
                f"not fast), because the faster backends for {group.kind.value} refused:\n"
            )
            out.writelines(f"  {rejection}\n" for rejection in refused)
    out.write(f"\ngroups (unified page {plan.page_size_bytes} B):\n")
    for g in plan.groups:
        group = g.group
        out.write(
            f"\n{layer_list(group.layer_names)}: {group.kind.value} ({type(group.spec).__name__}"
            f"{_images(group.spec)})\n"
        )
        if g.selection is None:
            out.write(
                "  NO BACKEND\n" + "".join(f"    {line}\n" for line in (g.error or "").splitlines())
            )
        else:
            level = g.selection.backend.determinism_for(group.kind).label
            out.write(
                f"  -> {g.selection.backend_name} (chosen by {g.selection.source}; "
                f"determinism: {level})\n"
            )
            for rejection in g.rejected:
                out.write(f"     skipped {rejection}\n")
        if not group.has_cache:
            out.write(f"  group {group.group_id}: no cache\n")
            continue
        spec = group.spec
        size = (
            f"{_block_size(group)}, "
            if isinstance(spec, AttentionSpec)
            else f"state {spec.page_size_bytes} B per layer, "
        )
        per_request = _per_request(g.blocks_per_request, g.kernel_blocks_per_request, group)
        if group.block_owner is not None:
            size += f"block ids of group {group.block_owner} (one table for both), "
            per_request = _shared_per_request(g.kernel_blocks_per_request, group)
        out.write(
            f"  group {group.group_id}: {size}{len(group.layer_names)} layer(s), layout "
            f"{g.layout}, at most {per_request} per request\n"
        )
    out.write(
        f"\ncapacity (max_model_len {plan.max_model_len}, max_num_batched_tokens "
        f"{plan.max_num_batched_tokens}):\n"
    )
    sets = ", ".join(f"{name} {count}" for name, count in sorted(plan.buffers.items()))
    lines = [
        (
            "page",
            f"{plan.page_size_bytes} B in {sum(plan.buffers.values())} layer buffer(s)"
            f" ({sets or 'none'}){_shared(plan.shared_bytes_per_page)} = "
            f"{_bytes(plan.bytes_per_block)} per block",
        ),
        ("KV per token", f"{_bytes(plan.kv_bytes_per_token)} (attention layers)"),
    ]
    lines.extend(_shared_pool_lines(plan))
    for g in plan.groups:
        if g.per_request_cap_bytes is None:
            continue
        bound = _bound(g.group.spec)
        lines.append(
            (
                f"group {g.group.group_id}",
                f"{g.bytes_per_token} B per token up to its {bound}; at most "
                f"{_bytes(g.per_request_cap_bytes)} per request",
            )
        )
    lines.append(("state per request", _bytes(plan.state_bytes_per_request)))
    per_group = ", ".join(_group_blocks(g.group, g.blocks_per_request) for g in plan.groups)
    lines.append(
        (
            "blocks per request",
            f"{plan.blocks_per_request} ({per_group}) = {_bytes(plan.bytes_per_request)}",
        )
    )
    if plan.memory_bytes is None:
        lines.append(("memory", "not given (--gpu-memory or --num-blocks)"))
    elif plan.num_blocks is None:
        lines.append(
            (
                "memory",
                f"{_bytes(plan.memory_bytes)} holds fewer than 2 blocks of the whole model "
                "(see per rank)",
            )
        )
    else:
        lines.extend(_pool_lines(plan, plan.memory_bytes, plan.num_blocks))
    cg = plan.cudagraph()
    lines.append(
        (
            "CUDA graphs",
            f"{cg[0].name} (limited by {cg[1]})"
            if cg is not None
            else "unknown (a group has no backend)",
        )
    )
    if plan.prefix is not None:
        lines.append(("prefix cache", _prefix_line(plan)))
    width = max(len("concurrent requests:"), *(len(label) + 1 for label, _ in lines))
    out.writelines(f"  {(label + ':').ljust(width)} {text}\n" for label, text in lines)
    if plan.per_rank.world_size > 1:
        _write_per_rank(out, plan)


def _shared(shared_bytes_per_page: int) -> str:
    """`` + 128832 B in ...`` on the page line when groups share an owner's block ids."""
    if not shared_bytes_per_page:
        return ""
    return f" + {shared_bytes_per_page} B in the own buffers of groups sharing its ids"


def _group_blocks(group: KVCacheGroup, blocks: int) -> str:
    """``group 0: 2048`` in "blocks per request"; ``group 1: group 0's`` for a group that
    shares its owner's block ids (it holds none of its own)."""
    if group.block_owner is None:
        return f"group {group.group_id}: {blocks}"
    return f"group {group.group_id}: group {group.block_owner}'s"


def _shared_per_request(kernel_blocks: int, group: KVCacheGroup) -> str:
    """A sharing group's per-request figure: its owner's kernel block ids."""
    return f"{kernel_blocks} kernel block(s) (group {group.block_owner}'s)"


def _shared_pool_lines(plan: ModelPlan) -> list[tuple[str, str]]:
    """A pool line per group that shares an owner's block ids (DeepSeek sparse
    attention's index cache): its own buffers, their bytes per block and in the pool."""
    lines: list[tuple[str, str]] = []
    for g in plan.groups:
        group = g.group
        if group.block_owner is None or not group.has_cache:
            continue
        layers = len(group.layer_names)
        per_block = group.blocks_per_page * group.spec.page_size_bytes * layers
        share = per_block / plan.bytes_per_block if plan.bytes_per_block else 0.0
        pool = (
            f"; {_bytes(per_block * plan.num_blocks)} of the pool"
            if plan.num_blocks is not None
            else ""
        )
        lines.append(
            (
                f"group {group.group_id} pool",
                f"{group.kind.value} cache in its own buffers, block ids of group "
                f"{group.block_owner}: {group.spec.page_size_bytes} B per kernel block x "
                f"{layers} layer(s) = {per_block} B of each block ({share:.1%}){pool}",
            )
        )
    return lines


def _prefix_line(plan: ModelPlan) -> str:
    """The minimum cacheable prefix under the plan's state checkpoint policy, and what
    a state checkpoint costs."""
    prefix = plan.prefix
    assert prefix is not None
    if prefix.minimum is None:
        text = f"no prefix is cacheable: {prefix.why_none}"
    else:
        text = f"minimum cacheable prefix {prefix.minimum} tokens"
    if not prefix.state_groups:
        return text
    cost = (
        f"each checkpoint takes {prefix.state_groups} block(s) = "
        f"{_bytes(prefix.checkpoint_bytes)} of the pool (evictable)"
    )
    if prefix.checkpoint_interval is None:
        return (
            f"{text}; with --state-checkpoints step_end: minimum "
            f"{prefix.minimum_with_checkpoints} tokens, {cost}"
        )
    most = plan.max_model_len // prefix.checkpoint_interval
    return (
        f"{text} (state checkpoints {prefix.state_checkpoints} every "
        f"{prefix.checkpoint_interval} tokens: {cost}; a prompt leaves one at each "
        f"prefill chunk end on a boundary, at most {most} in {plan.max_model_len} tokens)"
    )


def _block_size(group: KVCacheGroup) -> str:
    """``block size 16``, or ``block size 16, 66 per page of 1056 tokens`` when a page
    of the pool holds several of the group's kernel blocks."""
    size = f"block size {group.spec.block_size}"
    if group.blocks_per_page == 1:
        return size
    return f"{size}, {group.blocks_per_page} per page of {group.page_tokens} tokens"


def _per_request(pages: int, kernel_blocks: int, group: KVCacheGroup) -> str:
    """``289 block(s)``, or ``16384 kernel block(s) in 249 page(s)`` for a group whose
    page holds several kernel blocks (the pool's blocks are pages)."""
    if group.blocks_per_page == 1:
        return f"{pages} block(s)"
    return f"{kernel_blocks} kernel block(s) in {pages} page(s)"


def _images(spec: KVCacheSpec) -> str:
    """``, bidirectional image ranges`` for a group whose layers take them."""
    return ", bidirectional image ranges" if rules_for(spec).mask(spec).mm_prefix else ""


def _bound(spec: KVCacheSpec) -> str:
    """``window 4096`` / ``chunk 8192``: what bounds a windowed group's cache."""
    return rules_for(spec).bound_label(spec) or "no bound"


def _placement(split: GroupSplit, cp: int) -> str:
    """How context parallelism places the group, after ``; `` (nothing to say at cp 1)."""
    if split.context == "none":
        return "; no cache"
    if cp == 1:
        return ""
    if split.context == "sharded":
        return f"; context sharded (token t on rank t mod {cp})"
    return f"; context replicated on each of the {cp} context-parallel ranks"


def _write_per_rank(out: TextIO, plan: ModelPlan) -> None:
    """What each rank holds with --tensor-parallel / --context-parallel: the split of
    every model group, the rank's groups, and its capacity."""
    rank = plan.per_rank
    tp, cp = rank.tensor_parallel, rank.context_parallel
    out.write(
        f"\nper rank (tensor_parallel {tp} x context_parallel {cp} = {rank.world_size} "
        "ranks; --gpu-memory and --num-blocks are each rank's, the capacity above is the "
        "whole model on one device):\n"
    )
    for split in rank.splits:
        model = plan.groups[split.group_id]
        out.write(f"  {model.describe()}: {split.detail}{_placement(split, cp)}\n")
    out.write("groups on each rank:\n")
    for g in rank.groups:
        group = g.group
        if not group.has_cache:
            out.write(f"  {g.describe()}: no cache\n")
            continue
        spec = group.spec
        if isinstance(spec, AttentionSpec):
            heads = (
                f"latent {spec.head_size}"
                if rules_for(spec).latent
                else f"{spec.num_kv_heads} K/V head(s)"
            )
            size = f"{_block_size(group)}, {heads}, "
        else:
            size = f"state {spec.page_size_bytes} B per layer, "
        per_request = _per_request(g.blocks_per_request, g.kernel_blocks_per_request, group)
        if group.block_owner is not None:
            size += f"block ids of group {group.block_owner}, "
            per_request = _shared_per_request(g.kernel_blocks_per_request, group)
        out.write(
            f"  {g.describe()}: {size}{len(group.layer_names)} layer(s), at most "
            f"{per_request} per request\n"
        )
    sets = ", ".join(f"{name} {count}" for name, count in sorted(rank.buffers.items()))
    lines = [
        (
            "page",
            f"{rank.page_size_bytes} B in {sum(rank.buffers.values())} layer buffer(s)"
            f" ({sets or 'none'}){_shared(rank.shared_bytes_per_page)} = "
            f"{_bytes(rank.bytes_per_block)} per block",
        ),
        (
            "KV per token",
            f"{_bytes(rank.kv_bytes_per_token)} (attention layers, on a rank that holds the token)",
        ),
    ]
    if cp > 1 and any(g.context_sharded for g in rank.groups):
        lines.append(
            (
                "context per rank",
                f"{rank.context_tokens} of {plan.max_model_len} tokens in sharded groups",
            )
        )
    for g in rank.groups:
        if g.per_request_cap_bytes is not None:
            lines.append(
                (
                    f"group {g.group.group_id}",
                    f"{g.bytes_per_token} B per token up to its {_bound(g.group.spec)}; at "
                    f"most {_bytes(g.per_request_cap_bytes)} per request",
                )
            )
    lines.append(("state per request", _bytes(rank.state_bytes_per_request)))
    per_group = ", ".join(_group_blocks(g.group, g.blocks_per_request) for g in rank.groups)
    lines.append(
        (
            "blocks per request",
            f"{rank.blocks_per_request} ({per_group}) = {_bytes(rank.bytes_per_request)}",
        )
    )
    if rank.memory_bytes is None or rank.num_blocks is None:
        lines.append(("memory", "not given (--gpu-memory or --num-blocks)"))
    else:
        lines.extend(_pool_lines(rank, rank.memory_bytes, rank.num_blocks))
        longest = rank.max_context_tokens
        lines.append(
            (
                "max context",
                f"{longest} tokens (one request alone in the pool)"
                if longest is not None
                else "unbounded by the cache (no cached layer grows with the context)",
            )
        )
    width = max(len("concurrent requests:"), *(len(label) + 1 for label, _ in lines))
    out.write("capacity per rank:\n")
    out.writelines(f"  {(label + ':').ljust(width)} {text}\n" for label, text in lines)
