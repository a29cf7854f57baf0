/*
 * rowpass.h - the CPU backend's per-row passes, compiled once per ISA
 * (AVX-512, AVX2, portable) and chosen at load time by the CPU.
 *
 * A row is processed in blocks of LMLOSS_CPU_BLOCK elements: the block is
 * converted to fp32 w values (transform applied) in an L1-resident buffer,
 * then a vectorized max, then a vectorized exp-sum relative to the block
 * max; block states merge through lmloss_rowstat_merge. Summing in blocks
 * and merging keeps the fp32 sums near 1e-7 relative on 10^5-wide rows.
 */
#ifndef LMLOSS_CPU_ROWPASS_H
#define LMLOSS_CPU_ROWPASS_H

#include "math/rowstate.h"

#define LMLOSS_CPU_BLOCK 2048

/* The state of a row's V columns, which are columns [col0, col0 + V) of
 * the vocabulary (its argmax a vocabulary column). cw: these columns'
 * class weights or NULL (all 1). need_t / need_u request the entropy and
 * smoothing sums. label: a vocabulary column whose w the state carries
 * when it lies in these columns (-1: none). Flags: NONFINITE when the row
 * holds a NaN or +inf, LOGIT when it holds a logit above -inf. A -inf
 * enters the sums as softcap(-inf) = -cap with softcap on, and adds
 * nothing without (a row of only -inf leaves the sums empty). */
lmloss_rowstate lmloss_cpu_row_state(const void *row, lmloss_dtype dt, int64_t V, int64_t col0,
                                     const lmloss_xform *f, const float *cw, int need_t, int need_u,
                                     int64_t label);

/* The gradient shape shared by every op on this backend, in x units:
 *   out_j = (e_j (P + P2 dk_j) - Q c_j) dz/dx_j,
 *   dk_j = (w_j - m) k,  e_j = exp(dk_j),  c_j = cw[j] or 1.
 * Callers then overwrite the few entries (target, indices, argmax) whose
 * exact form differs. */
void lmloss_cpu_row_grad(const void *row, lmloss_dtype dt, int64_t V, const lmloss_xform *f,
                         const float *cw, float m, float P, float P2, float Q, void *out,
                         lmloss_dtype odt);

/* out_j = e_j * P (softmax, P = 1 / (1 + R)) or dk_j - P (log, P = log1p R). */
void lmloss_cpu_row_softmax(const void *row, lmloss_dtype dt, int64_t V, float m, float P, int log,
                            void *out, lmloss_dtype odt);

/* The first column at the row's max; NaN is never one, and a row
 * without a number above -inf gives 0. */
int64_t lmloss_cpu_row_argmax(const void *row, lmloss_dtype dt, int64_t V);

/* The softmax backward's row sums over the columns other than a (-1:
 * every column), each term in fp32, the sums in double (they cancel):
 * log, sum dy_k; softmax, sum y_k (s - dy_k), and sum y_k into *sy. */
double lmloss_cpu_row_softmax_bwd_sum(const void *y, lmloss_dtype ydt, const void *dy,
                                      lmloss_dtype gdt, int64_t V, int64_t a, float s, int log,
                                      double *sy);

/* The softmax backward of every column: y_j ((dy_j - s) + c), or for log
 * dy_j - exp(y_j) c; the caller forms the argmax's entry. dx may alias
 * dy exactly. */
void lmloss_cpu_row_softmax_bwd(const void *y, lmloss_dtype ydt, const void *dy, lmloss_dtype gdt,
                                int64_t V, float s, float c, int log, void *dx, lmloss_dtype odt);

/* Row of zeros / NaNs in dtype odt. */
void lmloss_cpu_row_fill(void *out, lmloss_dtype odt, int64_t V, float v);

/* Name of the ISA the passes run with. */
const char *lmloss_cpu_isa_name(void);

#endif
