#!/usr/bin/env bash
# Create .venv with Python >= 3.12 and install splash-jax with its serve/test/bench extras.
# Idempotent: reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for cand in "${PYTHON:-}" python3.13 python3.12 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for dir in "$(pyenv root)"/versions/3.1[2-9]*; do
      [ -x "$dir/bin/python" ] && { echo "$dir/bin/python"; return 0; }
    done
  fi
  return 1
}

if [ ! -x .venv/bin/python ]; then
  if ! PY=$(find_python); then
    echo "splash-jax needs Python >= 3.12 (jax >= 0.11 requires it) and none was found." >&2
    echo "Install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12." >&2
    exit 1
  fi
  echo "creating .venv with $PY" >&2
  "$PY" -m venv .venv
fi

stamp=.venv/.splash-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "installing splash-jax and its dependencies into .venv" >&2
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" >&2 || true
  .venv/bin/python -m pip install -q -e ".[serve,test,bench]" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  .venv/bin/python -c "import splash_jax, jax, flax" || { echo "installation failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
