#!/usr/bin/env bash
# The prepared GPU check (bench/gpu_check.py): one command for a GPU machine, which also runs on
# CPU, saying NOT RUN for what needs CUDA.
#
#   bash bench/gpu_check.sh
#
# Python: $PYTHON, else .venv/bin/python, else python3. Where megatron-core is not installed
# (a bare GPU image), prepared wheels are installed first (below); every launch keeps the
# PYTHONPATH that puts them first. Results:
# bench/results/gpu_check_<device>.txt and the launches' logs beside it (or under
# $GPU_CHECK_RESULTS); copied to $OUT when that is set (the summary and one archive of the logs:
# $OUT takes few files).
#
# A GPU machine without a package registry (this workplace's H200: torch 2.11 CUDA 13, Python
# 3.12, the packages in bench/device_image_packages.txt, no megatron-core, Transformer Engine or
# apex): prepare the wheels it lacks here, once, where pip reaches PyPI,
#
#   bash bench/gpu_check.sh --prepare [DIR]      # DIR: .whl (git-ignored, never committed)
#
# which prints the device call to make (command `bash bench/gpu_check.sh`, carry [".whl"],
# timeout_s 540). There, the check resolves megatron-core against what the machine has, offline,
# installs just what it lacks from $GPU_CHECK_WHEELS (default .whl) into a fresh folder on
# PYTHONPATH, or stops with one line naming what is missing (bench/gpu_check_wheels.py). Its
# steps stop starting at $GPU_CHECK_SECONDS (default 330): with the install, the whole check
# fits in 6 minutes, half a 15-minute device window, leaving the other half for a rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-}
if [[ -z $python ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
if [[ ${1:-} == --prepare ]]; then
  exec "$python" bench/gpu_check_wheels.py prepare "${2:-.whl}"
fi
if ! "$python" -c 'import megatron.core' 2>/dev/null; then
  site=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
  trap 'rm -rf "$site"' EXIT
  "$python" bench/gpu_check_wheels.py install "${GPU_CHECK_WHEELS:-.whl}" "$site" || exit 2
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
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
