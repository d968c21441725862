#!/usr/bin/env bash
# One-time setup on a fresh machine: the CPU build of torch first (so nothing pulls a CUDA build),
# then asyncloco itself with its test extras. Safe to run again: already-installed packages are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[test]"
# Optional: Chromium for the dashboard's headless-browser test (tests/test_dashboard_browser.py skips, saying
# why, without it). Only where apt-get runs as root; any failure is ignored and never fails the setup.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing chromium (optional: the dashboard's browser test) ..."
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
        || echo "chromium could not be installed (optional): tests/test_dashboard_browser.py will be skipped"
fi
