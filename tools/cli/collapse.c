/*
 * collapse.c - `lmloss collapse`: one row per target margin, a confident
 * token's cross-entropy and target gradient computed the usual fp32 way
 * (lse - x_y and p_y - 1, as PyTorch and Liger do) next to lmloss (fp32,
 * CPU backend) and the float64 reference. Past a margin of about 17 the
 * usual form reads 0. Exits 1 if lmloss strays from the reference by
 * more than 1e-5.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "cli.h"

#define V 32000

static void naive(const float *x, int64_t y, float *loss, float *gy) {
  float m = -INFINITY, s = 0.0f;
  for (int j = 0; j < V; j++)
    m = x[j] > m ? x[j] : m;
  for (int j = 0; j < V; j++)
    s += expf(x[j] - m);
  float lse = m + logf(s);
  *loss = lse - x[y];
  *gy = expf(x[y] - lse) - 1.0f;
}

static int run(lmloss_backend b, float *x, int64_t *y, float *loss, float *g) {
  lmloss_context ctx = lmloss_context_default();
  ctx.backend = b;
  lmloss_ce_options opt = lmloss_ce_options_default();
  opt.reduction = LMLOSS_REDUCE_SUM;
  lmloss_ce_inputs in = {{x, LMLOSS_F32, LMLOSS_CPU, 1, V, V},
                         {y, LMLOSS_I64, LMLOSS_CPU, 1, 1, 1}};
  lmloss_ce_outputs out = {{loss, LMLOSS_F32, LMLOSS_CPU, 1, 1, 1}};
  out.dlogits = (lmloss_tensor){g, LMLOSS_F32, LMLOSS_CPU, 1, V, V};
  char ws[512];
  lmloss_status s = lmloss_cross_entropy(&ctx, &in, &opt, &out, ws, sizeof ws);
  if (s != LMLOSS_OK) fprintf(stderr, "%s: %s\n", lmloss_status_string(s), lmloss_last_error());
  return s;
}

int cmd_collapse(int argc, char **argv) {
  static float x[V], g[V], gref[V];
  int64_t y = 1234;
  const float margins[] = {0, 5, 10, 15, 17, 20, 30, 50, 80};
  int fails = 0;
  if (argc > 1) {
    fprintf(stderr, "lmloss collapse: unknown option %s (it takes none; lmloss --help)\n", argv[1]);
    return 2;
  }
  printf("cross-entropy of one row, V = %d, fp32 logits: target = max of the rest + margin\n\n", V);
  printf("%7s | %-23s | %-23s | %-23s\n", "", "usual fp32 form", "lmloss (fp32, CPU)",
         "float64 reference");
  printf("%7s | %11s %11s | %11s %11s | %11s %11s\n", "margin", "loss", "grad[y]", "loss",
         "grad[y]", "loss", "grad[y]");
  for (size_t k = 0; k < sizeof margins / sizeof margins[0]; k++) {
    srand(3);
    for (int j = 0; j < V; j++)
      x[j] = 2.0f * ((float)rand() / RAND_MAX) - 1.0f;
    x[y] = 1.0f + margins[k];
    float nl, ng, l, lr;
    naive(x, y, &nl, &ng);
    if (run(LMLOSS_BACKEND_CPU, x, &y, &l, g) || run(LMLOSS_BACKEND_REF, x, &y, &lr, gref))
      return 2;
    int ok = fabsf(l - lr) <= 1e-5f * fabsf(lr) && fabsf(g[y] - gref[y]) <= 1e-5f * fabsf(gref[y]);
    fails += !ok;
    printf("%7g | %11.4e %11.4e | %11.4e %11.4e | %11.4e %11.4e %s\n", margins[k], nl, ng, l, g[y],
           lr, gref[y], ok ? "" : "MISMATCH");
  }
  printf("\nlmloss %s the float64 reference on every row (CPU ISA: %s).\n",
         fails ? "DISAGREES with" : "matches", lmloss_cpu_isa());
  return fails ? 1 : 0;
}
