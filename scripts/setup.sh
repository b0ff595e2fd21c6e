#!/usr/bin/env bash
# Set up MergePipe on a fresh machine: a virtual environment in .venv with the CPU build of torch
# (installed first and pinned, so that pip never resolves a multi-GB CUDA build), the package with its
# test extras, and Debian's chromium for the browser tests. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# Quiet except real problems: pip's errors only (-qq; no version check, no root-user or script-location
# notes), and no Python warnings from the build backend (setuptools' notes on editable installs).
pip_install() {
    PYTHONWARNINGS=ignore .venv/bin/python -m pip install -qq --disable-pip-version-check \
        --root-user-action=ignore --no-warn-script-location "$@"
}
pip_install --upgrade pip
pip_install torch==2.13.0
pip_install -e '.[test]'
if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null
    else
        echo "note: /usr/bin/chromium missing; browser tests need: sudo apt-get install -y chromium" >&2
    fi
fi
# axe-core (npm) for the dashboard's accessibility test (Debian's npm when missing and root)
if ! command -v npm >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm) >/dev/null
fi
if command -v npm >/dev/null; then
    npm install --silent --no-audit --no-fund --no-update-notifier --loglevel=error >/dev/null
else
    echo "note: npm missing; the accessibility test needs: npm install (axe-core, see package.json)" >&2
fi
