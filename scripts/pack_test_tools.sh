#!/usr/bin/env bash
# Packs pytest-xdist (and execnet) into .device/testtools.tar.xz (about 0.1 MB), for a
# GPU machine that reaches no package index. scripts/device_check.sh unpacks it when
# the file is there and then runs the GPU tests in TEST_WORKERS processes (default 6):
# most of a GPU test's time is compiling on the host CPU (XLA's reference and the
# kernels' first call), so the suite scales with the host's cores.
#   bash scripts/pack_test_tools.sh         # once, on a machine with an index
set -euo pipefail
root=$(git rev-parse --show-toplevel)
out="$root/.device"; mkdir -p "$out"
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$tmp/wheels" "pytest-xdist==3.8.0" "execnet==2.1.2"
mkdir -p "$tmp/site"
for w in "$tmp"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tmp/site"; done
(cd "$tmp/site" && tar cf - . | xz -9 > "$out/testtools.tar.xz")
rm -rf "$tmp"
ls -la "$out/testtools.tar.xz"
