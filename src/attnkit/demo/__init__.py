"""``attnkit demo``: a tiny model served end to end through ``AttentionRuntime``.

The default model (random weights, fixed seed) has full-attention, sliding-window
attention and Mamba2 layers; ``demo_layout`` shrinks a real model's layout to the
demo's sizes (every kind attnkit serves: chunked-local, MLA, sink, encoder-only and
cross-attention layers, and the state layers). Several requests of different lengths
are prefilled (one long prompt in chunks, under a per-step token budget) and then
decoded greedily; a layout of encoder-only layers encodes whole prompts instead, and
an encoder-decoder layout encodes each request's source before its decoder runs.
After every step the step's outputs are checked against a dense recompute of each
request's whole sequence without any cache, written here by the definitions
(softmax attention under each kind's mask, MLA in its unabsorbed form, the
token-by-token recurrences of the state layers), and the step prints its time, max
abs error and tokens/s.
"""

from __future__ import annotations

from ._context_parallel import run_demo_context_parallel as run_demo_context_parallel
from ._model import DEMO_LAYERS_PER_KIND as DEMO_LAYERS_PER_KIND
from ._model import LAYER_KINDS, MODELS, DemoModel, demo_layout
from ._model import SINKS_SUFFIX as SINKS_SUFFIX
from ._model import DemoMode as DemoMode
from ._report import DemoResult
from ._run import PRIORITIES as PRIORITIES
from ._run import TOLERANCE as TOLERANCE
from ._run import run_demo
from ._sparse import is_sparse, run_sparse_demo

__all__ = [
    "LAYER_KINDS",
    "MODELS",
    "DemoModel",
    "DemoResult",
    "demo_layout",
    "is_sparse",
    "run_demo",
    "run_sparse_demo",
]
