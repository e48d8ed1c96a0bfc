#!/usr/bin/env bash
# Installs Horovod 0.28.1 (its last release) into the venv of PYTHON, built against the installed torch.
# As shipped it sets CMAKE_CXX_STANDARD 14, and torch 2.13's headers need C++17 ("#error C++17 or later"),
# so the sdist is patched to 17. The wheel is cached per Horovod/torch/Python version in CACHE, so only the
# first run pays the build (about 3 minutes on 2 cores). Needs g++ and cmake (apt).
set -euo pipefail
PYTHON=${1:?usage: install-horovod.sh PYTHON [CACHE]}
CACHE=${2:-${XDG_CACHE_HOME:-$HOME/.cache}/ina-emulator}
VERSION=0.28.1
KEY=$("$PYTHON" -c 'import sys, torch; print(f"torch{torch.__version__}-cp{sys.version_info[0]}{sys.version_info[1]}")')
WHEELS="$CACHE/horovod-$VERSION-$KEY"
if ! ls "$WHEELS"/horovod-*.whl >/dev/null 2>&1; then
  for tool in g++ cmake; do
    command -v "$tool" >/dev/null || { echo "install-horovod: $tool is missing (apt-get install -y g++ cmake)" >&2; exit 1; }
  done
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: "horovod==$VERSION" -d "$WORK"
  tar -xzf "$WORK/horovod-$VERSION.tar.gz" -C "$WORK"
  SRC="$WORK/horovod-$VERSION"
  for f in "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; do
    grep -q 'CMAKE_CXX_STANDARD 14' "$f" || { echo "install-horovod: $f has no C++14 line to patch" >&2; exit 1; }
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$f"
  done
  "$PYTHON" -m pip install -q setuptools wheel
  mkdir -p "$WHEELS"
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
    "$PYTHON" -m pip wheel -q --no-build-isolation --no-deps "$SRC" -w "$WHEELS"
fi
"$PYTHON" -m pip install -q "$WHEELS"/horovod-*.whl
"$PYTHON" -c 'import horovod, horovod.torch as hvd; print("horovod", horovod.__version__, "gloo built:", hvd.gloo_built())'
