#!/usr/bin/env bash
# The test command of the README and of CI: builds the library (with the
# CUDA backend when nvcc and a GPU are present, for that GPU; or, GPU or
# not, for the architectures in $LMLOSS_CUDA_ARCHITECTURES, e.g. 90: CI's),
# runs the C tests (ctest), the Python
# tests (pytest), checks that `pip install .` gives a working package, that
# `cmake --install` gives one that examples/hello builds against (CMake's
# find_package and pkg-config), that the wheel of tools/build_wheel.sh (PyPI's
# OpenBLAS, auditwheel) passes the NumPy tests in a clean venv, and runs the
# C tests again under AddressSanitizer + UBSan.
# Python: python3 ($PYTHON), or, where its pip refuses to install numpy,
# pytest and ml_dtypes (PEP 668: Debian's and Ubuntu's system Python), a
# venv in build/venv that sees the system's packages.
# GPU: LMLOSS_TEST_BACKEND=cuda runs the same C suite on the CUDA backend.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

py=${PYTHON:-python3}
if ! "$py" -c "import numpy, pytest, ml_dtypes" 2>/dev/null &&
  ! "$py" -m pip install -q numpy pytest ml_dtypes 2>/dev/null; then
  echo "== $py cannot pip install (PEP 668?): a venv in build/venv"
  [ -x build/venv/bin/python ] || "$py" -m venv --system-site-packages build/venv
  py=$PWD/build/venv/bin/python
  "$py" -c "import numpy, pytest, ml_dtypes" 2>/dev/null ||
    "$py" -m pip install -q numpy pytest ml_dtypes
fi

echo "== build (Release)"
# passed even when empty, so that a value cached by an earlier run is reset
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release \
  -DLMLOSS_CUDA_ARCHITECTURES="${LMLOSS_CUDA_ARCHITECTURES:-}" | { grep "lmloss:" || true; }
cmake --build build -j"$jobs"

echo "== C tests"
ctest --test-dir build --output-on-failure -j"$jobs"

echo "== Python tests"
LMLOSS_LIBRARY="$PWD/build/liblmloss.so" PYTHONPATH="$PWD/python" "$py" -m pytest -q tests/python

echo "== pip install ."
venv=$(mktemp -d)
"$py" -m venv "$venv"
"$venv/bin/pip" install -q numpy . --config-settings=cmake.define.LMLOSS_CUDA=OFF
(cd "$venv" && "$venv/bin/python" -c "import lmloss, numpy as np; \
x = np.zeros((2, 5), np.float32); x[:, 1] = 40; \
print('installed lmloss', lmloss.__version__, 'loss', lmloss.cross_entropy(x, np.array([1, 1])))")
rm -rf "$venv"

echo "== cmake --install, examples/hello against it (find_package, pkg-config)"
prefix=$(mktemp -d)
cmake --install build --prefix "$prefix" >/dev/null
cmake -S examples/hello -B "$prefix/build-hello" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$prefix/build-hello" >/dev/null
"$prefix/build-hello/hello"
# shellcheck disable=SC2046 # pkg-config's flags are words
cc -std=c11 -O2 examples/hello/main.c -o "$prefix/hello-pc" \
  $(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --cflags --libs lmloss) -lm \
  -Wl,-rpath,"$prefix/lib"
"$prefix/hello-pc" | tail -n 1
for exe in "$prefix/build-hello/hello" "$prefix/hello-pc" "$prefix/bin/lmloss"; do
  ldd "$exe" | grep "liblmloss.so.* => $prefix/" >/dev/null ||
    { echo "$exe does not load the installed liblmloss"; exit 1; }
done
if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
  echo "== examples/mpi: vocab-parallel CE, log-probs + entropy, softmax and its backward, JSD, the fused head over 2, 3 and 4 MPI ranks, against the installed package"
  cmake -S examples/mpi -B "$prefix/build-mpi" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
  cmake --build "$prefix/build-mpi" >/dev/null
  for np in 2 3 4; do
    mpirun --allow-run-as-root --oversubscribe -np "$np" "$prefix/build-mpi/vocab_parallel" |
      tail -n 5
  done
else
  echo "== examples/mpi skipped: no mpicc/mpirun (Debian: openmpi-bin libopenmpi-dev)"
fi
rm -rf "$prefix"

echo "== wheel (tools/build_wheel.sh) in a clean venv: the NumPy tests"
whl=$(mktemp -d)
LMLOSS_WHEEL_CUDA= PYTHON="$py" bash tools/build_wheel.sh "$whl/dist" >"$whl/log" 2>&1 ||
  { cat "$whl/log"; exit 1; }
grep "^Fixed-up" "$whl/log"
"$py" -m venv "$whl/venv"
"$whl/venv/bin/pip" install -q --disable-pip-version-check "$whl"/dist/lmloss-*-manylinux*.whl \
  pytest ml_dtypes
# The package and its OpenBLAS from the venv, not from python/ or the system.
(cd "$whl" && env -u LMLOSS_LIBRARY -u PYTHONPATH "$whl/venv/bin/python" -c "import lmloss, numpy as np
x = np.zeros((4, 64), np.float32); x[:, 3] = 30
h = np.ones((4, 8), np.float32); w = np.ones((64, 8), np.float32)
lmloss.cross_entropy(x, np.array([3] * 4)); lmloss.linear_cross_entropy(h, w, np.array([3] * 4))
blas = sorted({l.split()[-1] for l in open('/proc/self/maps') if 'openblas' in l})
assert lmloss.library_path.startswith('$whl/venv/'), lmloss.library_path
assert blas and all(b.startswith('$whl/venv/') for b in blas), blas
print('wheel lmloss', lmloss.__version__, 'from', lmloss.library_path, 'BLAS', blas)")
env -u LMLOSS_LIBRARY -u PYTHONPATH "$whl/venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/python/{test_package,test_cross_entropy,test_log_probs,test_softmax,test_linear,test_errors}.py
rm -rf "$whl"

echo "== C tests under AddressSanitizer + UBSan"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DLMLOSS_SANITIZE=ON -DLMLOSS_CUDA=OFF >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan --output-on-failure -j"$jobs"

# ---- fuzz (fuzz/run.sh: libFuzzer targets of every entry point family,
# 20 s each from a fixed seed, so a red run is repeatable and not a new
# input's luck; it prints why and skips where clang or libFuzzer is missing)
echo "== fuzz"
if command -v clang-14 >/dev/null || command -v clang >/dev/null; then
  FUZZ_SEED=1 bash fuzz/run.sh 20
else
  echo "fuzz: no clang: skipped"
fi
