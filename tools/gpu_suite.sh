#!/usr/bin/env bash
# The GPU suite for the lent H200: every test on the real device (no simulator), the gpu-marked
# tests at real shapes, then the benchmarks.  Logs and JSON results go to $OUT (the device tool
# brings that folder back) or ./gpu-out.  Runs from the repository tree in place: the device
# image already has numba-cuda, CuPy, h5py, hypothesis and pytest, and can install nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu}
unset NUMBA_ENABLE_CUDASIM
status=0
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
  python3 -c "import numpy, numba, numba.cuda as c; print('numpy', numpy.__version__, 'numba', numba.__version__, 'gpu', c.is_available())"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}
for bench in ${BENCHES:-tools/bench_ddtree.py tools/bench_layers.py tools/bench_attention.py tools/bench_engine.py}; do
  [ -f "$bench" ] || continue
  name=$(basename "$bench" .py)
  timeout "${BENCH_TIMEOUT:-240}" python3 "$bench" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.md"
done
echo "pytest exit status: $status" | tee -a "$OUT/env.txt"
exit "$status"
