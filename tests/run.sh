#!/usr/bin/env bash
# The test command of the README and of CI: builds the library (with the
# CUDA backend when nvcc and a GPU are present, for that GPU; or, GPU or
# not, for the architectures in $LMLOSS_CUDA_ARCHITECTURES, e.g. 90: CI's),
# runs the C tests (ctest), the Python
# tests (pytest), checks that `pip install .` gives a working package, and
# runs the C tests again under AddressSanitizer + UBSan.
# GPU: LMLOSS_TEST_BACKEND=cuda runs the same C suite on the CUDA backend.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

python3 -c "import numpy, pytest, ml_dtypes" 2>/dev/null ||
  python3 -m pip install -q numpy pytest ml_dtypes

echo "== build (Release)"
# passed even when empty, so that a value cached by an earlier run is reset
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release \
  -DLMLOSS_CUDA_ARCHITECTURES="${LMLOSS_CUDA_ARCHITECTURES:-}" | { grep "lmloss:" || true; }
cmake --build build -j"$jobs"

echo "== C tests"
ctest --test-dir build --output-on-failure -j"$jobs"

echo "== Python tests"
LMLOSS_LIBRARY="$PWD/build/liblmloss.so" PYTHONPATH="$PWD/python" python3 -m pytest -q tests/python

echo "== pip install ."
venv=$(mktemp -d)
python3 -m venv "$venv"
"$venv/bin/pip" install -q numpy . --config-settings=cmake.define.LMLOSS_CUDA=OFF
(cd "$venv" && "$venv/bin/python" -c "import lmloss, numpy as np; \
x = np.zeros((2, 5), np.float32); x[:, 1] = 40; \
print('installed lmloss', lmloss.__version__, 'loss', lmloss.cross_entropy(x, np.array([1, 1])))")
rm -rf "$venv"

echo "== C tests under AddressSanitizer + UBSan"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DLMLOSS_SANITIZE=ON -DLMLOSS_CUDA=OFF >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan --output-on-failure -j"$jobs"
