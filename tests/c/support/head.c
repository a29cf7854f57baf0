/* head.c - a fused head's test data and oracle (head.h). */
#include "head.h"

void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  if (!p) {
    fprintf(stderr, "FAIL: out of memory\n");
    exit(1);
  }
  return p;
}

static void logits64(head_data *hd) {
  const int64_t N = hd->N, V = hd->V, H = hd->H;
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < V; j++) {
      double s = hd->b64 ? hd->b64[j] : 0.0;
      const double *h = hd->h64 + i * H, *w = hd->w64 + j * H;
      for (int64_t k = 0; k < H; k++)
        s += h[k] * w[k];
      hd->x64[i * V + j] = s;
    }
}

void head_new(head_data *hd, int64_t N, int64_t V, int64_t H0, lmloss_dtype dt, int bias,
              int64_t pad, const int64_t *peak, double margin, double sigma) {
  memset(hd, 0, sizeof *hd);
  const int64_t H = H0 + (peak ? N : 0);
  hd->N = N, hd->V = V, hd->H0 = H0, hd->H = H, hd->dt = dt;
  hd->hidden = host_new(dt, N, H, H + pad);
  hd->weight = host_new(dt, V, H, H + pad);
  host_poison(&hd->hidden), host_poison(&hd->weight); /* padding holds garbage */
  hd->h64 = xcalloc((size_t)(N * H), sizeof(double));
  hd->w64 = xcalloc((size_t)(V * H), sizeof(double));
  hd->x64 = xcalloc((size_t)(N * V), sizeof(double));
  for (int64_t i = 0; i < N; i++)
    for (int64_t k = 0; k < H; k++) {
      double v = k < H0 ? rng_normal() : (k == H0 + i && peak && peak[i] >= 0 && margin >= 0);
      tset(&hd->hidden, i, k, v);
      hd->h64[i * H + k] = tget(&hd->hidden, i, k);
    }
  for (int64_t j = 0; j < V; j++)
    for (int64_t k = 0; k < H; k++) {
      tset(&hd->weight, j, k, k < H0 ? sigma / sqrt((double)H0) * rng_normal() : 0.0);
      hd->w64[j * H + k] = tget(&hd->weight, j, k);
    }
  if (bias) {
    hd->bias = host_new(dt, V, 1, 1);
    hd->b64 = xcalloc((size_t)V, sizeof(double));
    for (int64_t j = 0; j < V; j++) {
      tset(&hd->bias, j, 0, 0.5 * rng_normal());
      hd->b64[j] = tget(&hd->bias, j, 0);
    }
  }
  logits64(hd);
  if (peak && margin >= 0) {
    for (int64_t i = 0; i < N; i++) {
      int64_t y = peak[i];
      if (y < 0 || y >= V || V == 1) continue;
      double mx = -INFINITY;
      for (int64_t j = 0; j < V; j++)
        if (j != y && hd->x64[i * V + j] > mx) mx = hd->x64[i * V + j];
      tset(&hd->weight, y, H0 + i, mx + margin - hd->x64[i * V + y]);
      hd->w64[y * H + H0 + i] = tget(&hd->weight, y, H0 + i);
    }
    logits64(hd);
  }
  hd->logits = host_new(LMLOSS_F32, N, V, V);
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < V; j++)
      tset(&hd->logits, i, j, hd->x64[i * V + j]);
}

void head_free(head_data *hd) {
  host_free(&hd->hidden), host_free(&hd->weight), host_free(&hd->bias), host_free(&hd->logits);
  free(hd->h64), free(hd->w64), free(hd->b64), free(hd->x64);
}

void grad_oracle(const head_data *hd, const lmloss_tensor *dl, double *dh, double *dw, double *db) {
  const int64_t N = hd->N, V = hd->V, H = hd->H;
  memset(dh, 0, sizeof(double) * (size_t)(N * H));
  memset(dw, 0, sizeof(double) * (size_t)(V * H));
  memset(db, 0, sizeof(double) * (size_t)V);
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < V; j++) {
      double d = tget(dl, i, j);
      if (d == 0.0) continue;
      const double *w = hd->w64 + j * H, *h = hd->h64 + i * H;
      double *dhi = dh + i * H, *dwj = dw + j * H;
      for (int64_t k = 0; k < H; k++)
        dhi[k] += d * w[k], dwj[k] += d * h[k];
      db[j] += d;
    }
}

/* ---- comparisons ---- */

double to_bf16(double v) {
  uint16_t b;
  lmloss_tensor t = {&b, LMLOSS_BF16, LMLOSS_CPU, 1, 1, 1};
  tset(&t, 0, 0, v);
  return tget(&t, 0, 0);
}

double *to_f64(const lmloss_tensor *t) {
  double *a = xcalloc((size_t)(t->rows * t->cols), sizeof(double));
  for (int64_t i = 0; i < t->rows; i++)
    for (int64_t j = 0; j < t->cols; j++)
      a[i * t->cols + j] = tget(t, i, j);
  return a;
}

void note(tgroup *g, double err, double ref) {
  if (ref > ABS_FLOOR && err / ref > g->worst) g->worst = err / ref;
}

void rows_close(tgroup *g, const lmloss_tensor *got, const double *ref, double tol,
                const char *what) {
  for (int64_t i = 0; i < got->rows; i++) {
    double num = 0.0, den = 0.0;
    int finite = 1;
    for (int64_t j = 0; j < got->cols; j++) {
      double v = tget(got, i, j), r = ref[i * got->cols + j];
      finite &= isfinite(v);
      num += (v - r) * (v - r), den += r * r;
    }
    num = sqrt(num), den = sqrt(den);
    note(g, num, den);
    tg_true(g, finite && num <= tol * den + ABS_FLOOR, "%s row %lld: rel err %.3g (|ref| %.3g)",
            what, (long long)i, den > 0 ? num / den : num, den);
  }
}

/* Worst err / (bf16 rounding error) of each 16-bit gradient, over the run. */
static const char *bf16_names[] = {"dhidden", "dweight", "dbias"};
double bf16_worst[3];

static void note_bf16(const char *what, double err, double rnd) {
  for (int i = 0; i < 3; i++)
    if (!strcmp(what, bf16_names[i]) && rnd > 0 && err / rnd > bf16_worst[i])
      bf16_worst[i] = err / rnd;
}

void tensor_close(tgroup *g, const lmloss_tensor *got, const double *ref, double tol, int bf16,
                  const char *what) {
  double num = 0.0, den = 0.0, rnd = 0.0;
  int finite = 1;
  for (int64_t i = 0; i < got->rows; i++)
    for (int64_t j = 0; j < got->cols; j++) {
      double v = tget(got, i, j), r = ref[i * got->cols + j], b = bf16 ? to_bf16(r) - r : 0.0;
      finite &= isfinite(v);
      num += (v - r) * (v - r), den += r * r, rnd += b * b;
    }
  num = sqrt(num), den = sqrt(den), rnd = sqrt(rnd);
  note(g, num, den);
  if (bf16) note_bf16(what, num, rnd);
  double bound = (bf16 ? BF16_FACTOR * rnd : tol * den) + ABS_FLOOR;
  tg_true(g, finite && num <= bound, "%s: err %.3g > bound %.3g (|ref| %.3g, bf16 rounding %.3g)",
          what, num, bound, den, rnd);
}

void all_zero(tgroup *g, const lmloss_tensor *t, const char *what) {
  if (!t->data) return;
  int ok = 1;
  for (int64_t i = 0; i < t->rows; i++)
    for (int64_t j = 0; j < t->cols; j++)
      ok &= tget(t, i, j) == 0.0;
  tg_true(g, ok, "%s is not all zeros", what);
}

void grads_close(tgroup *g, const head_data *hd, const lmloss_tensor *dh, const lmloss_tensor *dw,
                 const lmloss_tensor *db, const lmloss_tensor *dl) {
  const int64_t N = hd->N, V = hd->V, H = hd->H;
  double *eh = xcalloc((size_t)(N * H), sizeof(double));
  double *ew = xcalloc((size_t)(V * H), sizeof(double)), *eb = xcalloc((size_t)V, sizeof(double));
  grad_oracle(hd, dl, eh, ew, eb);
  int bf = hd->dt == LMLOSS_BF16;
  if (dh->data) {
    if (bf)
      tensor_close(g, dh, eh, 0, 1, "dhidden");
    else
      rows_close(g, dh, eh, FL_TOL, "dhidden");
  }
  if (dw->data) tensor_close(g, dw, ew, FL_TOL, bf, "dweight");
  if (db->data) tensor_close(g, db, eb, FL_TOL, bf, "dbias");
  free(eh), free(ew), free(eb);
}
