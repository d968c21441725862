#!/usr/bin/env bash
# One-time setup on a fresh machine: the CPU build of torch first (so nothing pulls a CUDA build),
# then asyncloco itself with its test extras. Safe to run again: already-installed packages are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[test]"
# Optional system packages, only where apt-get runs as root; any failure is ignored and never fails the setup:
# Chromium for the dashboard's headless-browser test, iptables for the NAT namespace test (both tests skip,
# saying why, without them).
missing=""
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v iptables >/dev/null 2>&1 || missing="$missing iptables"
if [ -n "$missing" ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing$missing (optional: the dashboard's browser test, the NAT test) ..."
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing; } >/dev/null 2>&1 \
        || echo "could not install$missing (optional): the tests that need them will be skipped"
fi
