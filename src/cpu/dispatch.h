/*
 * dispatch.h - LMLOSS_CPU_DISPATCH: a function compiled once per x86-64
 * level (AVX-512, x86-64-v3 = AVX2 + FMA, portable), the dynamic loader
 * picking one through an ifunc. Never -march=native: the shipped library
 * runs on any x86-64. Each name is one clone: "avx2,fma" made two, and
 * the AVX2 one called libm's fmaf, several times slower than the
 * x86-64-v3 clone, which in turn needed -fno-trapping-math
 * (CMakeLists.txt) before its row loops vectorized (the figures are in
 * docs/benchmarks-history.md).
 * lmloss_cpu_isa_name (rowpass.c) asks the loader's questions in the same
 * order: change the two together.
 */
#ifndef LMLOSS_CPU_DISPATCH_H
#define LMLOSS_CPU_DISPATCH_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LMLOSS_CPU_DISPATCH __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define LMLOSS_CPU_DISPATCH
#endif

#endif
