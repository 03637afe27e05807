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

# A new legacy environment starts as hard links to .venv's installed packages when there is one:
# both pin the same torch (most of the 5 GB) and most of the rest, and unpacking and compiling
# those wheels a second time took over a minute. pip then replaces what the legacy lock pins
# otherwise (megatron-core, numpy), and what only .venv pins is uninstalled below. pip never
# writes an installed file in place (it removes and recreates), so .venv stays as it is.
seeded=
seed_from_default() {
  local site=lib/python3.12/site-packages
  [ "$venv" = .venv-legacy ] && [ -d ".venv/$site" ] || return 0
  "$python" -m venv "$venv"
  rm -rf "${venv:?}/$site"
  cp -al ".venv/$site" "$venv/$site"
  seeded=1
}

# Distribution names, normalised (PEP 503), one per line.
names() { sed -E 's/[=@ ].*//' | tr 'A-Z_.' 'a-z--' | sort -u; }

python=$(find_python312)
[ -x "$venv/bin/python" ] || seed_from_default
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$lock" -r requirements-test.lock
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
if [ -n "$seeded" ]; then
  pinned=$(grep -hv '^#' "$lock" requirements-test.lock | names)
  installed=$("$venv/bin/python" -m pip list --format=freeze --exclude-editable \
                --disable-pip-version-check 2>/dev/null | names)
  extra=$(comm -13 <(echo "$pinned") <(echo "$installed") | grep -vx -e pip -e setuptools || true)
  # shellcheck disable=SC2086  # one name per word
  [ -z "$extra" ] || "$venv/bin/python" -m pip uninstall -q -y --disable-pip-version-check $extra
fi
# The project's own bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (as in the
# sandboxes this project is developed in) every process, each torchrun rank and each forked rank
# of the test suite, compiled the ~100 modules it imports from source again (~0.1 s of CPU each).
"$venv/bin/python" -m compileall -q moe_launcher megatron_patches tests bench pretrain_moe.py >/dev/null
echo "setup.sh: $venv ready (megatron-core $("$venv/bin/python" -c "from importlib.metadata import version; print(version('megatron-core'))"))"
