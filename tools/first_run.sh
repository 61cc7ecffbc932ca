#!/usr/bin/env bash
# Issue 36 item 4 on the lent GPU machine, in one call: the first run of the README's DDTree
# command on a fresh machine, before and after the parallel precompile (docs/ENGINE.md, "First
# run on a GPU").  Writes $OUT/first_run.log, $OUT/kernels.json (the demo pair's kernel
# manifest: commit it as kdtree_numba/demo/kernels.json) and prints a table last.
#   1. a cold cache, no manifest, --precompile off: the old serial compile; records the
#      manifest (and AR's into the same file, on the now warm cache);
#   2. that manifest shipped; a cold cache: kdtree-run compiles in parallel first (goal <= 20 s);
#   3. the same command again (warm cache);
#   4. an image's pre-warm: kdtree-precompile into a cold cache, then the run;
#   5. the GPU test: an empty cache, the precompile, a run that compiles nothing;
#   6. the console scripts installed by python3's pip, run.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci
unset NUMBA_ENABLE_CUDASIM KDTREE_KERNEL_CACHE_DIR
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
LOG="$OUT/first_run.log"; : > "$LOG"
RUN=(python3 -m kdtree_numba.cli --prompt "def fibonacci(n):" --max-new-tokens 64)
declare -a ROWS
# timed NAME CMD...: wall seconds of CMD (its output into the log)
timed() {
  local name=$1; shift
  echo "=== $name: $*" >> "$LOG"
  local t0; t0=$(date +%s.%N)
  "$@" >> "$LOG" 2>&1; local rc=$?
  local s; s=$(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')")
  ROWS+=("$name|$s s|exit $rc")
}
rm -rf /tmp/kc_serial /tmp/kc /tmp/kc_image
timed "cold, serial compile (recording)" env KDTREE_KERNEL_CACHE_DIR=/tmp/kc_serial \
  "${RUN[@]}" --method ddtree --precompile off --record-kernels "$OUT/kernels.json"
timed "AR recorded (warm cache)" env KDTREE_KERNEL_CACHE_DIR=/tmp/kc_serial \
  "${RUN[@]}" --method ar --precompile off --record-kernels "$OUT/kernels.json"
cp "$OUT/kernels.json" kdtree_numba/demo/kernels.json
timed "cold, parallel precompile (the goal)" env KDTREE_KERNEL_CACHE_DIR=/tmp/kc \
  "${RUN[@]}" --method ddtree
timed "warm, the same command" env KDTREE_KERNEL_CACHE_DIR=/tmp/kc "${RUN[@]}" --method ddtree
timed "image: kdtree-precompile" env KDTREE_KERNEL_CACHE_DIR=/tmp/kc_image \
  python3 -m kdtree_numba.precompile
timed "image: then the run" env KDTREE_KERNEL_CACHE_DIR=/tmp/kc_image "${RUN[@]}" --method ddtree
timed "pytest -m gpu tests/test_precompile.py" python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_precompile.py
# the console scripts on the image: written by python3's own pip (a bare `pip` belonged to
# another Python there, whose kdtree-run had no numpy), so they run the interpreter that works
timed "console scripts (python3 -m pip install -e .)" bash -c 'python3 -m pip install -q \
  --no-deps --no-build-isolation -e . && command -v kdtree-run kdtree-precompile && \
  KDTREE_KERNEL_CACHE_DIR=/tmp/kc kdtree-run --prompt "def fibonacci(n):" --max-new-tokens 8 \
  --method ddtree && kdtree-precompile --help > /dev/null'
nproc >> "$LOG"; nvidia-smi --query-gpu=name --format=csv,noheader >> "$LOG" 2>&1
grep -E "(compiling|\.\.\. done|kernels from|failed|no kernel manifest)|tok/s|passed" "$LOG" \
  | tail -40
printf '\n| step | wall | exit |\n|---|---|---|\n'
for row in "${ROWS[@]}"; do echo "| ${row//|/ | } |"; done
