#!/usr/bin/env bash
# Sets up both environments and runs the whole CPU test suite:
#   default (megatron-core 0.19.2, .venv) and legacy (megatron-core 0.15.x, .venv-legacy).
# Extra arguments go to the default suite's pytest (e.g. -k resume, -x). Each run ends with its
# 25 slowest tests; a test past 600 s fails with its stacks (pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
status=0
.venv/bin/python -m pytest -q -m "not legacy" --durations=25 "$@" tests || status=$?

if [ -f requirements-legacy.lock ]; then
  MCORE=legacy bash scripts/setup.sh
  # The legacy tests, and the in-process ones of the default suite that hold on 0.15 too (the
  # registry; the fused cross-entropy patch): "not slow" keeps the 0.19 launches out.
  LEGACY_SUITE=1 .venv-legacy/bin/python -m pytest -q -m "legacy or not slow" --durations=5 \
    tests/megatron_patches/fsdp/test_legacy_*.py \
    tests/megatron_patches/checkpointing/test_sync_save_cpu.py \
    tests/megatron_patches/test_registry_and_defaults.py \
    tests/megatron_patches/accounting/test_fused_cross_entropy_gradient_cpu.py || status=$?
fi
exit $status
