/*
 * bench.c - `lmloss bench`: time ops (median of --reps runs after a
 * warm-up) and set each against the limit measured in the same run: the
 * CPU's read+exp pass, the GPU's device-to-device copy bandwidth (bytes at
 * minimum: the logits read once, plus the gradient written once where
 * there is one), or the fused head's three GEMMs alone. On CUDA a
 * sample is --queue calls queued back to back between two events (the
 * copy's and the GEMMs' too), timed per call: at 1 (the default) a call's
 * own host work before its first kernel counts; above 1 it overlaps the
 * device work of the call before, as in a training step.
 */
#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"

#ifdef LMLOSS_CLI_CUDA
#include <cuda_runtime.h>
#endif

static double time_case_ms(cli_case *c, const lmloss_context *ctx, int reps, int queue) {
  double *t = cli_host_alloc((size_t)reps, sizeof(double), 0);
  for (int r = -2; r < reps; r++) {
    double ms = 0;
    lmloss_status s = LMLOSS_OK;
#ifdef LMLOSS_CLI_CUDA
    if (c->dev == LMLOSS_CUDA) {
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0), cudaEventCreate(&e1);
      cudaEventRecord(e0, 0);
      for (int q = 0; q < queue && s == LMLOSS_OK; q++)
        s = cli_case_run(c, ctx);
      cudaEventRecord(e1, 0);
      cudaEventSynchronize(e1);
      float f;
      cudaEventElapsedTime(&f, e0, e1);
      ms = f / queue;
      cudaEventDestroy(e0), cudaEventDestroy(e1);
    } else
#endif
    {
      double t0 = cli_now_ms();
      s = cli_case_run(c, ctx);
      ms = cli_now_ms() - t0;
    }
    if (s != LMLOSS_OK) {
      fprintf(stderr, "lmloss bench: %s: %s (%s)\n", cli_op_name(c->op), lmloss_status_string(s),
              lmloss_last_error());
      exit(1);
    }
    if (r >= 0) t[r] = ms;
  }
  double m = cli_median(t, reps);
  free(t);
  return m;
}

/* N,V or N,V,H: each a whole count (V >= 3) below 2^31, the BLAS's int,
 * and no two of them a product past 2^56 elements, so that byte counts
 * fit and a shape too large for memory fails at its allocation. */
static int parse_shape(const char *s, int64_t *N, int64_t *V, int64_t *H) {
  long long d[3] = {0, 0, 1};
  int n = 0, at = 0;
  while (n < 3) {
    int used = 0;
    if (sscanf(s + at, "%lld%n", &d[n], &used) != 1 || !isdigit((unsigned char)s[at])) return 0;
    at += used, n++;
    if (s[at] != ',') break;
    at++;
  }
  if (s[at] || n < 2 || d[0] < 1 || d[1] < 3 || d[2] < 1) return 0;
  for (int k = 0; k < 3; k++)
    if (d[k] > INT32_MAX) return 0;
  if (d[0] * d[1] > (1ll << 56) || d[1] * d[2] > (1ll << 56) || d[0] * d[2] > (1ll << 56)) return 0;
  *N = d[0], *V = d[1];
  if (n == 3) *H = d[2];
  return 1;
}

/* A whole number in [lo, hi], nothing after it. */
static int parse_int(const char *s, long lo, long hi, int *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (end == s || *end || errno || v < lo || v > hi) return 0;
  *out = (int)v;
  return 1;
}

int cmd_bench(int argc, char **argv) {
  cli_op ops[OP_COUNT];
  int nops = 0, csv = 0, reps = 10, threads = 0, plain = 0, queue = 1;
  double supervised = 1.0;
  lmloss_device dev = LMLOSS_CPU;
  lmloss_dtype dt = LMLOSS_F32;
  int64_t N = 0, V = 0, H = 0;
  for (int a = 1; a < argc; a++) {
    cli_op op;
    const char *v = a + 1 < argc ? argv[a + 1] : "";
    if (!strcmp(argv[a], "--csv"))
      csv = 1;
    else if (!strcmp(argv[a], "--plain"))
      plain = 1;
    else if (!strcmp(argv[a], "--device") && ++a) {
      if (!strcmp(v, "cuda"))
        dev = LMLOSS_CUDA;
      else if (strcmp(v, "cpu"))
        return fprintf(stderr, "lmloss bench: --device cpu|cuda\n"), 2;
    } else if (!strcmp(argv[a], "--dtype") && ++a) {
      if (!strcmp(v, "bf16"))
        dt = LMLOSS_BF16;
      else if (!strcmp(v, "f16"))
        dt = LMLOSS_F16;
      else if (strcmp(v, "f32"))
        return fprintf(stderr, "lmloss bench: --dtype f32|bf16|f16\n"), 2;
    } else if (!strcmp(argv[a], "--shape") && ++a) {
      if (!parse_shape(v, &N, &V, &H))
        return fprintf(
                   stderr,
                   "lmloss bench: --shape N,V[,H]: whole numbers below 2^31, N, H >= 1, V >= 3\n"),
               2;
    } else if (!strcmp(argv[a], "--reps") && ++a) {
      if (!parse_int(v, 1, 1000000, &reps))
        return fprintf(stderr, "lmloss bench: --reps R, 1 <= R <= 1000000\n"), 2;
    } else if (!strcmp(argv[a], "--queue") && ++a) {
      if (!parse_int(v, 1, 1000000, &queue))
        return fprintf(stderr, "lmloss bench: --queue Q, 1 <= Q <= 1000000\n"), 2;
    } else if (!strcmp(argv[a], "--supervised") && ++a) {
      char *end;
      supervised = strtod(v, &end);
      if (end == v || *end || !(supervised > 0.0 && supervised <= 1.0))
        return fprintf(stderr, "lmloss bench: --supervised F, 0 < F <= 1\n"), 2;
    } else if (!strcmp(argv[a], "--threads") && ++a) {
      if (!parse_int(v, 0, 1024, &threads))
        return fprintf(stderr, "lmloss bench: --threads T, 0 <= T <= 1024 (0: OpenMP's)\n"), 2;
    } else if (cli_op_parse(argv[a], &op)) {
      ops[nops++] = op;
    } else {
      return fprintf(stderr, "lmloss bench: unknown argument %s (lmloss --help)\n", argv[a]), 2;
    }
  }
  for (int k = 0; k < nops && supervised < 1.0; k++)
    if (!cli_op_is_ce(ops[k]))
      return fprintf(stderr,
                     "lmloss bench: --supervised applies to ce, ce-grad, ce-bwd and "
                     "linear-ce, not %s\n",
                     cli_op_name(ops[k])),
             2;
  if (dev == LMLOSS_CUDA && !cli_cuda_available())
    return fprintf(stderr, "lmloss bench: no CUDA device (or lmloss built without CUDA)\n"), 2;
  if (!nops) /* the default set */
    for (int o = 0; o < OP_COUNT; o++)
      ops[nops++] = (cli_op)o;
  lmloss_context ctx = lmloss_context_default();
  ctx.num_threads = threads;
  if (csv)
    printf("op,device,dtype,N,V,H,ms,gb_per_s,tflops,limit,fraction_of_limit\n");
  else
    printf("%-16s %-5s %-5s %-20s %9s %9s %9s  %s\n", "op", "dev", "dtype", "shape", "ms", "GB/s",
           "TFLOP/s", "vs limit (measured in this run)");
  double copy_gbs = 0;
  for (int k = 0; k < nops; k++) {
    const int lin = cli_op_is_linear(ops[k]);
    int64_t n = N, v = V, h = H;
    if (!n) n = dev == LMLOSS_CUDA ? 8192 : lin ? 1024 : 4096;
    if (!v) v = dev == LMLOSS_CUDA ? 152064 : 32768;
    if (!h) h = dev == LMLOSS_CUDA ? 4096 : 1024;
    if (lin && dev == LMLOSS_CPU && dt != LMLOSS_F32) continue; /* fp32-only on the CPU */
    if (isatty(STDERR_FILENO)) /* progress for a person watching, not for a log */
      fprintf(stderr, "[%d/%d] %s %lldx%lld ...\n", k + 1, nops, cli_op_name(ops[k]), (long long)n,
              (long long)v);
    cli_case c;
    if (!cli_case_init(&c, ops[k], n, v, lin ? h : 0, dt, dev, 0.0, plain, supervised, 11))
      return fprintf(stderr, "lmloss bench: bad shape for %s\n", cli_op_name(ops[k])), 2;
    double ms = time_case_ms(&c, &ctx, reps, queue), bytes = cli_op_bytes(&c),
           fl = cli_op_flops(&c);
    double limit_ms = 0, frac = 0;
    char limit[64] = "";
    if (lin) {
      limit_ms = cli_limit_gemm_ms(&c, reps, queue);
      frac = ms / limit_ms;
      snprintf(limit, sizeof limit, "%.3fx its 3 GEMMs (%.2f ms)", frac, limit_ms);
    } else if (dev == LMLOSS_CPU) {
      const lmloss_tensor *x = c.op == OP_SOFTMAX_BWD ? &c.y : &c.x;
      if (dt == LMLOSS_F32) {
        limit_ms = cli_limit_exp_pass_ms(x->data, n * v, threads);
        if (cli_op_is_div(c.op)) limit_ms += cli_limit_exp_pass_ms(c.teacher.data, n * v, threads);
        frac = ms / limit_ms;
        snprintf(limit, sizeof limit, "%.2fx the read+exp pass (%.2f ms)", frac, limit_ms);
      }
    } else {
      if (!copy_gbs)
        copy_gbs = cli_limit_copy_gbs(dev, (size_t)(n * v) * (dt == LMLOSS_F32 ? 4 : 2), queue);
      frac = bytes / (ms * 1e6) / copy_gbs;
      snprintf(limit, sizeof limit, "%.1f%% of copy bandwidth (%.0f GB/s)", 100 * frac, copy_gbs);
    }
    char shape[48];
    int at = snprintf(shape, sizeof shape, lin ? "%lldx%lldx%lld" : "%lldx%lld", (long long)n,
                      (long long)v, (long long)h);
    if (supervised < 1.0) snprintf(shape + at, sizeof shape - at, "@%g%%", 100 * supervised);
    const char *dn = dt == LMLOSS_F32 ? "f32" : dt == LMLOSS_BF16 ? "bf16" : "f16";
    double gbs = bytes / (ms * 1e6), tf = fl / (ms * 1e9);
    if (csv)
      printf("%s,%s,%s,%lld,%lld,%lld,%.4f,%.1f,%.2f,%.4f,%.4f\n", cli_op_name(ops[k]),
             dev ? "cuda" : "cpu", dn, (long long)n, (long long)v, (long long)(lin ? h : 0), ms,
             gbs, tf,
             lin                 ? limit_ms
             : dev == LMLOSS_CPU ? limit_ms
                                 : copy_gbs,
             frac);
    else
      printf("%-16s %-5s %-5s %-20s %9.3f %9.1f %9.2f  %s\n", cli_op_name(ops[k]),
             dev ? "cuda" : "cpu", dn, shape, ms, gbs, tf, limit);
    fflush(stdout);
    cli_case_free(&c);
  }
  return 0;
}
