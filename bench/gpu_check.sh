#!/bin/sh
# gpu_check.sh - on a GPU machine: build (Release, sm_90), run the C test
# suite against the CUDA backend, then the benchmark.
#   bench/gpu_check.sh            build + ctest (LMLOSS_TEST_BACKEND=cuda) + bench_cuda
#   bench/gpu_check.sh sanitize   build + every test executable under
#                                 compute-sanitizer memcheck and racecheck
# BUILD (default build-gpu) names the build folder.
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLMLOSS_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
cmake --build "$BUILD" -j "$(nproc)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv || true

if [ "${1:-}" = "sanitize" ]; then
  status=0
  for t in "$BUILD"/test_*; do
    [ -x "$t" ] || continue
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer --tool $tool $t"
      LMLOSS_TEST_BACKEND=cuda compute-sanitizer --tool "$tool" --error-exitcode 99 "$t" ||
        status=1
    done
  done
  exit $status
fi

status=0
LMLOSS_TEST_BACKEND=cuda ctest --test-dir "$BUILD" --output-on-failure || status=1
"$BUILD"/bench_cuda || status=1
exit $status
