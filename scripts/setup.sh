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

# libtpu, the TPU compiler, for ahead-of-time TPU compiles on machines without TPUs (splash_jax/aot.py,
# tests/test_tpu_*.py, docs/tpu.md): the version jax's own `tpu` extra pins, installed into
# .venv/libtpu, off the import path. A libtpu that jax can import is probed at every start-up and
# prints TPU-detection errors on a machine with no TPU; splash_jax/mesh/topology.py points
# TPU_LIBRARY_PATH at this copy only while it builds a TPU topology. On a TPU VM install jax[tpu]
# instead (docs/tpu.md); SPLASH_SKIP_LIBTPU=1 skips this step.
if [ -z "${SPLASH_SKIP_LIBTPU:-}" ]; then
  libtpu_req=$(.venv/bin/python - <<'PY'
from importlib.metadata import requires
print(next(r.split(";")[0].replace(" ", "") for r in requires("jax") or [] if r.startswith("libtpu") and "tpu" in r.split(";")[-1]))
PY
)
  libtpu_stamp=.venv/libtpu/.splash-installed
  if [ ! -f "$libtpu_stamp" ] || [ "$(cat "$libtpu_stamp")" != "$libtpu_req" ]; then
    echo "installing $libtpu_req (compile-only) into .venv/libtpu" >&2
    rm -rf .venv/libtpu
    .venv/bin/python -m pip install -q --no-deps --target .venv/libtpu "$libtpu_req" 2>&1 | grep -v "^WARNING: Location" >&2 || true
    if [ ! -f .venv/libtpu/libtpu/libtpu.so ]; then
      # A new jax can pin a libtpu not yet on the index (jax 0.12.1 -> libtpu 0.0.53 on 2026-12-06):
      # take the newest one before it (0.0.52 compiled every TPU test with jax 0.12.1).
      libtpu_base=$(echo "$libtpu_req" | sed -e 's/^libtpu==//' -e 's/\.\*$//')
      echo "$libtpu_req is not available; installing the newest libtpu<=$libtpu_base instead" >&2
      rm -rf .venv/libtpu
      .venv/bin/python -m pip install -q --no-deps --target .venv/libtpu "libtpu<=$libtpu_base" 2>&1 | grep -v "^WARNING: Location" >&2 || true
    fi
    [ -f .venv/libtpu/libtpu/libtpu.so ] || { echo "libtpu installation failed" >&2; exit 1; }
    echo "$libtpu_req" > "$libtpu_stamp"
  fi
fi
