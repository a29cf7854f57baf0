/*
 * dispatch.h - LMLOSS_CPU_DISPATCH: a function compiled once per x86-64
 * level (AVX-512, x86-64-v3 = AVX2 + FMA, portable), the dynamic loader
 * picking one through an ifunc. Never -march=native: the shipped library
 * runs on any x86-64. Each name is one clone: "avx2,fma" made two, and
 * the AVX2 one called libm's fmaf (an AVX2 EPYC ran the log-probs at
 * 4096 x 32768 in 2524 ms, 596-720 ms as x86-64-v3, 133-147 ms once its
 * row loops vectorized: -fno-trapping-math, CMakeLists.txt).
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
