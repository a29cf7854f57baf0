#!/bin/sh
# ab_gpu.sh - A/B of a CUDA change in one GPU call: A is this tree, B is
# this tree with a patch applied (the GPU machine gets no .git, so make
# the patch here: git diff main BRANCH > ab.patch). Both are built side by
# side, B's C suite runs on CUDA with racecheck on test_ce, then every
# bandwidth case of the issue (the forward kernels too: they share the
# row code) runs B, A, B, A (two rounds: the spread is the noise). Every
# step writes to $OUT as it goes, so a time-out keeps what ran.
#   OUT=... sh bench/ab_gpu.sh ab.patch
#   AB_TESTS="test_ce test_logprob" ...   only these C tests on B (device
#                                         time: the whole suite takes
#                                         about two minutes)
set -u
cd "$(dirname "$0")/.."
PATCH=${1:?usage: bench/ab_gpu.sh PATCH}
OUT=${OUT:-gpu-out}
B_TREE=/tmp/ab-b
mkdir -p "$OUT" "$B_TREE"
cp -r CMakeLists.txt include src tests tools "$B_TREE"/ && patch -s -d "$B_TREE" -p1 <"$PATCH" ||
  exit 1
build() {
  cmake -S "$1" -B "$1/build-gpu" -DCMAKE_BUILD_TYPE=Release -DLMLOSS_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null 2>&1 &&
    cmake --build "$1/build-gpu" -j "$2" 2>&1 | grep -E "error|warning: "
}
build "$B_TREE" "$(nproc)"
build . "$(nproc)" &
A=./build-gpu B=$B_TREE/build-gpu
for t in ${AB_TESTS:-$(cd "$B" && ls test_*)}; do
  t=$B/$t
  LMLOSS_TEST_BACKEND=cuda timeout 120 "$t" >"$OUT/B-$(basename "$t").log" 2>&1
  echo "B $(basename "$t"): rc $?, $(grep -c '^ok' "$OUT/B-$(basename "$t").log") ok," \
    "$(grep -c '^FAIL' "$OUT/B-$(basename "$t").log") failed" | tee -a "$OUT/ab.txt"
done
LMLOSS_TEST_BACKEND=cuda timeout 60 compute-sanitizer --tool racecheck --error-exitcode 99 \
  "$B/test_ce" 2>&1 | grep -E "RACECHECK SUMMARY|^FAIL" | tee -a "$OUT/ab.txt"
wait
for round in 1 2; do
  for side in B A; do
    L=$A
    [ "$side" = B ] && L=$B
    echo "== $side, round $round" >>"$OUT/ab.txt"
    for shape in 8192,152064 4096,32768; do
      $L/lmloss bench logprob logprob-entropy ce-grad logprob-bwd --plain --device cuda \
        --dtype bf16 --shape $shape 2>/dev/null | grep cuda >>"$OUT/ab.txt"
    done
    $L/lmloss bench softmax --device cuda --dtype f32 --shape 4096,262144 2>/dev/null |
      grep cuda >>"$OUT/ab.txt"
  done
done
cat "$OUT/ab.txt"
