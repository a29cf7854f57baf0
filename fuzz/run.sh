#!/usr/bin/env bash
# Builds the fuzz targets (libFuzzer, AddressSanitizer + UBSan, clang) with
# the library's CPU and REF sources compiled in, and runs each for SECONDS
# (default 20) from its seed corpus under fuzz/corpus/<target>. New inputs
# go to a scratch copy, so the committed corpus changes only by hand; a
# crash leaves its input in build-fuzz/ and fails the script.
#   bash fuzz/run.sh [SECONDS] [TARGET...]
# FUZZ_SEED fixes libFuzzer's seed (tests/run.sh does, so a CI run is
# repeatable); unset, every run explores from a new one.
# CC (default clang-14, else clang) needs libFuzzer (Debian:
# libclang-rt-dev); without it, or without clang, the script says so and
# skips. Without clang's OpenMP (libomp-dev) the library's OpenMP pragmas
# are left out and its few omp_* calls go to gcc's libgomp.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-20}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(fuzz_ce fuzz_logprob fuzz_softmax fuzz_shard fuzz_fused_linear fuzz_divergence
                                  fuzz_objectives)

cc=${CC:-}
if [ -z "$cc" ]; then
  for c in clang-14 clang; do command -v "$c" >/dev/null && cc=$c && break; done
fi
if [ -z "$cc" ]; then
  echo "fuzz: no clang found: skipped (install clang, libclang-rt-dev and libomp-dev)"
  exit 0
fi

out=build-fuzz
mkdir -p "$out"
probe='#include <stdint.h>
#include <stddef.h>
int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { return 0; }'
if ! echo "$probe" | $cc -fsanitize=fuzzer,address,undefined -x c - -o "$out/probe" 2>/dev/null; then
  echo "fuzz: $cc cannot build a libFuzzer target (install libclang-rt-dev): skipped"
  exit 0
fi
omp=-fopenmp
omplib=
if ! printf '#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n' |
  $cc -fopenmp -x c - -o "$out/probe" 2>/dev/null; then
  mkdir -p "$out/omp-include"
  ln -sf "$(gcc -print-file-name=include/omp.h)" "$out/omp-include/omp.h"
  omp="-I$out/omp-include"
  omplib=-lgomp
fi
blas_pc=/usr/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)/openblas-openmp/pkgconfig
blas=$(PKG_CONFIG_PATH="$blas_pc:${PKG_CONFIG_PATH:-}" pkg-config --cflags --libs openblas)
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# -Wno-pass-failed: clang does not vectorize the loops gcc does; no matter here
cflags="-std=c11 -O1 -g $omp -fno-trapping-math -Wno-pass-failed -Iinclude -Isrc -DLMLOSS_BUILDING $san"

# The library once, with the sanitizers and libFuzzer's coverage hooks
# (its objects kept per compiler and flags).
obj="$out/obj-$(echo "$cc $cflags" | md5sum | cut -c1-8)"
mkdir -p "$obj"
objs=()
for src in src/core/*.c src/ref/*.c src/cpu/*.c; do
  o="$obj/$(echo "$src" | tr / _).o"
  if [ ! -e "$o" ] || [ "$src" -nt "$o" ] || [ -n "$(find src include -newer "$o" -name '*.h' | head -1)" ]; then
    $cc $cflags -fsanitize=fuzzer-no-link -c "$src" -o "$o"
  fi
  objs+=("$o")
done

fail=0
for t in "${targets[@]}"; do
  $cc $cflags -fsanitize=fuzzer "fuzz/$t.c" "${objs[@]}" $blas $omplib -lm -o "$out/$t"
  work="$out/corpus-$t"
  rm -rf "$work" && mkdir -p "$work"
  [ -d "fuzz/corpus/$t" ] && cp "fuzz/corpus/$t"/* "$work"/ 2>/dev/null || true
  echo "== fuzz $t (${secs} s)"
  # a context that asks for no thread count gets one, and OpenBLAS one
  if ! OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
    ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
    UBSAN_OPTIONS=print_stacktrace=1 \
    "$out/$t" -seed="${FUZZ_SEED:-0}" -max_total_time="$secs" -max_len=4096 -timeout=10 -rss_limit_mb=4096 \
    -artifact_prefix="$out/$t-" -print_final_stats=0 "$work" 2>"$out/$t.log"; then
    tail -40 "$out/$t.log"
    echo "fuzz: $t FAILED; the input is $(ls -t "$out/$t"-* 2>/dev/null | head -1)"
    fail=1
  else
    grep -E "^Done [0-9]+ runs" "$out/$t.log" | tail -1 || true
  fi
done
exit $fail
