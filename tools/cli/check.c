/*
 * check.c - `lmloss check`: every op on every available backend against
 * the float64 REF backend, on random rows and on peaked rows (the target
 * leads by 30: where the usual forms collapse), fp32 and bf16. The error
 * of a row is ||got - ref|| / ||ref|| (losses and log-probs entry-wise);
 * the bound is 1e-5 for fp32 outputs and 2^-8 for bf16 ones (one
 * rounding), 1e-4 for the fused head (fp32 GEMMs) and 2^-6 for its bf16
 * gradients (bf16 GEMM operands).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

/* Worst row error of `got` against `ref` (n entries, rows of `cols`). */
static double row_error(const double *got, const double *ref, size_t n, int64_t cols) {
  double worst = 0;
  for (size_t r0 = 0; r0 < n; r0 += (size_t)cols) {
    double e = 0, s = 0;
    for (int64_t j = 0; j < cols; j++) {
      double d = got[r0 + j] - ref[r0 + j];
      e += d * d;
      s += ref[r0 + j] * ref[r0 + j];
      if (isnan(got[r0 + j]) != isnan(ref[r0 + j])) return INFINITY;
    }
    if (s > 0)
      worst = fmax(worst, sqrt(e / s));
    else if (e > 0)
      worst = fmax(worst, sqrt(e) / 1e-30);
  }
  return worst;
}

static double bound(cli_op op, lmloss_dtype dt, int k) {
  if (cli_op_is_linear(op)) {
    int grad = (op == OP_LINEAR_CE && k >= 1) || (op == OP_LINEAR_LP && k >= 2);
    return dt == LMLOSS_F32 ? 1e-4 : grad ? 0x1p-6 : 0x1p-7;
  }
  int is_dtype_out = (op == OP_CE_GRAD && k == 1) || op == OP_CE_BWD || op == OP_LOGPROB_BWD ||
                     op == OP_LOGPROB_BWD_SAVED || op == OP_SOFTMAX || op == OP_LOG_SOFTMAX ||
                     op == OP_SOFTMAX_BWD || (cli_op_is_div(op) && k == 1);
  return dt != LMLOSS_F32 && is_dtype_out ? 0x1p-8 : 1e-5;
}

/* Runs one case on a backend and on REF; returns 1 on pass. */
static int check_case(cli_op op, lmloss_device dev, lmloss_backend be, lmloss_dtype dt,
                      double margin, double *worst_out, double *bound_out) {
  const int lin = cli_op_is_linear(op);
  const int64_t N = 48, V = lin ? 1003 : 4099, H = lin ? 96 : 0;
  cli_case got, ref;
  if (!cli_case_init(&got, op, N, V, H, dt, dev, margin, 0, 1.0, 7) ||
      !cli_case_init(&ref, op, N, V, H, dt, LMLOSS_CPU, margin, 0, 1.0, 7))
    return 0;
  lmloss_context cg = lmloss_context_default(), cr = lmloss_context_default();
  cg.backend = be;
  cr.backend = LMLOSS_BACKEND_REF;
  lmloss_status sg = cli_case_run(&got, &cg), sr = cli_case_run(&ref, &cr);
  cli_sync(dev);
  int ok = sg == LMLOSS_OK && sr == LMLOSS_OK;
  if (!ok)
    fprintf(stderr, "  %s: %s (%s)\n", cli_op_name(op), lmloss_status_string(sg ? sg : sr),
            lmloss_last_error());
  double worst = 0, bnd = bound(op, dt, 0);
  for (int k = 0; ok && k < got.nout; k++) {
    size_t n, m;
    int64_t cols, c2;
    double *a = cli_case_fetch(&got, k, &n, &cols), *b = cli_case_fetch(&ref, k, &m, &c2);
    double e = row_error(a, b, n, cols > 4 ? cols : 1), lim = bound(op, dt, k);
    if (e / lim > worst / bnd) worst = e, bnd = lim;
    free(a), free(b);
  }
  cli_case_free(&got), cli_case_free(&ref);
  *worst_out = worst, *bound_out = bnd;
  return ok && worst <= bnd;
}

int cmd_check(int argc, char **argv) {
  int cuda = cli_cuda_available();
  for (int a = 1; a < argc; a++) {
    if (!strcmp(argv[a], "--cpu-only"))
      cuda = 0;
    else {
      fprintf(stderr, "lmloss check: unknown option %s\n", argv[a]);
      return 2;
    }
  }
  printf("lmloss check: every op against the float64 reference (REF backend)\n");
  printf("CPU ISA %s; CUDA %s\n\n", lmloss_cpu_isa(),
         cuda                ? "available"
         : lmloss_has_cuda() ? "built in, no device"
                             : "not built in");
  printf("%-16s %-5s %-5s %-7s %10s %10s  %s\n", "op", "dev", "dtype", "rows", "worst err", "bound",
         "result");
  int fails = 0, runs = 0;
  for (int d = 0; d < 1 + cuda; d++) {
    lmloss_device dev = d ? LMLOSS_CUDA : LMLOSS_CPU;
    lmloss_backend be = d ? LMLOSS_BACKEND_CUDA : LMLOSS_BACKEND_CPU;
    for (int op = 0; op < OP_COUNT; op++)
      for (int t = 0; t < 2; t++) {
        lmloss_dtype dt = t ? LMLOSS_BF16 : LMLOSS_F32;
        if (cli_op_is_linear((cli_op)op) && dt != LMLOSS_F32 && dev == LMLOSS_CPU) continue;
        for (int p = 0; p < 2; p++) {
          double worst, bnd;
          int ok = check_case((cli_op)op, dev, be, dt, p ? 30.0 : 0.0, &worst, &bnd);
          fails += !ok, runs++;
          printf("%-16s %-5s %-5s %-7s %10.2e %10.2e  %s\n", cli_op_name((cli_op)op),
                 d ? "cuda" : "cpu", t ? "bf16" : "f32", p ? "peaked" : "random", worst, bnd,
                 ok ? "pass" : "FAIL");
          fflush(stdout);
        }
      }
  }
  printf("\n%d passed, %d failed\n", runs - fails, fails);
  return fails ? 1 : 0;
}
