#!/usr/bin/env bash
# One call on a machine with a CUDA device: the GPU tests, then the GPU benchmarks, with their
# output under $OUT (or ./gpu-check). Record the figures and the date in bench/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
python -m pip install -q -e '.[test]' >"$out/install.log" 2>&1 || { echo "install failed"; tail "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -m pytest -q -m cuda tests/ 2>&1 | tee "$out/tests.txt" | tail -5
timeout 240 python bench/step.py --device cuda --steps 10 2>&1 | tee "$out/step.txt" | tail -12
timeout 120 python -m tiermem bench --quick --json "$out/bench.json" 2>&1 | tee "$out/tiermem-bench.txt" | tail -20
timeout 180 python bench/split_step.py --device cuda --steps 6 2>&1 | tee "$out/split_step.txt" | tail -8
