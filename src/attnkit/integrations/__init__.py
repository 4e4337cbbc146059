"""attnkit driven by a model framework: an engine loop and framework adapters.

``attnkit.integrations.engine``: ``Engine``, a small continuous-batching loop over an
``AttentionRuntime`` (token-id prompts, a per-step token budget, chunked prefill,
greedy or sampled decoding, preemption when the cache runs out). It needs only
attnkit's runtime and a model callable.

``attnkit.integrations.transformers``: ``attach(model, ...)`` routes a Hugging Face
transformers model's attention through attnkit and makes the model a callable the
engine drives (``pip install 'attnkit[transformers]'``). transformers is imported when
``attach`` runs, never by ``import attnkit``.

This package imports nothing itself, so ``import attnkit.integrations.engine`` stays
light.
"""

from __future__ import annotations
