#!/usr/bin/env bash
# Installs the Debian packages kvrig relies on (OpenBLAS for MLX's CPU matmul, libimobiledevice's tools that the
# tests drive against the virtual iPhone); does nothing when present.
set -euo pipefail
if [ "$(uname -s)" = Darwin ]; then
  # kvrig packages, plans, builds and drives phones on macOS without them (its texts ship inside it, MLX uses
  # Accelerate); the test suite also drives libimobiledevice's tools.
  echo "kvrig setup: macOS: no Debian packages needed (for the tests: brew install libimobiledevice ideviceinstaller)" >&2
  exit 0
fi
missing=()
for pkg in "$@"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null; then
  echo "kvrig setup: not a Debian system: install the equivalents of ${missing[*]} with your package manager" >&2
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
