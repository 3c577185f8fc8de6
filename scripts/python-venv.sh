#!/usr/bin/env bash
# Create or update the Python virtualenv used by the interop tests (tests/python).
#
#   scripts/python-venv.sh            # -> .venv in the repo root
#   VENV=/some/dir scripts/python-venv.sh
#
# Idempotent and fast: the sha256 of tests/python/requirements.txt (plus the
# interpreter version) is stored in the venv; when it matches, nothing is done.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
REQ="$ROOT/tests/python/requirements.txt"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.spillway-requirements.sha256"

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "python-venv: $PYTHON not found" >&2
    exit 1
fi

want="$( { sha256sum "$REQ" | cut -d' ' -f1; "$PYTHON" -c 'import sys; print(sys.version)'; } | sha256sum | cut -d' ' -f1)"

if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    echo "python-venv: $VENV is up to date"
    exit 0
fi

# A venv made by another interpreter (or a broken one) is recreated from scratch.
if [[ -e "$VENV" ]] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    rm -rf "$VENV"
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "python-venv: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

rm -f "$STAMP"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VENV/bin/python" -m pip install --quiet --requirement "$REQ"
echo "$want" > "$STAMP"
echo "python-venv: $VENV ready"
