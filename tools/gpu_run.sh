#!/usr/bin/env bash
# One call on the lent GPU machine: an optional profiler/sanitizer step, the chosen test files
# in parallel pytest shards (numba's first-call compiles are CPU-bound; the machine has 16
# cores), then benchmarks one after another.  Everything is configured by environment:
#   TEST_FILES="tests/a.py tests/b.py"  SHARDS=8  TEST_T=300 (s per shard)
#   DESELECT="id-substring ..."          tests whose node id contains one of these are left out
#   SERIAL="id-substring ..."  SERIAL_T=300   tests whose node id contains one of these run in
#                                        one process after the shards: those that hold large
#                                        device arrays (Kimi-width experts, ~16 GB a process:
#                                        eight shards of them ran out of memory in run 111);
#                                        SERIAL_T must leave ~30 s for the process's exit
#                                        (run 119: killed after printing "21 passed" at 170 s)
#   PRE_CMD='ncu ... python3 dev/profile_ddtree.py'     run alone first (GPU quiet)
#   SAN_TESTS="tests/x.py::test_y"       under compute-sanitizer memcheck, beside the shards
#   BENCHES="tools/bench_ddtree.py;tools/bench_layers.py --only moe"  BENCH_T=120
# Logs are folded into $OUT/tests.log (the device tool returns only a few files); each
# benchmark writes $OUT/NAME.md and $OUT/NAME.json.  docs/GPU_RESULTS.md keeps each check's last
# result; a benchmark's numbers go into docs/results/*.json (tools/bench_docs.py).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci
unset NUMBA_ENABLE_CUDASIM
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt" 2>&1
python3 -c "import numpy, numba, cupy; print(numpy.__version__, numba.__version__, cupy.__version__)" >> "$OUT/env.txt" 2>&1
T0=$(date +%s)
# run_ids LIST LOG SECONDS: pytest on the node ids of LIST, one a line (parametrised ids may
# hold spaces, so no word splitting), its output and exit status into LOG
run_ids() {
  ( mapfile -t ids < "$1"; timeout "$3" python3 -m pytest -q -p no:cacheprovider -rfE "${ids[@]}" > "$2" 2>&1;
    echo "rc=$? $(( $(date +%s) - T0 ))s" >> "$2" )
}
if [ -n "${PRE_CMD:-}" ]; then
  ( eval "$PRE_CMD" ) > "$OUT/pre.txt" 2>&1; echo "rc=$? $(( $(date +%s) - T0 ))s" >> "$OUT/pre.txt"
fi
[ -n "${SAN_TESTS:-}" ] && ( KDTREE_CUDA_LINEINFO=1 timeout ${SAN_T:-240} compute-sanitizer --tool memcheck --print-limit 20 \
    python3 -m pytest -q -x -p no:cacheprovider ${SAN_TESTS} > "$OUT/sanitizer.txt" 2>&1;
  echo "rc=$? $(( $(date +%s) - T0 ))s" >> "$OUT/sanitizer.txt" ) &
if [ -n "${TEST_FILES:-}" ]; then
  python3 -m pytest --co -q -p no:cacheprovider ${TEST_FILES} 2>/dev/null | grep '::' | grep -v -F -f <(printf '%s\n' ${DESELECT:-NONE}) > /tmp/ids.txt
  wc -l /tmp/ids.txt > "$OUT/ids_count.txt"
  # no ids (a collection error) must not become pytest with no arguments: the whole suite
  if [ ! -s /tmp/ids.txt ]; then
    python3 -m pytest --co -q -p no:cacheprovider ${TEST_FILES} > "$OUT/collect_error.txt" 2>&1
    echo "gpu_run.sh: no test ids collected from TEST_FILES (see collect_error.txt)" | tee -a "$OUT/ids_count.txt"
    TEST_FILES=""
  fi
  rm -f /tmp/shard_* /tmp/serial_ids.txt     # a warm machine keeps the last call's shards
  if [ -n "${SERIAL:-}" ] && [ -s /tmp/ids.txt ]; then
    grep -F -f <(printf '%s\n' ${SERIAL}) /tmp/ids.txt > /tmp/serial_ids.txt
    grep -v -F -f <(printf '%s\n' ${SERIAL}) /tmp/ids.txt > /tmp/parallel_ids.txt
    mv /tmp/parallel_ids.txt /tmp/ids.txt
  fi
  [ -n "${TEST_FILES}" ] && [ -s /tmp/ids.txt ] && split -n r/${SHARDS:-4} /tmp/ids.txt /tmp/shard_
  for s in /tmp/shard_*; do
    [ -e "$s" ] || continue
    run_ids "$s" "$OUT/pytest_$(basename "$s").txt" ${TEST_T:-400} &
  done
fi
wait
[ -s /tmp/serial_ids.txt ] && run_ids /tmp/serial_ids.txt "$OUT/pytest_serial.txt" ${SERIAL_T:-300}
IFS=';' read -ra benches <<< "${BENCHES:-}"
for b in "${benches[@]}"; do
  [ -n "$b" ] || continue
  read -r path args <<< "$b"
  name=$(basename "$path" .py)
  timeout ${BENCH_T:-90} python3 $path $args --json "$OUT/$name.json" > "$OUT/$name.md" 2>&1
  echo "rc=$? $(( $(date +%s) - T0 ))s" >> "$OUT/$name.md"
done
# The device tool brings back only a few files: fold the logs into one.
for f in "$OUT"/env.txt "$OUT"/pre.txt "$OUT"/ids_count.txt "$OUT"/collect_error.txt "$OUT"/sanitizer.txt "$OUT"/pytest_*.txt; do
  [ -f "$f" ] && { echo "===== $(basename "$f")"; cat "$f"; rm -f "$f"; }
done > "$OUT/tests.log"
grep -E "^(FAILED|ERROR)|passed|failed|rc=|=====" "$OUT/tests.log" | tail -n 60
tail -n 2 "$OUT"/*.md 2>/dev/null
