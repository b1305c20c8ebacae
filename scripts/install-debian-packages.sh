#!/usr/bin/env bash
# Installs the Debian packages kvrig relies on (OpenBLAS for MLX's CPU matmul, libimobiledevice's tools that the
# tests drive against the virtual iPhone); does nothing when present.
set -euo pipefail
missing=()
for pkg in "$@"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null; then
  echo "kvrig setup: please install ${missing[*]} with your package manager (optional: speeds up host runs)" >&2
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
