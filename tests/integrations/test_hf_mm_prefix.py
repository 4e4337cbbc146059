"""Gemma 3's image tokens through ``attach``: a tiny random Gemma 3 image-text model
(built from a config, no download) served by attnkit with the requests' image ranges
(``Request.mm_prefix_ranges``) against transformers' eager attention given the same
ranges as ``token_type_ids`` (from which eager Gemma 3 builds its bidirectional image
mask); a control shows eager with the images causal is far from the attnkit run, so the
match is the image mask's, not luck."""

from __future__ import annotations

import pytest
import torch

from attnkit import AttentionConfig
from attnkit.integrations.engine import Engine, EngineResult, SamplingParams

tf = pytest.importorskip("transformers")

from attnkit.integrations.transformers import (  # noqa: E402  (after the importorskip)
    EAGER_TOLERANCE,
    attach,
    check_against_eager,
    tiny_model,
)
from attnkit.integrations.transformers._families import GEMMA3_IMAGE_TOKEN  # noqa: E402

IMG, BOI, EOI = GEMMA3_IMAGE_TOKEN, GEMMA3_IMAGE_TOKEN + 1, GEMMA3_IMAGE_TOKEN + 2


def _prompt(seed: int, images: int) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """Text, then ``images`` times (begin, 5 image tokens, end, text): the prompt and
    the image tokens' ranges (separated by text, as transformers' image blocks are)."""
    g = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(3, 80, (n,), generator=g).tolist()

    tokens = text(3)
    ranges: list[tuple[int, int]] = []
    for _ in range(images):
        tokens.append(BOI)
        ranges.append((len(tokens), len(tokens) + 5))
        tokens += [IMG] * 5
        tokens.append(EOI)
        tokens += text(4)
    return tokens, tuple(ranges)


def _run(backend: str, with_ranges: bool) -> tuple[object, EngineResult, dict[str, tuple[tuple[int, int], ...]]]:
    model = tiny_model("gemma3")
    attached = attach(
        model,
        config=AttentionConfig(backend=backend, max_mm_prefix_ranges=4),
        num_blocks=64,
        block_size=16,
    )
    engine = Engine(attached, max_tokens_per_step=9, keep_logits=True)
    ranges: dict[str, tuple[tuple[int, int], ...]] = {}
    for rid, seed, images in (("a", 1, 2), ("b", 2, 1)):
        prompt, found = _prompt(seed, images)
        ranges[rid] = found
        engine.add_request(
            rid,
            prompt,
            SamplingParams(max_new_tokens=3),
            mm_prefix_ranges=found if with_ranges else (),
        )
    return attached, engine.run(), ranges


@pytest.mark.parametrize("backend", ["reference", "cpu_attn"])
def test_gemma3_image_tokens_match_eager_with_token_type_ids(backend: str) -> None:
    attached, result, ranges = _run(backend, with_ranges=True)
    check = check_against_eager(attached, result, mm_prefix_ranges=ranges)  # type: ignore[arg-type]
    assert check.passed, check
    assert check.max_error < EAGER_TOLERANCE[torch.float32] * max(1.0, check.max_logit)
    # Prompts were chunked (a budget of 9), never inside an image.
    for step in result.steps:
        assert step.num_tokens <= 9
    # Control: eager with the images causal (no token_type_ids) misses the run by far.
    causal = check_against_eager(attached, result)  # type: ignore[arg-type]
    assert causal.max_error > 100 * check.tolerance, causal


def test_gemma3_without_ranges_matches_eager_causal_and_misses_the_image_mask() -> None:
    """The broken variant: serving the same prompts with the ranges ignored matches
    eager's causal mask, and misses eager's image mask (the test above would fail)."""
    attached, result, ranges = _run("reference", with_ranges=False)
    causal = check_against_eager(attached, result)  # type: ignore[arg-type]
    assert causal.passed, causal
    images = check_against_eager(attached, result, mm_prefix_ranges=ranges)  # type: ignore[arg-type]
    assert images.max_error > 100 * images.tolerance, images
