#!/usr/bin/env bash
# Build llama-server from the llama.cpp that llama-cpp-python 0.3.36 vendors (its sdist), with the CMake flags
# of the README's install (scripts/llama_cmake_args.sh: this CPU's vector ISA, never AMX), offline UI and no OpenSSL. Used by the `llama_server` outside
# reference (docs/backends.md). Usage: scripts/build_llama_server.sh [DEST]   (default: ~/.cache/specgraft/llama-server)
set -euo pipefail
VERSION=0.3.36
DEST=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/specgraft/llama-server}
FLAGS=${LLAMA_SERVER_CMAKE_FLAGS:-"$("$(dirname "$0")/llama_cmake_args.sh")"}
STAMP="llama-cpp-python $VERSION | $FLAGS"
# a binary built here before from the same source and flags is reused (FORCE=1 rebuilds): the build is ~15 minutes
if [ -z "${FORCE:-}" ] && [ -x "$DEST/llama-server" ] && [ -d "$DEST/convert" ] && [ "$(cat "$DEST/build-stamp" 2>/dev/null)" = "$STAMP" ]; then
  echo "$DEST/llama-server"
  exit 0
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
pip download "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -d "$WORK" >/dev/null
tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
# shellcheck disable=SC2086
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON $FLAGS >/dev/null
cmake --build "$WORK/build" --target llama-server -j "${JOBS:-$(nproc)}"
mkdir -p "$DEST"
cp "$WORK/build/bin/llama-server" "$DEST/llama-server.tmp" && mv "$DEST/llama-server.tmp" "$DEST/llama-server"
# the EAGLE-3 head converter needs the same tree's convert_hf_to_gguf.py and gguf-py
rm -rf "$DEST/convert" && mkdir -p "$DEST/convert"
cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/gguf-py" "$SRC/conversion" "$DEST/convert/" 2>/dev/null || cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/gguf-py" "$DEST/convert/"
echo "$STAMP" > "$DEST/build-stamp"
echo "$DEST/llama-server"
