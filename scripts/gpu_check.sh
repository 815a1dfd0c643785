#!/usr/bin/env bash
# The GPU check in one command, for a CUDA machine holding a finished `make bench` run (its bundles): the GPU tests
# (tests/gpu and the decoders' equivalence tests, on the device), then the run's speed rows re-measured on the
# device with the bench's code (analysis/speed_check.py) -> benchmarks/speed_<gpu>.{md,json}.
#
#   scripts/gpu_check.sh [RUN_DIR]                          # default runs/latest, DEVICE=cuda
#   DEVICE=cpu OUT=<prefix> scripts/gpu_check.sh RUN_DIR    # the same speed rows on the CPU (tested so, no GPU here)
#
# Options by environment: MODELS (bundle names, default ar,cft,rl; add rl:bfloat16 for the student in bf16),
# REPEATS (speed repeats, default the run profile's: 20 on the bench; fewer shortens the check and widens the
# intervals), BATCH (the second batch size, default the profile's speed_batch), PY (the Python to use).
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:-runs/latest}
device=${DEVICE:-cuda}
py=${PY:-.venv/bin/python}
if [ "$device" = cuda ]; then
  # the last word of the device's name: NVIDIA H200 -> h200
  gpu=$("$py" -c 'import re, torch; print(re.sub("[^a-z0-9]+", "_", torch.cuda.get_device_name(0).split()[-1].lower()))')
  "$py" -m pytest -q -p no:cacheprovider tests/gpu tests/gr2/test_decode.py
else
  gpu=$device
fi
"$py" -m analysis.speed_check --run "$run" --device "$device" ${MODELS:+--models "$MODELS"} \
  ${REPEATS:+--repeats "$REPEATS"} ${BATCH:+--batch "$BATCH"} --out "${OUT:-benchmarks/speed_$gpu}"
