/* testing.c - tolerances, case groups, random numbers and host tensors. */
#include <stdarg.h>

#include "testing.h"

static int any_failure;

void tg_begin(tgroup *g, const char *name) {
  g->name = name;
  g->checks = g->fails = 0;
  g->worst = 0.0;
}

void tg_end(tgroup *g) {
  printf("%-4s %-48s %s checks=%ld fails=%ld worst_rel=%.3g\n", g->fails ? "FAIL" : "ok", g->name,
         tb_name(), g->checks, g->fails, g->worst);
  fflush(stdout);
  if (g->fails) any_failure = 1;
}

int test_finish(void) { return any_failure ? 1 : 0; }

double ulp_of(double r, lmloss_dtype dt) {
  if (dt != LMLOSS_BF16 && dt != LMLOSS_F16) return 0.0;
  int bits = dt == LMLOSS_BF16 ? 8 : 11, emin = dt == LMLOSS_BF16 ? -126 : -14;
  double a = fabs(r);
  int e = a > 0.0 ? ilogb(a) : emin;
  if (e < emin) e = emin;
  return ldexp(1.0, e - (bits - 1));
}

int tg_close(tgroup *g, double got, double ref, lmloss_dtype dt, double extra, const char *what,
             int64_t i, int64_t j) {
  g->checks++;
  int ok;
  if (isnan(ref))
    ok = isnan(got);
  else if (isinf(ref))
    ok = got == ref;
  else {
    double err = fabs(got - ref);
    ok = err <= TOL_REL * fabs(ref) + TOL_FLOOR + ulp_of(ref, dt) + extra;
    if (fabs(ref) > TOL_FLOOR && err / fabs(ref) > g->worst) g->worst = err / fabs(ref);
  }
  if (!ok) {
    if (g->fails < 8)
      printf("  mismatch %s: %s[%lld,%lld] got %.9g ref %.9g (%s, extra floor %.3g)\n", g->name,
             what, (long long)i, (long long)j, got, ref, dt_name(dt), extra);
    g->fails++;
  }
  return ok;
}

int tg_true(tgroup *g, int cond, const char *fmt, ...) {
  g->checks++;
  if (!cond) {
    if (g->fails < 8) {
      va_list ap;
      va_start(ap, fmt);
      printf("  failed %s: ", g->name);
      vprintf(fmt, ap);
      printf("\n");
      va_end(ap);
    }
    g->fails++;
  }
  return cond;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

void rng_seed(uint64_t s) { rng_state = s * 0x9e3779b97f4a7c15ull + 1; }

static uint64_t rng_next(void) {
  uint64_t x = rng_state;
  x ^= x << 13, x ^= x >> 7, x ^= x << 17;
  return rng_state = x;
}

double rng_uniform(void) { return (double)(rng_next() >> 11) * 0x1p-53; }

double rng_normal(void) {
  double u = rng_uniform(), v = rng_uniform();
  return sqrt(-2.0 * log(1.0 - u)) * cos(6.283185307179586 * v);
}

int64_t rng_int(int64_t n) { return (int64_t)(rng_next() % (uint64_t)n); }

/* Not lmloss_dtype_size: the bad-input tests build tensors of unknown
 * dtypes (42), which still need a byte of storage to poison and compare. */
static size_t dsize(lmloss_dtype d) {
  switch (d) {
  case LMLOSS_F64:
  case LMLOSS_I64: return 8;
  case LMLOSS_F32:
  case LMLOSS_I32: return 4;
  case LMLOSS_BF16:
  case LMLOSS_F16: return 2;
  case LMLOSS_BOOL: return 1;
  }
  return 1;
}

const char *dt_name(lmloss_dtype dt) {
  static const char *n[] = {"f32", "bf16", "f16", "f64", "i32", "i64", "bool"};
  return (unsigned)dt < 7 ? n[dt] : "?";
}

size_t tensor_bytes(const lmloss_tensor *t) {
  if (!t->data || t->rows == 0) return 0;
  return (size_t)((t->rows - 1) * t->row_stride + t->cols) * dsize(t->dtype);
}

lmloss_tensor host_new(lmloss_dtype dt, int64_t rows, int64_t cols, int64_t stride) {
  lmloss_tensor t = {NULL, dt, LMLOSS_CPU, rows, cols, stride < cols ? cols : stride};
  size_t n = (size_t)(rows * t.row_stride) * dsize(dt);
  t.data = calloc(n ? n : 1, 1);
  if (!t.data) {
    fprintf(stderr, "FAIL: out of memory\n");
    exit(1);
  }
  return t;
}

void host_poison(lmloss_tensor *t) {
  memset(t->data, 0x5a, (size_t)(t->rows * t->row_stride) * dsize(t->dtype));
}

lmloss_tensor host_clone(const lmloss_tensor *t) {
  lmloss_tensor c = *t;
  if (!t->data) return c;
  c = host_new(t->dtype, t->rows, t->cols, t->row_stride);
  memcpy(c.data, t->data, (size_t)(t->rows * t->row_stride) * dsize(t->dtype));
  return c;
}

void host_free(lmloss_tensor *t) {
  free(t->data);
  t->data = NULL;
}

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* fp16 via the compiler's _Float16 (independent of the library's code). */
static uint16_t to_f16(float f) {
  _Float16 h = (_Float16)f;
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}

static float from_f16(uint16_t u) {
  _Float16 h;
  memcpy(&h, &u, 2);
  return (float)h;
}

void tset(const lmloss_tensor *t, int64_t i, int64_t j, double v) {
  char *p = (char *)t->data + (size_t)(i * t->row_stride + j) * dsize(t->dtype);
  switch (t->dtype) {
  case LMLOSS_F32: *(float *)p = (float)v; break;
  case LMLOSS_BF16: *(uint16_t *)p = to_bf16((float)v); break;
  case LMLOSS_F16: *(uint16_t *)p = to_f16((float)v); break;
  case LMLOSS_F64: *(double *)p = v; break;
  case LMLOSS_I32: *(int32_t *)p = (int32_t)v; break;
  case LMLOSS_I64: *(int64_t *)p = (int64_t)v; break;
  case LMLOSS_BOOL: *(unsigned char *)p = (unsigned char)(v != 0); break;
  }
}

double tget(const lmloss_tensor *t, int64_t i, int64_t j) {
  const char *p = (const char *)t->data + (size_t)(i * t->row_stride + j) * dsize(t->dtype);
  switch (t->dtype) {
  case LMLOSS_F32: return *(const float *)p;
  case LMLOSS_BF16: return from_bf16(*(const uint16_t *)p);
  case LMLOSS_F16: return from_f16(*(const uint16_t *)p);
  case LMLOSS_F64: return *(const double *)p;
  case LMLOSS_I32: return *(const int32_t *)p;
  case LMLOSS_I64: return (double)*(const int64_t *)p;
  case LMLOSS_BOOL: return *(const unsigned char *)p;
  }
  return NAN;
}

int same_bytes(const lmloss_tensor *a, const lmloss_tensor *b) {
  return memcmp(a->data, b->data, (size_t)(a->rows * a->row_stride) * dsize(a->dtype)) == 0;
}

void fill_logits(const lmloss_tensor *x, double sigma, const int64_t *target, double margin) {
  for (int64_t i = 0; i < x->rows; i++) {
    for (int64_t j = 0; j < x->cols; j++)
      tset(x, i, j, sigma * rng_normal());
    if (!target || margin < 0 || target[i] < 0 || target[i] >= x->cols) continue;
    double mx = -INFINITY;
    for (int64_t j = 0; j < x->cols; j++)
      if (j != target[i] && tget(x, i, j) > mx) mx = tget(x, i, j);
    tset(x, i, target[i], x->cols == 1 ? 0.0 : mx + margin);
  }
}

split make_split(int64_t V, int k) {
  split s;
  s.k = k;
  int64_t cut[8];
  cut[0] = 0;
  for (int c = 1; c < k; c++) {
    int again;
    do {
      cut[c] = 1 + rng_int(V - 1);
      again = 0;
      for (int d = 1; d < c; d++)
        again |= cut[d] == cut[c];
    } while (again);
  }
  for (int a = 1; a < k; a++) /* sort */
    for (int b = a; b > 1 && cut[b] < cut[b - 1]; b--) {
      int64_t t = cut[b];
      cut[b] = cut[b - 1], cut[b - 1] = t;
    }
  for (int c = 0; c < k; c++) {
    s.col0[c] = cut[c];
    s.n[c] = (c + 1 < k ? cut[c + 1] : V) - cut[c];
  }
  return s;
}

lmloss_tensor rows_view(const lmloss_tensor *t, int64_t r0, int64_t n) {
  lmloss_tensor v = *t;
  if (v.data) v.data = (char *)t->data + (size_t)(r0 * t->row_stride) * dsize(t->dtype);
  v.rows = n;
  return v;
}

lmloss_tensor cols_view(const lmloss_tensor *t, int64_t c0, int64_t n) {
  lmloss_tensor v = *t;
  v.data = (char *)t->data + (size_t)c0 * dsize(t->dtype);
  v.cols = n;
  return v;
}

void tg_close_softmax_grad(tgroup *g, const lmloss_tensor *got, const lmloss_tensor *ref,
                           const lmloss_tensor *y, const lmloss_tensor *dy, int log, double tol) {
  for (int64_t i = 0; i < ref->rows; i++) {
    double sabs = 0, rest = 0;
    int64_t a = 0;
    for (int64_t j = 0; j < ref->cols; j++) {
      const double yj = tget(y, i, j), dj = fabs(tget(dy, i, j));
      sabs += log ? dj : dj * yj;
      if (yj > tget(y, i, a)) a = j;
    }
    for (int64_t j = 0; j < ref->cols; j++) {
      const double yj = tget(y, i, j), dj = fabs(tget(dy, i, j));
      if (j != a) rest += tol * (log ? dj + exp(yj) * sabs : yj * (dj + sabs));
    }
    for (int64_t j = 0; j < ref->cols; j++) {
      const double yj = tget(y, i, j), dj = fabs(tget(dy, i, j));
      const double fl = tol * (log ? dj + exp(yj) * sabs : yj * (dj + sabs));
      tg_close(g, tget(got, i, j), tget(ref, i, j), ref->dtype, j == a ? fmax(fl, rest) : fl, "dx",
               i, j);
    }
  }
}
