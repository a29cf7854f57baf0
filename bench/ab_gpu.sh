#!/bin/sh
# ab_gpu.sh - A/B of a CUDA change in one GPU call: A is this tree, B the
# baseline, this tree with a patch applied (the GPU machine gets no .git,
# so make the patch here: git diff HEAD BASE -- CMakeLists.txt cmake src
# include tests/c tools > ab.patch against a commit, git diff -R -- src > ab.patch against HEAD when A is uncommitted
# work). Both are built side by side, A's C suite runs on CUDA, then every
# bandwidth case of the issue (and CE / log-probs backward with the
# default options, the softmax once, the fused head at the end) runs B, A,
# B, A: two rounds, whose spread is the noise (fp32 rows of 262144 with the
# options too, the staged plan's widest chunks). Every step writes to $OUT
# as it goes, so a time-out keeps what ran, with the time of each stage.
# Measured (ninth session, split compilation, 16 cores): the two builds
# 4 min 21 s, A's suite 21 s; the whole script and one minute of
# compute-sanitizer took 590 s of a call's 600, so trim with:
#   OUT=... sh bench/ab_gpu.sh ab.patch
#   AB_TESTS="test_ce test_logprob" ...   only these C tests on A
#   AB_OPS="ce-grad logprob-bwd" ...      only these ops in the rounds
#   AB_HEAD=0 ...                         no fused-head pair
set -u
cd "$(dirname "$0")/.."
PATCH=${1:?usage: bench/ab_gpu.sh PATCH}
OUT=${OUT:-gpu-out}
B_TREE=/tmp/ab-b
mkdir -p "$OUT" "$B_TREE"
cp -r CMakeLists.txt $( [ -d cmake ] && echo cmake) include src tests tools "$B_TREE"/ && patch -s -d "$B_TREE" -p1 <"$PATCH" ||
  exit 1
build() {
  cmake -S "$1" -B "$1/build-gpu" -DCMAKE_BUILD_TYPE=Release -DLMLOSS_CUDA=ON \
    -DLMLOSS_CUDA_ARCHITECTURES=90 >/dev/null 2>&1 &&
    cmake --build "$1/build-gpu" -j "$(($(nproc) / 2))" 2>&1 | grep -E "error|warning: "
}
date >>"$OUT/ab.txt"
build . &
build "$B_TREE" &
wait
date >>"$OUT/ab.txt"
A=./build-gpu B=$B_TREE/build-gpu
OPS=${AB_OPS:-ce-grad logprob-bwd logprob logprob-entropy}
for t in ${AB_TESTS:-$(cd "$A" && ls test_*)}; do
  LMLOSS_TEST_BACKEND=cuda timeout 120 "$A/$t" >"/tmp/A-$t.log" 2>&1
  echo "A $t: rc $?, $(grep -c '^ok' "/tmp/A-$t.log") ok, $(grep -c '^FAIL' "/tmp/A-$t.log") failed" |
    tee -a "$OUT/ab.txt"
  grep -A2 '^FAIL' "/tmp/A-$t.log" | tee -a "$OUT/ab.txt"
done
date >>"$OUT/ab.txt"
run() { timeout 60 "$@" 2>/dev/null | grep cuda >>"$OUT/ab.txt"; }
for round in 1 2; do
  for side in B A; do
    L=$A
    [ "$side" = B ] && L=$B
    echo "== $side, round $round" >>"$OUT/ab.txt"
    for shape in 8192,152064 4096,32768; do
      run $L/lmloss bench $OPS --plain --device cuda --queue 5 --dtype bf16 --shape $shape
    done
    run $L/lmloss bench ce-grad logprob-bwd --device cuda --dtype bf16 --shape 8192,152064
    # fp32 rows past 16 x 48 KB: the staged plan's widest chunks
    run $L/lmloss bench ce-grad logprob-bwd --device cuda --queue 5 --dtype f32 --shape 4096,262144
    [ $round = 1 ] && run $L/lmloss bench softmax --device cuda --dtype f32 --shape 4096,262144
  done
  date >>"$OUT/ab.txt"
done
[ "${AB_HEAD:-1}" = 0 ] || for side in B A; do
  L=$A
  [ "$side" = B ] && L=$B
  echo "== $side, fused head" >>"$OUT/ab.txt"
  run $L/lmloss bench linear-ce --plain --device cuda --dtype bf16 --reps 3
done
cat "$OUT/ab.txt"
