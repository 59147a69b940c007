#!/usr/bin/env bash
# Packs pytest-xdist (and execnet) for the GPU machine, which reaches no package
# index, into .device/testtools.tar.xz (about 0.1 MB). Carry it with part2 and unpack
# it with install_test_tools below; scripts/device_check.sh then runs the GPU tests
# in TEST_WORKERS processes (default 4; the device host has 16 cores, and most of a
# GPU test's time is compiling: XLA's reference and the kernels' first call).
#   bash scripts/pack_test_tools.sh                     # here, once
#   carry: [".device/part2.tar.xz", ".device/install.sh", ".device/testtools.tar.xz"]
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
