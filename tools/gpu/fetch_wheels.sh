#!/usr/bin/env bash
# Download the wheels in tools/gpu/wheels.txt into .whl/ (git-ignored) for the GPU
# machine, which has no network: cp312, manylinux x86_64 or pure python, no
# dependencies resolved (the list names each one). A name published as an sdist only
# (antlr4-python3-runtime 4.9.3) is built here into a pure-python wheel.
#
#     bash tools/gpu/fetch_wheels.sh [PYTHON]    # from the repo root; PYTHON: python3
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${1:-python3}
dest=.whl
mkdir -p "$dest"
# pip matches a manylinux_2_N tag exactly, so every N the machine's glibc (2.39, Ubuntu
# 24.04's; Python 3.12.3) admits is named: llguidance 1.9.1 ships manylinux_2_31 only
platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in $(seq 17 39); do
    platforms+=(--platform "manylinux_2_${n}_x86_64")
done
grep -vE '^\s*(#|$)' tools/gpu/wheels.txt | while read -r req; do
    name=${req%%==*}
    stem=$(echo "$name" | tr '-' '_')
    if ls "$dest" | grep -qi "^${stem}-${req##*==}-"; then
        continue
    fi
    if ! "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$dest" "$req" 2>/dev/null; then
        echo "no wheel for $req: building one from its sdist"
        "$py" -m pip wheel -q --no-deps --no-binary="$name" -w "$dest" "$req"
    fi
done
# one version of each: two stop the whole install on the GPU machine
dupes=$(ls "$dest"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "more than one wheel of: $dupes (remove the stale ones from $dest)" >&2
    exit 1
fi
ls -1 "$dest"
du -sh "$dest"
