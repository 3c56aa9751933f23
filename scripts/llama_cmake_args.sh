#!/usr/bin/env bash
# The CMake flags for llama.cpp (llama-cpp-python and llama-server) on THIS CPU, read from /proc/cpuinfo.
# Not GGML_NATIVE: on an Intel Xeon with AMX, -march=native compiles llama.cpp's AMX kernels, which die on
# their first decode ('tilezero', invalid opcode: llama.cpp never requests tile permission). Not a fixed
# AVX-512 list either: that build dies with SIGILL on an AVX2-only CPU (an AMD EPYC Milan, family 25).
# AVX2, FMA, F16C and BMI2 are on by default in ggml when GGML_NATIVE=OFF; AVX-512 is added only where the
# CPU has every extension GGML_AVX512 compiles for (F, CD, VL, DQ, BW). Usage: CMAKE_ARGS="$(scripts/llama_cmake_args.sh)"
set -euo pipefail
flags=$(grep -m1 -w '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]]; }
args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
if has avx512f && has avx512cd && has avx512vl && has avx512dq && has avx512bw; then
  args+=" -DGGML_AVX512=ON"
  has avx512_vnni && args+=" -DGGML_AVX512_VNNI=ON"
  has avx512_bf16 && args+=" -DGGML_AVX512_BF16=ON"
else
  args+=" -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF"
fi
echo "$args"
