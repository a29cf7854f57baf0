/*
 * testing.h - shared harness of the C tests.
 *
 * Backend under test: environment variable LMLOSS_TEST_BACKEND = cpu
 * (default) or cuda. For cuda the inputs are copied to the GPU through
 * libcudart loaded with dlopen (the tests need no CUDA headers); when no
 * libcudart, no GPU or no CUDA backend is there, the test FAILS (exit 1),
 * it never skips. The oracle is always LMLOSS_BACKEND_REF on the same
 * (already rounded) inputs in host memory.
 *
 * Tolerances, written once here and never loosened. For an output entry
 * with reference value r (the REF result rounded once to the output dtype)
 * the result g passes when
 *
 *   |g - r| <= TOL_REL |r| + TOL_FLOOR + ulp_dt(r) + cancel
 *
 *   TOL_REL   = 1e-5          (fp32 accumulation: relative)
 *   TOL_FLOOR = 2^-126        (FLT_MIN, the documented underflow floor)
 *   ulp_dt(r) = 0 for F32 outputs; for BF16/F16 outputs one ulp of that
 *               dtype at r (relative 2^-8..2^-7 for bf16, 2^-11..2^-10
 *               for fp16; 2^-133 / 2^-24 in their subnormal ranges)
 *   cancel    = inherent-cancellation floor, TOL_REL times the magnitude of
 *               the terms that the exact result subtracts:
 *               CE gradient with label smoothing: TOL_REL |B_j| (at the
 *                 argmax entry |A - B_a|), B_j = c_y (1 - e)[j == y] +
 *                 e c_j / V, A = c_y (1 - e) + e C / V, times the row's
 *                 gradient scale (token weight, reduction factor, upstream
 *                 gradient, dz/dx);
 *               log-probs backward: TOL_REL (|D_j| + p_j sum_k |dlogp_k| +
 *                 |dH| p_j (|log p_j| + H)) times dz/dx, and at an argmax
 *                 entry with p_a > 1/2 (formed as minus the others' sum)
 *                 the sum of the other entries' floors;
 *               softmax backward: TOL_REL y_j (|dy_j| + sum_k |dy_k| y_k),
 *                 log-softmax backward: TOL_REL (|dy_j| + exp(y_j) sum_k |dy_k|),
 *                 and at the argmax entry the sum of the others' floors;
 *               0 everywhere else.
 * NaN references require NaN, infinite ones the same infinity.
 */
#ifndef LMLOSS_TESTS_TESTING_H
#define LMLOSS_TESTS_TESTING_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lmloss.h"

#define TOL_REL 1e-5
#define TOL_FLOOR ((double)FLT_MIN)
#define TOL_CANCEL TOL_REL

/* ---- case groups: one summary line each, worst relative error ---- */
typedef struct {
  const char *name;
  long checks, fails;
  double worst; /* worst |g - r| / |r| over entries with |r| > TOL_FLOOR */
} tgroup;

void tg_begin(tgroup *g, const char *name);
void tg_end(tgroup *g); /* prints the summary line, adds to the exit code */
/* Compare got with ref (ref already rounded to dt); extra = cancel floor. */
int tg_close(tgroup *g, double got, double ref, lmloss_dtype dt, double extra, const char *what,
             int64_t i, int64_t j);
int tg_true(tgroup *g, int cond, const char *fmt, ...);
int test_finish(void); /* exit status: 1 when anything failed */
double ulp_of(double r, lmloss_dtype dt);

/* ---- random numbers ---- */
void rng_seed(uint64_t s);
double rng_uniform(void); /* [0, 1) */
double rng_normal(void);
int64_t rng_int(int64_t n); /* [0, n) */

/* ---- host tensors ---- */
size_t tensor_bytes(const lmloss_tensor *t);
lmloss_tensor host_new(lmloss_dtype dt, int64_t rows, int64_t cols, int64_t stride);
void host_poison(lmloss_tensor *t); /* fills every byte with 0x5a */
lmloss_tensor host_clone(const lmloss_tensor *t);
void host_free(lmloss_tensor *t);
void tset(const lmloss_tensor *t, int64_t i, int64_t j, double v); /* rounds to dtype */
double tget(const lmloss_tensor *t, int64_t i, int64_t j);
int same_bytes(const lmloss_tensor *a, const lmloss_tensor *b); /* whole span */
/* A softmax backward's dx (got) against ref, entry by entry (tg_close as
 * "dx"), with the softmax backward's cancellation floors above at tol
 * (TOL_CANCEL, or coarser where the inputs carry their own rounding),
 * from the forward's y and the upstream dy; log: log-softmax. */
void tg_close_softmax_grad(tgroup *g, const lmloss_tensor *got, const lmloss_tensor *ref,
                           const lmloss_tensor *y, const lmloss_tensor *dy, int log, double tol);
const char *dt_name(lmloss_dtype dt);

/* ---- backend under test ---- */
void tb_init(void); /* reads LMLOSS_TEST_BACKEND; exits 1 on a missing GPU */
int tb_is_cuda(void);
lmloss_context tb_ctx(void);  /* the backend under test */
lmloss_context ref_ctx(void); /* LMLOSS_BACKEND_REF */
const char *tb_name(void);
/* Copy of a host tensor in the memory of the backend under test (absent
 * stays absent), back to the host, and release. */
lmloss_tensor dev_clone(const lmloss_tensor *host);
void dev_fetch(lmloss_tensor *host, const lmloss_tensor *dev);
void dev_put(void *dev_dst, const void *host_src, size_t n); /* n bytes, host to device */
void dev_free(lmloss_tensor *dev);
void *dev_alloc_bytes(size_t n);
void dev_free_bytes(void *p);

/* ---- logits ---- */
/* Row i: N(0, sigma) logits; when target is given and margin >= 0, the
 * target logit becomes the max of the others plus margin. */
void fill_logits(const lmloss_tensor *x, double sigma, const int64_t *target, double margin);

/* Vocabulary shards for the tests of the row contract: k (<= 8) uneven
 * shards of V columns at distinct random cuts, and columns [c0, c0 + n)
 * (rows [r0, r0 + n): a shard of a head's weight) of a tensor as a view;
 * an absent tensor stays absent. */
typedef struct {
  int k;
  int64_t col0[8], n[8];
} split;
split make_split(int64_t V, int k);
lmloss_tensor cols_view(const lmloss_tensor *t, int64_t c0, int64_t n);
lmloss_tensor rows_view(const lmloss_tensor *t, int64_t r0, int64_t n);

#endif
