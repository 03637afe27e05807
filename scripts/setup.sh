#!/usr/bin/env bash
# Creates the project's virtual environment with pinned versions.
#   bash scripts/setup.sh            -> .venv,        megatron-core 0.19.2 (default)
#   MCORE=legacy bash scripts/setup.sh -> .venv-legacy, megatron-core 0.15.x
set -euo pipefail
cd "$(dirname "$0")/.."

find_python312() {
  local candidate
  for candidate in python3.12 "$(command -v pyenv >/dev/null && pyenv root)/versions/"3.12*/bin/python3.12 /usr/bin/python3.12; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "setup.sh: Python 3.12 not found (megatron-core >= 0.17 needs it); install python3.12" >&2
  return 1
}

case "${MCORE:-default}" in
  default) venv=.venv; lock=requirements.lock ;;
  legacy)  venv=.venv-legacy; lock=requirements-legacy.lock ;;
  *) echo "setup.sh: MCORE must be 'default' (0.19.2) or 'legacy' (0.15.x), got '${MCORE}'" >&2; exit 2 ;;
esac

python=$(find_python312)
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$lock" -r requirements-test.lock
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
echo "setup.sh: $venv ready (megatron-core $("$venv/bin/python" -c "from importlib.metadata import version; print(version('megatron-core'))"))"
