#!/usr/bin/env bash
# One-time setup on a fresh machine: the CPU build of torch first (so nothing pulls a CUDA build),
# then asyncloco itself with its test extras. Safe to run again: already-installed packages are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[test]"
