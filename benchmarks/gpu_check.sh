#!/usr/bin/env bash
# One prepared run of every GPU check: the GPU-marked tests, then the kernel and
# metadata benchmarks. Installs nothing from the network; attnkit is used from src/.
#
#   benchmarks/gpu_check.sh OUT_DIR        (default: bench-results)
#
# Needs python3 with torch (CUDA), triton, numpy, pydantic>=2.7, typing-extensions,
# pytest and hypothesis. If pydantic is missing on the GPU machine, carry wheels in
# .whl/ (pip download --no-deps --only-binary=:all: pydantic pydantic-core
# annotated-types typing-inspection) and this script installs them from there.
# Budget: under 8 minutes on an H100/H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench-results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

if ! python3 -c "import pydantic" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/attnkit-site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/attnkit-site"
  else
    echo "pydantic is missing and no wheels were carried in .whl/" >&2
    exit 1
  fi
fi

python3 - <<'PY' | tee "$OUT/env.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
# What the flash_attn backend detects (distribution metadata; imports nothing).
from attnkit.backends.flash_attn import _versions
found = _versions.installed_releases()
print("flash-attn", ", ".join(f"{v}: {r}" for v, r in sorted(found.items())) or "not installed")
PY

status=0
# The GPU-marked tests (each skips with its reason where flash-attn is missing).
# pytest-timeout is optional on the GPU machine: use it only when it is there.
TIMEOUT_ARGS=()
python3 -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARGS=(--timeout=120)
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider "${TIMEOUT_ARGS[@]}" tests 2>&1 | tee "$OUT/gpu_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 300 python3 benchmarks/bench_kernels.py --out "$OUT" 2>&1 | tee "$OUT/bench_kernels.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 60 python3 benchmarks/bench_metadata.py --out "$OUT" 2>&1 | tee "$OUT/bench_metadata.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# Decode context parallelism over NCCL: runs only with >= 2 GPUs (prints why otherwise).
timeout 120 python3 benchmarks/bench_cp.py --backend nccl --quick --out "$OUT" 2>&1 \
  | tee "$OUT/bench_cp.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# Ahead-of-time compile report (registers, spills, shared memory, tensor-core ops) of
# the default variant set for sm_80/sm_90/sm_100; it fails on a compile error, a spill,
# shared memory over the limit or a missing MMA. The full set (every declared
# combination) needs no GPU: nox -s compile -- --full.
timeout 300 python3 benchmarks/compile_report.py --jobs 8 --out "$OUT/compile" 2>&1 \
  | tee "$OUT/compile_report.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
