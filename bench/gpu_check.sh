#!/usr/bin/env bash
# The prepared GPU check (bench/gpu_check.py): one command for a GPU machine, which also runs on
# CPU, saying NOT RUN for what needs CUDA.
#
#   bash bench/gpu_check.sh
#
# Python: $PYTHON, else .venv/bin/python, else python3. Where megatron-core is not installed
# (a bare GPU image), the wheels in .whl/ are installed into /tmp/site first and put on
# PYTHONPATH (before what it held), which every launch keeps. Results:
# bench/results/gpu_check_<device>.txt and the launches' logs beside it (or under
# $GPU_CHECK_RESULTS); copied to $OUT when that is set (the summary and one archive of the logs:
# $OUT takes few files).
#
# On this workplace's H200 machine (torch 2.11 CUDA 13, Python 3.12; numpy, packaging, einops,
# psutil, tensorboard and pytest are in its image, Transformer Engine and apex are not), .whl/
# must hold megatron-core alone (2.4 MB; .whl/ is git-ignored, never committed). Prepare it once:
#
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl megatron-core==0.19.2
#
# then call the device tool's run with command `bash bench/gpu_check.sh`, carry [".whl"] and
# timeout_s 540: the check spends at most $GPU_CHECK_SECONDS (default 480) on its launches.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-}
if [[ -z $python ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
if ! "$python" -c 'import megatron.core' 2>/dev/null; then
  compgen -G '.whl/*.whl' >/dev/null \
    || { echo "gpu_check.sh: megatron-core is not installed and no wheels are in .whl/" >&2; exit 2; }
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
status=0
"$python" bench/gpu_check.py || status=$?
if [[ -n ${OUT:-} ]]; then
  results=${GPU_CHECK_RESULTS:-bench/results}
  cp "$results"/gpu_check_*.txt "$OUT"/ 2>/dev/null || true
  (cd "$results" && tar -czf "$OUT"/gpu_check_logs.tar.gz gpu_check_*_logs) || true
fi
exit $status
