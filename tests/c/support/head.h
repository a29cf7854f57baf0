/*
 * head.h - a fused head's test data and its float64 oracle, shared by the
 * fused-head tests: hidden and weight (optionally peaked rows, a bias),
 * their logits in double, gradients formed in double from dlogits, and
 * the comparisons at the accuracy contract test_fused_linear.c states.
 */
#ifndef LMLOSS_TESTS_HEAD_H
#define LMLOSS_TESTS_HEAD_H

#include "testing.h"

#define FL_TOL 1e-4
#define BF16_FACTOR 2.5
#define ABS_FLOOR ((double)FLT_MIN)

typedef struct {
  int64_t N, V, H0, H;
  lmloss_dtype dt;
  lmloss_tensor hidden, weight, bias; /* host, dtype dt; bias may be absent */
  double *h64, *w64, *b64;            /* the same values in double */
  double *x64;                        /* logits [N, V] in double */
  lmloss_tensor logits;               /* x64 rounded to F32: REF's input */
} head_data;

void *xcalloc(size_t n, size_t size); /* exits 1 when out of memory */
/* With peak, H = H0 + N: row i owns hidden dimension H0 + i, so that
 * peak[i] >= 0 makes row i's target lead the others by margin (margin >=
 * 0); without, H = H0. pad: extra elements a row (garbage). */
void head_new(head_data *hd, int64_t N, int64_t V, int64_t H0, lmloss_dtype dt, int bias,
              int64_t pad, const int64_t *peak, double margin, double sigma);
void head_free(head_data *hd);
/* Exact gradients from dlogits [N, V]: dh [N, H], dw [V, H], db [V]. */
void grad_oracle(const head_data *hd, const lmloss_tensor *dl, double *dh, double *dw, double *db);
double to_bf16(double v);
double *to_f64(const lmloss_tensor *t);
void note(tgroup *g, double err, double ref);
/* Every row of got [rows, cols] within tol of ref (relative norm of the row). */
void rows_close(tgroup *g, const lmloss_tensor *got, const double *ref, double tol,
                const char *what);
/* Whole tensor, Frobenius: within tol relative, or (bf16 > 0) within
 * BF16_FACTOR times the error of rounding ref to bf16. */
void tensor_close(tgroup *g, const lmloss_tensor *got, const double *ref, double tol, int bf16,
                  const char *what);
void all_zero(tgroup *g, const lmloss_tensor *t, const char *what);
/* Gradient tensors against the exact ones from dlogits dl. */
void grads_close(tgroup *g, const head_data *hd, const lmloss_tensor *dh, const lmloss_tensor *dw,
                 const lmloss_tensor *db, const lmloss_tensor *dl);
/* Worst err / (bf16 rounding error) of dhidden, dweight, dbias over the run. */
extern double bf16_worst[3];

#endif
