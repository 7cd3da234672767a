#!/usr/bin/env bash
# The wheels the Docker image installs from (the image build never reaches PyPI): this
# project's wheel and every runtime dependency for CPython 3.11 on manylinux (glibc 2.36,
# Debian bookworm) for this machine's architecture, in .offline/wheelhouse (gitignored).
# Re-run after changing the code; wheels already downloaded are kept.
#
# Usage: scripts/wheelhouse.sh        Env: WHEELHOUSE (dir), PYTHON (a python with pip)
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELHOUSE=${WHEELHOUSE:-.offline/wheelhouse}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
ARCH=$(uname -m)
# pip takes --platform literally, so name every manylinux tag glibc 2.36 can run.
PLATFORMS=(--platform "manylinux2014_$ARCH" --platform "manylinux2010_$ARCH" --platform "manylinux1_$ARCH")
for minor in $(seq 5 36); do PLATFORMS+=(--platform "manylinux_2_${minor}_$ARCH"); done

mkdir -p "$WHEELHOUSE"
rm -f "$WHEELHOUSE"/megha-*.whl
"$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$WHEELHOUSE" .
"$PYTHON" -m pip download -q --dest "$WHEELHOUSE" --find-links "$WHEELHOUSE" \
  --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 \
  "${PLATFORMS[@]}" "$(ls "$WHEELHOUSE"/megha-*.whl)"
echo "wheelhouse: $(ls "$WHEELHOUSE" | wc -l) wheels in $WHEELHOUSE ($(du -sh "$WHEELHOUSE" | cut -f1))"
