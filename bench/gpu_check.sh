#!/usr/bin/env bash
# The prepared GPU check (bench/gpu_check.py): one command for a GPU machine, which also runs on
# CPU, skipping what needs CUDA and saying so.
#
#   bash bench/gpu_check.sh
#
# Python: $PYTHON, else .venv/bin/python, else python3. Where megatron-core is not installed
# (a bare GPU image), wheels carried in .whl/ (megatron-core 0.19.2 and what it needs beyond the
# image) are installed into /tmp/site first. Results: bench/results/gpu_check_<device>.txt and
# the run logs beside it (or under $GPU_CHECK_RESULTS); copied to $OUT when that is set.
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
  cp -r "${GPU_CHECK_RESULTS:-bench/results}"/gpu_check_* "$OUT"/ 2>/dev/null || true
fi
exit $status
