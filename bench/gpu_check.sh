#!/bin/sh
# gpu_check.sh - everything the GPU machine is needed for, in one call:
# build (Release, sm_90), the C test suite against the CUDA backend,
# `lmloss check` on CPU and CUDA, the issue's CUDA benchmark cases
# (`lmloss bench`), the peer comparison and the collapse picture (Python,
# with the peers' wheels installed from .whl/), and the GPU-only Python
# tests. Logs and figures go to $OUT (or ./gpu-out); every step writes its
# file as it goes, so a time-out keeps what ran. The peers need the `run`
# call to carry .whl/.
#   bench/gpu_check.sh            all of the above
#   bench/gpu_check.sh sanitize   the CUDA test executables under
#                                 compute-sanitizer memcheck and racecheck
#   bench/gpu_check.sh final      tests (C and the CUDA pytest), check, the
#                                 issues' benchmarks, the torch-layer host
#                                 time, peers, sanitizer samples; time-boxed
#   bench/gpu_check.sh head       the fused head alone: the C tests of it
#                                 and of the row ops it drives, memcheck on
#                                 its test, its benchmarks, the CE and
#                                 log-probs gradient kernels, a kernel-by-
#                                 kernel profile of one step, its peers
#   bench/gpu_check.sh kernels    the row kernels alone: their C tests,
#                                 `lmloss check`, the issue's bandwidth
#                                 cases and an ncu summary of each kernel
#   bench/gpu_check.sh pending    what sessions without a GPU built and
#                                 could not run: the C tests of the staged
#                                 fp32 kernels, the shard phases (the
#                                 softmax backward's kernel), the sharded
#                                 fused head and the divergences, memcheck
#                                 on the shard test, racecheck on the
#                                 divergences' test, `lmloss check`, the fp32 rows of 262144
#                                 with options, the divergences in C; the
#                                 DPO head: its C and CUDA pytest tests,
#                                 memcheck; GRPO on logits (the one
#                                 pass's float upstream, stage B's
#                                 512-thread kernel): its C and CUDA
#                                 pytest tests, its bench and profile
#                                 beside plain CE's (`ce-grad`);
#                                 TRL's fused LM head against lmloss's
#                                 stand-in (where TRL imports: its wheel
#                                 in .whl/, `pip download --no-deps trl`)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
BUILD=${BUILD:-build-gpu}
mkdir -p "$OUT"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLMLOSS_CUDA=ON \
  -DLMLOSS_CUDA_ARCHITECTURES=90 >/dev/null || exit 1
cmake --build "$BUILD" -j "$(nproc)" 2>&1 | grep -E "error|warning: " ; [ -x "$BUILD/lmloss" ] || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv

if [ "${1:-}" = "sanitize" ]; then
  status=0
  for t in "$BUILD"/test_*; do
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer --tool $tool $t"
      LMLOSS_TEST_BACKEND=cuda compute-sanitizer --tool "$tool" --error-exitcode 99 "$t" \
        >"$OUT/sanitize-$tool-$(basename "$t").log" 2>&1 || status=1
      tail -3 "$OUT/sanitize-$tool-$(basename "$t").log"
    done
  done
  exit $status
fi

L="$BUILD/lmloss"
bench_rows() { # the issue's cases (--plain: bare CE and log-probs backward), then with options
  for shape in 8192,152064 4096,32768; do
    $L bench logprob logprob-entropy ce-grad logprob-bwd --plain --device cuda --dtype bf16 \
      --shape $shape
    $L bench ce-grad logprob-bwd --device cuda --dtype bf16 --shape $shape
  done
  $L bench softmax --device cuda --dtype f32 --shape 4096,262144
}
python_env() { # lmloss from this build, the peers' wheels from .whl/
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
      export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH="$PWD/python:${PYTHONPATH:-}" LMLOSS_LIBRARY="$PWD/$BUILD/liblmloss.so"
}
if [ "${1:-}" = "final" ]; then # all of the issue's GPU evidence, each step time-boxed
  status=0
  for t in "$BUILD"/test_*; do
    LMLOSS_TEST_BACKEND=cuda timeout 120 "$t" >>"$OUT/tests.log" 2>&1 || status=1
    echo "$(basename "$t"): $(grep -c '^ok' "$OUT/tests.log") ok so far, $(grep -c '^FAIL' "$OUT/tests.log") failed"
  done
  grep -A2 "failed" "$OUT/tests.log" | head -20
  $L check | tail -2 || status=1
  { # the fused head: the issue's dense case, 25% supervised, log-probs + entropy
    bench_rows
    $L bench linear-ce linear-logprob --plain --device cuda --dtype bf16 --reps 3
    $L bench linear-ce --plain --supervised 0.25 --device cuda --dtype bf16 --reps 3
  } 2>/dev/null | tee "$OUT/bench.txt"
  python_env
  timeout 120 python3 -m pytest -q -m cuda tests/python >"$OUT/pytest-cuda.log" 2>&1 || status=1
  tail -2 "$OUT/pytest-cuda.log"
  timeout 60 python3 bench/torch_overhead.py >"$OUT/torch_overhead.txt" 2>&1 || status=1
  head -6 "$OUT/torch_overhead.txt"
  timeout 240 python3 bench/peers_gpu.py --issue --out "$OUT" >"$OUT/peers.log" 2>&1 || status=1
  cat "$OUT/peers.log"
  for run in "racecheck test_ce" "memcheck test_ce" "memcheck test_fused_linear"; do
    set -- $run
    echo "== compute-sanitizer --tool $1 $2" >>"$OUT/sanitize.log"
    LMLOSS_TEST_BACKEND=cuda timeout 40 compute-sanitizer --tool "$1" --error-exitcode 99 \
      "$BUILD/$2" 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^FAIL|^ok" | tail -4 \
      >>"$OUT/sanitize.log"
  done
  cat "$OUT/sanitize.log"
  exit $status
fi

if [ "${1:-}" = "head" ]; then
  status=0
  for t in test_fused_linear test_ce test_logprob test_badinput; do
    LMLOSS_TEST_BACKEND=cuda timeout 150 "$BUILD/$t" >"$OUT/tests.log" 2>&1 || status=1
    echo "$t: $(grep -c '^ok' "$OUT/tests.log") ok, $(grep -c '^FAIL' "$OUT/tests.log") failed"
    grep -A3 -m4 "failed" "$OUT/tests.log"
    grep "^bf16 gradients" "$OUT/tests.log"
  done
  echo "== compute-sanitizer --tool memcheck test_fused_linear"
  LMLOSS_TEST_BACKEND=cuda timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 \
    "$BUILD/test_fused_linear" 2>&1 | grep -E "ERROR SUMMARY|^FAIL" | tail -3 || status=1
  {
    $L bench linear-ce linear-logprob --plain --device cuda --dtype bf16 --reps 3
    $L bench linear-ce --plain --supervised 0.25 --device cuda --dtype bf16 --reps 3
    $L bench ce-grad logprob-bwd --plain --device cuda --dtype bf16 --shape 8192,152064
  } 2>/dev/null | tee "$OUT/bench.txt"
  python_env
  timeout 120 python3 -m pytest -q -m cuda tests/python >"$OUT/pytest-cuda.log" 2>&1 || status=1
  tail -2 "$OUT/pytest-cuda.log"
  timeout 60 python3 bench/profile_gpu.py | tee "$OUT/profile.txt"
  timeout 200 python3 bench/peers_gpu.py --issue --case linear-ce --out "$OUT" \
    >"$OUT/peers.log" 2>&1 || status=1
  cat "$OUT/peers.log"
  exit $status
fi

if [ "${1:-}" = "pending" ]; then
  status=0
  for t in test_grpo test_ce test_logprob test_softmax test_shard test_shard_head \
    test_divergence test_divergence_shard test_linear_preference test_fused_linear; do
    LMLOSS_TEST_BACKEND=cuda timeout 150 "$BUILD/$t" >"$OUT/$t.log" 2>&1 || status=1
    echo "$t: $(grep -c '^ok' "$OUT/$t.log") ok, $(grep -c '^FAIL' "$OUT/$t.log") failed"
    grep -A2 -m3 "mismatch\|failed" "$OUT/$t.log"
  done
  echo "== compute-sanitizer --tool memcheck test_shard"
  LMLOSS_TEST_BACKEND=cuda timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 \
    "$BUILD/test_shard" 2>&1 | grep -E "ERROR SUMMARY|^FAIL" | tail -3 || status=1
  echo "== compute-sanitizer --tool memcheck test_linear_preference (the DPO head)"
  LMLOSS_TEST_BACKEND=cuda timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 \
    "$BUILD/test_linear_preference" 2>&1 | grep -E "ERROR SUMMARY|^FAIL" | tail -3 || status=1
  echo "== compute-sanitizer --tool racecheck test_divergence (the one-sweep statistics)"
  LMLOSS_TEST_BACKEND=cuda timeout 150 compute-sanitizer --tool racecheck --error-exitcode 99 \
    "$BUILD/test_divergence" 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^FAIL" | tail -3 ||
    status=1
  $L check | tail -2 || status=1
  {
    $L bench ce-grad logprob-bwd --device cuda --queue 5 --dtype f32 --shape 4096,262144
    $L bench ce-grad logprob-bwd --plain --device cuda --queue 5 --dtype f32 --shape 4096,262144
    $L bench kl reverse-kl jsd tvd --plain --device cuda --queue 5 --dtype bf16 \
      --shape 8192,152064
    $L bench ce-grad --plain --device cuda --queue 5 --dtype bf16 --shape 8192,152064
  } 2>/dev/null | tee "$OUT/bench-pending.txt"
  python_env
  timeout 120 python3 -m pytest -q -m cuda tests/python/test_linear_dpo.py \
    tests/python/test_torch_cuda.py -k "dpo or grpo" |
    tail -2 || status=1
  (cd bench && timeout 200 python3 grpo_logits_gpu.py --reps 9 --profile) | tee "$OUT/grpo.txt"
  if python3 -c "import trl" 2>/dev/null; then # TRL's fused head against lmloss's stand-in
    (cd bench && timeout 200 python3 trl_head_gpu.py) | tee "$OUT/trl-head.txt"
  fi
  exit $status
fi

if [ "${1:-}" = "kernels" ]; then
  status=0
  for t in test_ce test_logprob test_softmax test_fused_linear; do
    LMLOSS_TEST_BACKEND=cuda "$BUILD/$t" >"$OUT/$t.log" 2>&1 || status=1
    echo "$t: $(grep -c '^ok' "$OUT/$t.log") ok, $(grep -c '^FAIL' "$OUT/$t.log") failed"
    grep -A2 -m3 "failed" "$OUT/$t.log"
  done
  $L check | tail -2 || status=1
  bench_rows 2>/dev/null | tee "$OUT/bench-rows.txt"
  for op in logprob ce-grad logprob-bwd; do
    ncu --clock-control none --section SpeedOfLight --section Occupancy --section SchedulerStats \
      --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats \
      --section SourceCounters --section MemoryWorkloadAnalysis -k regex:'lp_|ce_rows|ce_held' -c 1 \
      "$L" bench $op --plain --device cuda --dtype bf16 --shape 8192,152064 --reps 1 \
      >"$OUT/ncu-$op.txt" 2>&1
  done
  # executed instructions and stall samples per SASS line of the two gradient kernels
  for op in ce-grad logprob-bwd; do
    ncu --clock-control none --section SourceCounters -k regex:'ce_held|lp_held' -c 1 \
      --page source --print-source sass --csv "$L" bench $op --plain --device cuda \
      --dtype bf16 --shape 8192,152064 --reps 1 2>&1 | gzip >"$OUT/ncu-$op-sass.csv.gz"
    python3 bench/sass_stalls.py "$OUT/ncu-$op-sass.csv.gz" --ctas 5 --warps 8 |
      tee "$OUT/sass-stalls-$op.txt"
  done
  grep -hE "^  [a-z_]+<|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Cluster Size|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Executed Ipc A" \
    "$OUT"/ncu-*.txt
  exit $status
fi

status=0
LMLOSS_TEST_BACKEND=cuda ctest --test-dir "$BUILD" --output-on-failure >"$OUT/ctest-cuda.log" 2>&1 ||
  status=1
grep -E "tests passed|FAIL|Failed" "$OUT/ctest-cuda.log" | head -40
"$BUILD/lmloss" check | tee "$OUT/check.log" | tail -3 || status=1
{
  bench_rows
  $L bench linear-ce --device cuda --dtype bf16 --shape 8192,152064,4096 --reps 5
} 2>/dev/null | tee "$OUT/bench-cuda.txt"
python_env
python3 bench/collapse_plot.py --out "$OUT" || status=1
python3 -m pytest -q -m cuda tests/python >"$OUT/pytest-cuda.log" 2>&1 || status=1
tail -3 "$OUT/pytest-cuda.log"
python3 bench/peers_gpu.py --out "$OUT" ${PEERS_ARGS:-} >"$OUT/peers.log" 2>&1 || status=1
tail -25 "$OUT/peers.log"
exit $status
