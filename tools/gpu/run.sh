#!/usr/bin/env bash
# The GPU path of issue 28 in one command, from the repo root on the GPU machine:
#
#     bash tools/gpu/run.sh --out "$OUT" [--parts 1 2 3 5] [--dry-run]
#
# Needs .whl/ (tools/gpu/fetch_wheels.sh, carried along). tools/gpu/run.py says what
# each part does and its time limit; its output is copied to $OUT/partN.log as it runs, then
# appended to $OUT/parts.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" tools/gpu/run.py "$@"
