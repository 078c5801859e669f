#!/usr/bin/env bash
# The device check, in one call of at most ~9.5 minutes on a fresh, offline GPU machine:
#   bash bench/gpu_check.sh            # on the device: $OUT (or ./gpu-check) gets the files below
#   bash bench/gpu_check.sh --dry-run  # anywhere: collect the tests, run every figure tiny on the CPU
# Nothing is installed: tiermem runs from this tree (PYTHONPATH), with the machine's own torch,
# pytest (+ pytest-timeout), psutil, xxhash and filelock (pip install --no-index --no-deps
# --no-build-isolation -e . would do as well, offline). Every part runs in a process of its own
# under its own `timeout` (PARTS below: the worst case, every part timing out, stays under 570 s,
# checked at the start), so a part that fails or hangs leaves the others' figures. Files in $OUT:
#   env.txt        machine, driver, versions
#   tests.txt      the cuda-marked tests, then the suite's policy-equivalence tests, on the GPU
#   bench.txt      each figure part's output, then the ratios (last)
#   figures.jsonl  one line per figure part: its figures or its error
#   gpu_check.json every figure merged, the machine's facts, each part's state, the ratios
#   split_step.txt bench/split_step.py: ZeroOffload(device_fraction=f), one model per process
# Exits non-zero when the environment, a test or a part fails. Record the figures, dated, in
# bench/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
rm -f "$out/figures.jsonl"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # cuBLAS bit-identical across streams
dry=""; [ "${1:-}" = "--dry-run" ] && dry="--dry-run"
KILL=3  # seconds between timeout's TERM and its KILL
LIMIT=570  # the call's 600 s, less a margin for the start and the copying back
# name:seconds, in the order they run (timeout signals the part's whole process group: a part's
# own subprocesses end with it). step_zero_offload compiles the CPU Adam for fp32 grads; the
# overlap variant and split_step find it in inductor's cache; split_step measures a quick
# profile (~10-20 s) and runs three models
PARTS="env:15 tests:140 equivalence:55 copies:35 cpu_adam:50 step_plain:30 step_zero_offload:65
  step_zero_offload_overlap:45 split_step:80 ratios:10"
status=0
worst=0
for p in $PARTS; do worst=$((worst + ${p#*:} + KILL)); done
echo "gpu_check: worst case $worst s if every part times out (limit $LIMIT s)"
[ "$worst" -lt "$LIMIT" ] || { echo "gpu_check: the parts' timeouts add up to more than $LIMIT s"; exit 2; }
secs() { for p in $PARTS; do [ "${p%%:*}" = "$1" ] && echo "${p#*:}"; done; }

# run NAME FILE CMD...: CMD under NAME's timeout, its output appended to $out/FILE; a failure is
# reported and remembered, and the next part runs
run() {
    local name=$1 file=$2 s; s=$(secs "$1"); shift 2
    echo "== $name (timeout ${s} s): $*" >>"$out/$file"
    timeout -k "$KILL" "$s" "$@" >>"$out/$file" 2>&1
    local rc=$?
    if [ $rc -ne 0 ]; then
        status=1
        echo "gpu_check: $name failed: exit $rc$([ $rc -ge 124 ] && echo " (timed out after $s s)")" | tee -a "$out/$file"
    fi
    return $rc
}

run env env.txt bash -c "date -u; \"$py\" -c \"import sys, torch, tiermem; print(sys.version.split()[0], 'torch',
  torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'devices',
  torch.cuda.device_count(), 'tiermem from', tiermem.__file__)\"; nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv || true; nproc; free -g | head -2"
cat "$out/env.txt"
if [ -z "$dry" ] && ! grep -q " available True " "$out/env.txt"; then  # the env part asked torch
    echo "gpu_check: no CUDA device here: run with --dry-run"; exit 1
fi

# the suite's policy-equivalence tests train on the default device: the GPU here
equiv="tests/test_param_offload.py::test_weights_off_device_give_identical_numbers
  tests/test_nvme_state.py::test_state_on_nvme_gives_identical_numbers
  tests/test_nvme_grads.py::test_grads_on_nvme_give_identical_numbers
  tests/test_activations.py::test_offload_never_changes_the_numbers"
if [ -n "$dry" ]; then  # no device: the tests must at least import and collect
    run tests tests.txt "$py" -m pytest -q -m cuda --collect-only -p no:cacheprovider tests/
    # shellcheck disable=SC2086
    run equivalence tests.txt "$py" -m pytest -q --collect-only -p no:cacheprovider $equiv
else
    run tests tests.txt "$py" -m pytest -q -m cuda -p no:cacheprovider --timeout=100 tests/
    # shellcheck disable=SC2086
    run equivalence tests.txt "$py" -m pytest -q -p no:cacheprovider --timeout=45 $equiv
fi
tail -n 15 "$out/tests.txt"

gc=(bench/gpu_check.py --out "$out" $dry)
run copies bench.txt "$py" "${gc[@]}" --part copies
run cpu_adam bench.txt "$py" "${gc[@]}" --part cpu_adam
for v in plain zero_offload zero_offload_overlap; do
    run "step_$v" bench.txt "$py" "${gc[@]}" --part step --variant "$v"
done
# the split optimizer's real GPU gain (ZeroOffload(device_fraction=f)), one model per process
if [ -n "$dry" ]; then split=(--device cpu --n-layer 2 --n-embd 64 --seq-len 32 --fractions 0,1 --steps 1 --warmup 1)
else split=(--device cuda --fractions 0,0.5,1 --steps 4 --warmup 1); fi
run split_step split_step.txt "$py" bench/split_step.py "${split[@]}"
tail -n 8 "$out/split_step.txt"
run ratios bench.txt "$py" "${gc[@]}" --ratios
sed -n '/^machine:/,$p' "$out/bench.txt"
echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED); files in $out"
exit $status
