"""CPU cost of the contract's per-step pieces, as ratios to a baseline in the same run.

* ``CommonAttentionMetadata`` validation for B decode requests, against constructing
  the same object with ``validate=False`` (the baseline: the dataclass alone).
* ``select_backend`` (done once per group at start-up, not per step), against the
  baseline of one ``not_supported_reasons`` call.

    python benchmarks/bench_core.py --out bench-results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from attnkit import (
    AttentionConfig,
    BackendRegistry,
    FullAttentionSpec,
    select_backend,
)
from attnkit.backend_api import BackendRequest, CommonAttentionMetadata
from toy_backends import GenericToyBackend


def best_of(fn: Callable[[], object], *, repeat: int = 7, number: int = 200) -> float:
    """Median over ``repeat`` runs of the mean time of ``number`` calls, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return statistics.median(times)


def metadata_case(num_reqs: int) -> dict[str, float]:
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    seq = torch.full((num_reqs,), 100, dtype=torch.int32)
    table = torch.zeros((num_reqs, 8), dtype=torch.int32)
    slots = torch.arange(num_reqs, dtype=torch.int64)

    def make(validate: bool) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq,
            num_reqs=num_reqs, num_actual_tokens=num_reqs, max_query_len=1, max_seq_len=100,
            block_table_tensor=table, slot_mapping=slots, validate=validate,
        )

    baseline = best_of(lambda: make(False))
    validated = best_of(lambda: make(True))
    return {"num_reqs": num_reqs, "baseline_us": baseline * 1e6, "validated_us": validated * 1e6,
            "ratio": validated / baseline}


def selection_case() -> dict[str, float]:
    reg = BackendRegistry(discover_plugins=False)
    reg.register(GenericToyBackend)
    config = AttentionConfig.model_validate({}, context={"registry": reg})
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.float16)
    request = BackendRequest(spec=spec, device=torch.device("cpu"))
    baseline = best_of(lambda: GenericToyBackend.not_supported_reasons(request))
    selected = best_of(lambda: select_backend(spec, config, device="cpu", registry=reg))
    return {"baseline_us": baseline * 1e6, "select_us": selected * 1e6, "ratio": selected / baseline}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args()
    results = {
        "metadata_validation": [metadata_case(b) for b in (1, 64, 256, 1024)],
        "selection": selection_case(),
    }
    print("CommonAttentionMetadata validation (ratio to construction without validation)")
    for row in results["metadata_validation"]:
        print(f"  B={row['num_reqs']:5d}: {row['ratio']:.1f}x")
    sel = results["selection"]
    print(f"select_backend: {sel['ratio']:.1f}x one not_supported_reasons call")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_core.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
