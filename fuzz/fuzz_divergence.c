/*
 * fuzz_divergence.c - lmloss_divergence (forward, fused with the
 * gradient or not) and lmloss_divergence_backward, every kind, on the CPU
 * and REF backends: statuses agree, errors leave the outputs alone; on
 * OK, a row's divergence is NaN on both or on neither, never negative on
 * the CPU, exactly 0 with its gradient for a teacher identical to the
 * student, and, for inputs the contract bounds, close to REF's.
 */
#include "fuzz_common.h"

/* |got - ref| within 1e-3 |ref| plus 1e-5 of the rows' largest |z|: a
 * loose bound (design.md states the exact one per entry), enough to see
 * a sum or a formula gone wrong. */
static void close_rows(const lmloss_tensor *got, const lmloss_tensor *ref, double zmax) {
  for (int64_t i = 0; i < got->rows; i++) {
    const double g = ((const float *)got->data)[i * got->row_stride];
    const double r = ((const float *)ref->data)[i * ref->row_stride];
    if (isnan(r) != isnan(g)) {
      fprintf(stderr, "fuzz: divergence[%lld]: CPU %g, REF %g\n", (long long)i, g, r);
      abort();
    }
    if (!isnan(g) && g < 0) {
      fprintf(stderr, "fuzz: divergence[%lld] = %g < 0 on the CPU\n", (long long)i, g);
      abort();
    }
    if (zmax > 0 && isfinite(r) && !(fabs(g - r) <= 1e-3 * fabs(r) + 1e-5 * (1.0 + zmax))) {
      fprintf(stderr, "fuzz: divergence[%lld]: CPU %.9g, REF %.9g\n", (long long)i, g, r);
      abort();
    }
  }
}

static double zmax_of(const lmloss_tensor *x, const lmloss_transform *t) {
  double m = 0;
  const double k = t->softcap > 0 ? 1.0 / t->temperature : t->logit_scale / t->temperature;
  for (int64_t i = 0; i < x->rows; i++)
    for (int64_t j = 0; j < x->cols; j++)
      m = fmax(m, fabs(((const float *)x->data)[i * x->row_stride + j]) * k);
  return t->softcap > 0 ? fmin(m, t->softcap * k) : m;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_in in = {data, size, size};
  fz_pool pool = {0};
  const int64_t N = fz_range(&in, 0, 6) - fz_chance(&in, 4);
  const int64_t V = fz_chance(&in, 16) ? fz_range(&in, 2040, 4500) : fz_range(&in, 0, 80);
  const int mode = (int)fz_range(&in, 0, 2); /* forward, fused, backward */
  lmloss_div_options opt = lmloss_div_options_default();
  opt.kind = (lmloss_divergence_kind)fz_range(&in, 0, fz_chance(&in, 4) ? 9 : 3);
  opt.beta = fz_chance(&in, 16) ? fz_float(&in) : (float)fz_range(&in, 0, 8) / 8.0f;
  opt.student = fz_transform(&in);
  opt.teacher = fz_chance(&in, 128) ? opt.student : fz_transform(&in);
  opt.reduction = (lmloss_reduction)fz_range(&in, 0, fz_chance(&in, 4) ? 6 : 3);
  opt.num_items = fz_chance(&in, 8) ? -1.0 : 1.0 + fz_u8(&in);
  if (fz_chance(&in, 32)) opt.hard_weight = fz_chance(&in, 8) ? -1.0f : fz_u8(&in) / 64.0f;
  if (fz_chance(&in, 16)) opt.soft_weight = fz_float(&in);
  opt.grad_output = fz_chance(&in, 8) ? NAN : 0.5f + fz_u8(&in) / 128.0f;

  const lmloss_dtype sdt = fz_float_dtype(&in);
  lmloss_tensor s = fz_tensor(&in, &pool, sdt, N, V, V, 0);
  const int same = fz_chance(&in, 48) && s.data;
  lmloss_tensor t =
      same ? fz_clone(&pool, &s) : fz_tensor(&in, &pool, fz_float_dtype(&in), N, V, V, 0);
  lmloss_div_inputs din = {s, t, fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_I64), N, 1, V, -100)};
  const int64_t nl = opt.reduction == LMLOSS_REDUCE_NONE ? N : 1;
  lmloss_tensor o[4] = {fz_tensor(&in, &pool, fz_dtype(&in, LMLOSS_F32), nl, 1, V, 0),
                        fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_F32), N, 1, V, 0),
                        fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_F32), N, 1, V, 0),
                        mode ? fz_tensor(&in, &pool, fz_dtype(&in, sdt), N, V, V, 0)
                             : (lmloss_tensor){0}};
  lmloss_tensor dloss = fz_tensor(&in, &pool, fz_dtype(&in, LMLOSS_F32), nl, 1, V, 0);
  size_t wsb = lmloss_cross_entropy_workspace_size(N > 0 ? N : 0);
  if (fz_chance(&in, 8)) wsb /= 2;
  void *ws = fz_alloc(&pool, wsb ? wsb : 1);
  lmloss_context cpu = fz_context(&in, LMLOSS_BACKEND_CPU), ref = cpu;
  ref.backend = LMLOSS_BACKEND_REF;

  lmloss_tensor r[4];
  fz_outs wc = {0}, wr = {0};
  for (int k = 0; k < 4; k++) {
    r[k] = fz_clone(&pool, &o[k]);
    fz_watch(&wc, &pool, &o[k]), fz_watch(&wr, &pool, &r[k]);
  }
  lmloss_status sc, sr;
  if (mode < 2) {
    const lmloss_div_outputs oc = {o[0], o[1], o[2], o[3]}, orf = {r[0], r[1], r[2], r[3]};
    sc = lmloss_divergence(&cpu, &din, &opt, &oc, ws, wsb);
    sr = lmloss_divergence(&ref, &din, &opt, &orf, ws, wsb);
  } else {
    sc = lmloss_divergence_backward(&cpu, &din, &opt, &dloss, &o[3], ws, wsb);
    sr = lmloss_divergence_backward(&ref, &din, &opt, &dloss, &r[3], ws, wsb);
  }
  fz_check(sc, &wc, "divergence on CPU");
  fz_check(sr, &wr, "divergence on REF");
  fz_agree(sc, sr, "divergence");
  if (sc == LMLOSS_OK && sr == LMLOSS_OK && mode < 2 && o[1].data && o[1].dtype == LMLOSS_F32) {
    const int tame = fz_tame(&s, &opt.student) && fz_tame(&t, &opt.teacher);
    close_rows(&o[1], &r[1], tame ? fmax(zmax_of(&s, &opt.student), zmax_of(&t, &opt.teacher)) : 0);
    const int identical = same && !memcmp(&opt.student, &opt.teacher, sizeof opt.student) &&
                          !din.label.data && opt.hard_weight == 0.0f;
    for (int64_t i = 0; identical && i < N; i++) {
      const float d = ((const float *)o[1].data)[i * o[1].row_stride];
      if (!(d == 0.0f || isnan(d))) {
        fprintf(stderr, "fuzz: identical rows: divergence[%lld] = %g\n", (long long)i, d);
        abort();
      }
    }
  }
  fz_release(&pool);
  return 0;
}
