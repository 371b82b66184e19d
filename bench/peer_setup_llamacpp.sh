#!/usr/bin/env bash
# Build llama-cpp-python 0.3.36 (with its OpenAI-compatible server) into its own venv (.peers/llamacpp, git-ignored)
# for bench/peers.py. Never touches .venv.
#
# There is no CPU wheel on PyPI: pip builds llama.cpp from the sdist (scikit-build-core + CMake >= 3.21 + Ninja + a
# C/C++ compiler; gcc 12 and CMake 3.25 are enough; scikit-build-core fetches cmake/ninja from PyPI into its build
# environment when they are missing or too old). About 15 minutes (896-923 s) on 2 cores, once.
# The build is HOST-SPECIFIC: CMAKE_ARGS turns on the ggml ISA switches this CPU's /proc/cpuinfo flags list (AVX2,
# FMA, F16C, BMI2, AVX_VNNI, AVX-512 F + VBMI + VNNI + BF16) with GGML_NATIVE=OFF, so a venv built on one CPU may die
# with SIGILL on another: delete the venv and rebuild there. Not -DGGML_NATIVE=ON: -march=native also compiles ggml's AMX kernels (cpuinfo lists
# amx_tile/int8/bf16 here), and their first `ldtilecfg` kills the server with SIGSEGV in ggml_backend_amx_mul_mat on
# this VM as soon as a prompt of 2+ tokens is decoded (seen with 0.3.36; one-token prompts pass).
#
# Idempotent: does nothing when .peers/llamacpp/.installed exists and `import llama_cpp` reports 0.3.36.
# Usage: bench/peer_setup_llamacpp.sh [VENV_DIR]   (default .peers/llamacpp)
# Env: PYTHON (default python3), CMAKE_ARGS (default: the ISA list below), CMAKE_BUILD_PARALLEL_LEVEL (default nproc).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${1:-.peers/llamacpp}
PYTHON=${PYTHON:-python3}
LLAMACPP_VERSION="0.3.36"
LLAMACPP_REQ="llama-cpp-python[server]==$LLAMACPP_VERSION"
STAMP="$VENV/.installed"

if [[ -f "$STAMP" ]] && "$VENV/bin/python" -c \
  "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMACPP_VERSION')" 2>/dev/null
then
  echo "peer_setup_llamacpp: $VENV already has llama-cpp-python $LLAMACPP_VERSION"
  exit 0
fi

# The ggml ISA switches from this CPU's flags (what -march=native would pick, AMX left out: see above).
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
ISA="-DGGML_NATIVE=OFF"
for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
  avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
  if [[ $flags == *" ${pair%%:*} "* ]]; then ISA+=" -DGGML_${pair#*:}=ON"; else ISA+=" -DGGML_${pair#*:}=OFF"; fi
done
ISA+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
export CMAKE_ARGS=${CMAKE_ARGS:-$ISA}
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export CMAKE_BUILD_PARALLEL_LEVEL
echo "peer_setup_llamacpp: building $LLAMACPP_REQ with CMAKE_ARGS='$CMAKE_ARGS' on $CMAKE_BUILD_PARALLEL_LEVEL jobs"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
start=$SECONDS
"$VENV/bin/pip" install --progress-bar off --no-cache-dir "$LLAMACPP_REQ"
echo "peer_setup_llamacpp: built in $((SECONDS - start)) s"
"$VENV/bin/python" -c 'import llama_cpp, llama_cpp.server; print("peer_setup_llamacpp: llama-cpp-python", llama_cpp.__version__)'
touch "$STAMP"
