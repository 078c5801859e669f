#!/usr/bin/env bash
# The device check, in one call of at most ~9 minutes on a fresh, offline GPU machine:
#   bash bench/gpu_check.sh            # on the device: $OUT (or ./gpu-check) gets the files below
#   bash bench/gpu_check.sh --dry-run  # anywhere: collect the cuda tests, run the figures tiny on the CPU
# Nothing is installed: tiermem runs from this tree (PYTHONPATH), with the machine's own torch,
# pytest, psutil, xxhash and filelock (pip install --no-index --no-deps --no-build-isolation -e .
# would do as well, offline). Files: env.txt (machine, versions), tests.txt (the cuda-marked
# tests and the suite's policy-equivalence tests, on the GPU), bench.txt and gpu_check.json (copy GB/s against the pinned peak, CPU Adam, the ~300M
# step: plain vs ZeroOffload vs ZeroOffload+overlap_step; ratios last). Exits non-zero when the
# environment, a test or a benchmark part fails. Record the figures, dated, in bench/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # cuBLAS bit-identical across streams
dry=""; [ "${1:-}" = "--dry-run" ] && dry="--dry-run"
status=0

{ date -u; "$py" -c "import sys, torch, tiermem; print(sys.version.split()[0], 'torch', torch.__version__,
  'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'tiermem from', tiermem.__file__)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nproc; free -g | head -2; } >"$out/env.txt" 2>&1 || { echo "environment check failed"; status=1; }
cat "$out/env.txt"
if [ -z "$dry" ] && ! "$py" -c "import torch; assert torch.cuda.is_available()"; then
    echo "no CUDA device here: run with --dry-run"; exit 1
fi

if [ -n "$dry" ]; then  # no device: the cuda tests must at least import and collect
    timeout 120 "$py" -m pytest -q -m cuda --collect-only -p no:cacheprovider tests/ >"$out/tests.txt" 2>&1
else
    timeout 210 "$py" -m pytest -q -m cuda -p no:cacheprovider --timeout=150 tests/ >"$out/tests.txt" 2>&1
fi
rc=$?; tail -15 "$out/tests.txt"; [ $rc -eq 0 ] || { echo "cuda tests: exit $rc"; status=1; }
# the suite's policy-equivalence tests train on the default device, the GPU here
equiv="tests/test_param_offload.py::test_weights_off_device_give_identical_numbers
  tests/test_nvme_state.py::test_state_on_nvme_gives_identical_numbers
  tests/test_nvme_grads.py::test_grads_on_nvme_give_identical_numbers
  tests/test_activations.py::test_offload_never_changes_the_numbers"
if [ -n "$dry" ]; then
    timeout 60 "$py" -m pytest -q --collect-only -p no:cacheprovider $equiv >>"$out/tests.txt" 2>&1
else
    timeout 90 "$py" -m pytest -q -p no:cacheprovider --timeout=80 $equiv >>"$out/tests.txt" 2>&1
fi
rc=$?; tail -3 "$out/tests.txt"; [ $rc -eq 0 ] || { echo "equivalence tests on the GPU: exit $rc"; status=1; }

timeout 200 "$py" bench/gpu_check.py --out "$out" $dry >"$out/bench.txt" 2>&1
rc=$?; cat "$out/bench.txt" | tail -40; [ $rc -eq 0 ] || { echo "benchmarks: exit $rc"; status=1; }
# the split optimizer's real GPU gain (ZeroOffload(device_fraction=f), f in 0, 0.25, 0.5, 1)
if [ -n "$dry" ]; then split="--device cpu --n-layer 2 --n-embd 64 --seq-len 32 --fractions 0,1 --steps 1 --warmup 1"
else split="--device cuda --steps 4"; fi
timeout 90 "$py" bench/split_step.py $split >"$out/split_step.txt" 2>&1
rc=$?; tail -8 "$out/split_step.txt"; [ $rc -eq 0 ] || { echo "split step: exit $rc"; status=1; }
echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED); files in $out"
exit $status
