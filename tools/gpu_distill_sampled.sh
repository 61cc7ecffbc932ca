#!/usr/bin/env bash
# One device call (issue 37, docs/DEMO.md "Distilling on sampled text"): write the shipped
# target back out as an HF checkpoint on the machine itself (no carry needed), then fine-tune
# the shipped drafter on the target's greedy and sampled text (train_drafter.py --sampled).
#   bash tools/gpu_distill_sampled.sh                      # first call: --init the shipped drafter
#   bash tools/gpu_distill_sampled.sh --resume .train/ckpt # a later call, carrying ckpt/ back in
# Extra arguments go to train_drafter.py; MINUTES (default 8) is its --minutes.  $OUT receives
# drafter.kdtr, drafter.safetensors, drafter_config.json, metrics.json, ckpt/ (2 files) and
# train.log: 7 files, each under 16 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
EXPORT=${EXPORT:-/tmp/kdtree-demo-export}
python3 tools/bundle_to_hf.py kdtree_numba/demo/demo-target.kdtr "$EXPORT"
python3 tools/train_drafter.py --sampled --target "$EXPORT" \
    --metrics docs/gpu-runs/2026-12-01-run32-train_target-metrics.json \
    --out "$OUT" --minutes "${MINUTES:-8}" "$@" 2>&1 | tee "$OUT/train.log"
