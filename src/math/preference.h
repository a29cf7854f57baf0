/*
 * preference.h - the DPO family's formulas (lmloss.h's lmloss_preference),
 * written once for C and CUDA, in double, from the sequence log-prob sums
 * of P chosen / rejected pairs. Every log-sigmoid is a softplus of the
 * other sign, every 1 - sigmoid a sigmoid, forward KL's 1 - e^-x is
 * -expm1(-x): nothing is formed as a difference of near-equal values.
 *
 * Pair terms (lmloss_pref_pair) depend on one pair; AOT's on the batch
 * (the k-th smallest of two sorted lists: lmloss_pref_rank), SFT's on the
 * sums over the batch. A backend sums them in pair order.
 */
#ifndef LMLOSS_MATH_PREFERENCE_H
#define LMLOSS_MATH_PREFERENCE_H

#include <math.h>

#include "rowstats.h"

/* log(1 + e^x) without overflow or cancellation. */
LMLOSS_HD double lmloss_pref_softplus(double x) {
  return (x > 0.0 ? x : 0.0) + log1p(exp(-fabs(x)));
}

LMLOSS_HD double lmloss_pref_sigmoid(double x) {
  const double e = exp(-fabs(x));
  return x >= 0.0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

/* The options, resolved. */
typedef struct {
  int fdiv;     /* lmloss_pref_fdiv (ALPHA at alpha 1 is REVERSE_KL) */
  double alpha; /* ALPHA's coefficient */
  double beta, eps, tau, gamma;
  double w[LMLOSS_PREF_TYPES];
  double P;
} lmloss_pref_par;

LMLOSS_HD lmloss_pref_par lmloss_pref_par_make(const lmloss_pref_options *o, int64_t P) {
  lmloss_pref_par p;
  p.fdiv = (int)o->f_divergence;
  p.alpha = o->f_alpha;
  if (p.fdiv == LMLOSS_PREF_FDIV_ALPHA && fabs(p.alpha - 1.0) < 1e-6)
    p.fdiv = LMLOSS_PREF_FDIV_REVERSE_KL;
  p.beta = o->beta;
  p.eps = o->label_smoothing;
  p.tau = o->discopop_tau;
  p.gamma = o->simpo_gamma;
  for (int k = 0; k < LMLOSS_PREF_TYPES; k++)
    p.w[k] = o->loss_weights[k];
  p.P = (double)P;
  return p;
}

/* The f-divergence's score of a log ratio x, and its derivative *ds. */
LMLOSS_HD double lmloss_pref_score(const lmloss_pref_par *p, double x, double *ds) {
  switch (p->fdiv) {
  case LMLOSS_PREF_FDIV_FORWARD_KL: *ds = exp(-x); return -expm1(-x);
  case LMLOSS_PREF_FDIV_JS:
    *ds = lmloss_pref_sigmoid(-x);
    return log(2.0) - lmloss_pref_softplus(-x);
  case LMLOSS_PREF_FDIV_ALPHA: {
    /* TRL clips the exponent at 80 (its fp32 form), the gradient with it */
    const double a1 = p->alpha - 1.0, t = a1 * x;
    *ds = t < 80.0 ? exp(t) : 0.0;
    return expm1(fmin(t, 80.0)) / a1;
  }
  case LMLOSS_PREF_FDIV_ALPHAPO:
    if (p->alpha == 0.0) break;
    *ds = exp(-p->alpha * x);
    return -expm1(-p->alpha * x) / p->alpha;
  default: break;
  }
  *ds = 1.0;
  return x;
}

/* log(1 - e^x), x < 0, without cancellation on either side of -log 2. */
LMLOSS_HD double lmloss_pref_log1mexp(double x) {
  return x < -0.6931471805599453 ? log1p(-exp(x)) : log(-expm1(x));
}

/* A pair's inputs: the policy's and reference's log-prob sums, the
 * completions' token counts, the pair's weight (WPO's; 1 without). */
typedef struct {
  double c, r, rc, rr, nc, nr, w;
} lmloss_pref_in;

/* ORPO's log odds ratio of the policy's c over r (log-probs < 0). */
LMLOSS_HD double lmloss_pref_log_odds(const lmloss_pref_in *x) {
  return (x->c - x->r) - (lmloss_pref_log1mexp(x->c) - lmloss_pref_log1mexp(x->r));
}

/* -log sigmoid(z) with smoothing e (and its d/dz): the AOT terms' form. */
LMLOSS_HD double lmloss_pref_smoothed(double z, double e, double *dz) {
  *dz = -(1.0 - e) * lmloss_pref_sigmoid(-z) + e * lmloss_pref_sigmoid(z);
  return (1.0 - e) * lmloss_pref_softplus(-z) + e * lmloss_pref_softplus(z);
}

/* The weighted sum of a pair's own terms (every type but AOT, AOT_UNPAIRED
 * and SFT) and its derivatives in c and r. */
LMLOSS_HD double lmloss_pref_pair(const lmloss_pref_par *p, const lmloss_pref_in *x, double *dc,
                                  double *dr) {
  const double b = p->beta, e = p->eps, lc = x->c - x->rc, lr = x->r - x->rr;
  double dsc, dsr;
  const double sc = lmloss_pref_score(p, lc, &dsc), sr = lmloss_pref_score(p, lr, &dsr);
  const double z = b * (sc - sr);
  double loss = 0.0, gz = 0.0, gc = 0.0, gr = 0.0; /* d/dz, and d/dlc, d/dlr besides z */
  for (int k = 0; k < LMLOSS_PREF_TYPES; k++) {
    const double w = p->w[k];
    if (w == 0.0) continue;
    double l = 0.0;
    switch (k) {
    case LMLOSS_PREF_SIGMOID:
      l = lmloss_pref_softplus(-z);
      gz += w * -lmloss_pref_sigmoid(-z);
      break;
    case LMLOSS_PREF_HINGE:
      l = fmax(1.0 - z, 0.0);
      gz += w * (1.0 - z > 0.0 ? -1.0 : 0.0);
      break;
    case LMLOSS_PREF_IPO:
    case LMLOSS_PREF_SIGMOID_NORM: {
      const double ic = 1.0 / fmax(x->nc, 1.0), ir = 1.0 / fmax(x->nr, 1.0);
      const double d = sc / fmax(x->nc, 1.0) - sr / fmax(x->nr, 1.0);
      double g;
      if (k == LMLOSS_PREF_IPO) {
        const double m = d - 1.0 / (2.0 * b);
        l = m * m, g = 2.0 * m;
      } else {
        l = lmloss_pref_softplus(-b * d), g = -b * lmloss_pref_sigmoid(-b * d);
      }
      gc += w * g * ic * dsc, gr -= w * g * ir * dsr;
      break;
    }
    case LMLOSS_PREF_EXO_PAIR: {
      /* KL of (sigmoid(z), sigmoid(-z)) from (1 - e, e) */
      const double qw = lmloss_pref_sigmoid(z), ql = lmloss_pref_sigmoid(-z);
      const double lpw = log1p(-e), lpl = log(e);
      l = qw * (-lmloss_pref_softplus(-z) - lpw) + ql * (-lmloss_pref_softplus(z) - lpl);
      gz += w * qw * ql * (z - lpw + lpl);
      break;
    }
    case LMLOSS_PREF_NCA_PAIR: {
      const double cr = b * lc, rr = b * lr;
      l = lmloss_pref_softplus(-cr) + 0.5 * lmloss_pref_softplus(cr) +
          0.5 * lmloss_pref_softplus(rr);
      gc += w * b * (-lmloss_pref_sigmoid(-cr) + 0.5 * lmloss_pref_sigmoid(cr));
      gr += w * b * 0.5 * lmloss_pref_sigmoid(rr);
      break;
    }
    case LMLOSS_PREF_ROBUST:
      l = ((1.0 - e) * lmloss_pref_softplus(-z) - e * lmloss_pref_softplus(z)) / (1.0 - 2.0 * e);
      gz +=
          w * (-(1.0 - e) * lmloss_pref_sigmoid(-z) - e * lmloss_pref_sigmoid(z)) / (1.0 - 2.0 * e);
      break;
    case LMLOSS_PREF_BCO_PAIR:
      l = lmloss_pref_softplus(-b * lc) + lmloss_pref_softplus(b * lr);
      gc += w * -b * lmloss_pref_sigmoid(-b * lc);
      gr += w * b * lmloss_pref_sigmoid(b * lr);
      break;
    case LMLOSS_PREF_SPPO_HARD: {
      const double mc = lc - 0.5 / b, mr = lr + 0.5 / b;
      l = mc * mc + mr * mr;
      gc += w * 2.0 * mc, gr += w * 2.0 * mr;
      break;
    }
    case LMLOSS_PREF_APO_ZERO:
      l = lmloss_pref_sigmoid(-b * lc) + lmloss_pref_sigmoid(b * lr);
      gc += w * -b * lmloss_pref_sigmoid(b * lc) * lmloss_pref_sigmoid(-b * lc);
      gr += w * b * lmloss_pref_sigmoid(b * lr) * lmloss_pref_sigmoid(-b * lr);
      break;
    case LMLOSS_PREF_APO_DOWN: {
      const double u = b * (lc - lr), su = lmloss_pref_sigmoid(u) * lmloss_pref_sigmoid(-u);
      l = lmloss_pref_sigmoid(b * lc) + lmloss_pref_sigmoid(-u);
      gc += w * (b * lmloss_pref_sigmoid(b * lc) * lmloss_pref_sigmoid(-b * lc) - b * su);
      gr += w * b * su;
      break;
    }
    case LMLOSS_PREF_DISCOPOP: {
      /* softplus(-z) (1 - m) + e^-z m, m = sigmoid(z / tau) */
      const double m = lmloss_pref_sigmoid(z / p->tau), sp = lmloss_pref_softplus(-z);
      const double ez = exp(-z), dm = m * lmloss_pref_sigmoid(-z / p->tau) / p->tau;
      l = sp * (1.0 - m) + ez * m;
      gz += w * (-lmloss_pref_sigmoid(-z) * (1.0 - m) - sp * dm - ez * m + ez * dm);
      break;
    }
    case LMLOSS_PREF_CPO_SIGMOID:
    case LMLOSS_PREF_SIMPO: {
      double dz;
      l = lmloss_pref_smoothed(k == LMLOSS_PREF_SIMPO ? z - p->gamma : z, e, &dz);
      gz += w * dz;
      break;
    }
    case LMLOSS_PREF_CPO_IPO: {
      const double m = sc - sr - 1.0 / (2.0 * b);
      l = m * m;
      gc += w * 2.0 * m * dsc, gr -= w * 2.0 * m * dsr;
      break;
    }
    case LMLOSS_PREF_ORPO: {
      /* log odds from c and r: d/dc = -1 / expm1(c), d/dr = 1 / expm1(r) */
      const double lo = lmloss_pref_log_odds(x);
      const double g = -b * lmloss_pref_sigmoid(-lo);
      l = b * lmloss_pref_softplus(-lo);
      gc += w * g * (-1.0 / expm1(x->c)), gr += w * g / expm1(x->r);
      break;
    }
    default: continue; /* the batch's terms */
    }
    loss += w * l;
  }
  *dc = x->w * (gz * b * dsc + gc);
  *dr = x->w * (-gz * b * dsr + gr);
  return x->w * loss;
}

/* The stable ascending rank of v[i] among v[0..n) (ties by index), read
 * with a stride. */
LMLOSS_HD int64_t lmloss_pref_rank(const double *v, int64_t n, int64_t i) {
  int64_t k = 0;
  for (int64_t j = 0; j < n; j++)
    k += v[j] < v[i] || (v[j] == v[i] && j < i);
  return k;
}

/* The workspace: a header, then 8 P doubles: AOT's policy and reference
 * margins (X, Y) and the same sorted, then AOT_UNPAIRED's chosen and
 * rejected log ratios and the same sorted. */
#define LMLOSS_PREF_WS_HEADER 256

LMLOSS_HD double lmloss_pref_at(const lmloss_tensor *t, int64_t i) {
  return t->data ? (double)((const float *)t->data)[i * t->row_stride] : 0.0;
}

LMLOSS_HD lmloss_pref_in lmloss_pref_load(const lmloss_pref_inputs *in, int64_t i) {
  lmloss_pref_in x;
  x.c = lmloss_pref_at(&in->chosen, i);
  x.r = lmloss_pref_at(&in->rejected, i);
  x.rc = lmloss_pref_at(&in->ref_chosen, i);
  x.rr = lmloss_pref_at(&in->ref_rejected, i);
  x.nc = lmloss_pref_at(&in->chosen_tokens, i);
  x.nr = lmloss_pref_at(&in->rejected_tokens, i);
  x.w = in->weight.data ? lmloss_pref_at(&in->weight, i) : 1.0;
  return x;
}

/* AOT's lists (ws: 8 P doubles), unsorted: pair i's entries. */
LMLOSS_HD void lmloss_pref_lists(const lmloss_pref_in *x, double *ws, int64_t P, int64_t i) {
  ws[i] = x->c - x->r;
  ws[P + i] = x->rc - x->rr;
  ws[4 * P + i] = x->c - x->rc;
  ws[5 * P + i] = x->r - x->rr;
}

/* Their sorted copies: entry i of each list into its rank's slot. */
LMLOSS_HD void lmloss_pref_sort(double *ws, int64_t P, int64_t i) {
  for (int l = 0; l < 2; l++)
    for (int h = 0; h < 2; h++) {
      const double *v = ws + (4 * l + h) * P;
      ws[(4 * l + 2 + h) * P + lmloss_pref_rank(v, P, i)] = v[i];
    }
}

/* Pair i's share of the loss (before the mean over pairs) and of the
 * derivatives in c and r: its own terms (*own), and the AOT terms at its
 * ranks (each sorted position once, as pair i's for its X rank). */
LMLOSS_HD double lmloss_pref_element(const lmloss_pref_par *p, const lmloss_pref_in *x,
                                     const double *ws, int64_t P, int64_t i, double *dc, double *dr,
                                     double *own) {
  double loss = lmloss_pref_pair(p, x, dc, dr), dz;
  *own = loss;
  const double b = p->beta;
  for (int l = 0; l < 2; l++) {
    const double w = p->w[l ? LMLOSS_PREF_AOT_UNPAIRED : LMLOSS_PREF_AOT];
    if (w == 0.0) continue;
    const double *X = ws + 4 * l * P, *Y = X + P, *Xs = X + 2 * P, *Ys = X + 3 * P;
    const int64_t k = lmloss_pref_rank(X, P, i);
    loss += w * lmloss_pref_smoothed(b * (X[i] - Ys[k]), p->eps, &dz);
    *dc += w * b * dz; /* X = c - r (AOT) or c - rc */
    if (!l) {
      *dr -= w * b * dz;
    } else { /* the rejected list's entry i sits at its own rank */
      const int64_t k2 = lmloss_pref_rank(Y, P, i);
      lmloss_pref_smoothed(b * (Xs[k2] - Y[i]), p->eps, &dz);
      *dr -= w * b * dz;
    }
  }
  return loss;
}

/* SFT's sums: the chosen sums, their tokens and the pairs' weights. */
LMLOSS_HD void lmloss_pref_sft_add(const lmloss_pref_in *x, double *s) {
  s[0] += x->c, s[1] += x->nc, s[2] += x->w;
}

/* The metrics' terms of a pair. */
LMLOSS_HD void lmloss_pref_metrics_add(const lmloss_pref_par *p, const lmloss_pref_in *x,
                                       double *m) {
  const double rc = p->beta * (x->c - x->rc), rr = p->beta * (x->r - x->rr);
  m[LMLOSS_PREF_M_PAIRS] += 1.0;
  m[LMLOSS_PREF_M_REWARD_CHOSEN] += rc;
  m[LMLOSS_PREF_M_REWARD_REJECTED] += rr;
  m[LMLOSS_PREF_M_ACCURACY] += rc > rr;
  m[LMLOSS_PREF_M_MARGIN] += rc - rr;
  m[LMLOSS_PREF_M_LOGP_CHOSEN] += x->c;
  m[LMLOSS_PREF_M_LOGP_REJECTED] += x->r;
  if (p->w[LMLOSS_PREF_ORPO] != 0.0) m[LMLOSS_PREF_M_ORPO_LOG_ODDS] += lmloss_pref_log_odds(x);
}

/* SFT's loss (the mean over pairs of -sum c / sum n, weighted) and its
 * derivative in each c, from the SFT sums. */
LMLOSS_HD double lmloss_pref_sft(const lmloss_pref_par *p, const double *s, double *dc) {
  const double w = p->w[LMLOSS_PREF_SFT];
  *dc = w != 0.0 ? -w * s[2] / p->P / s[1] : 0.0;
  return w != 0.0 ? -w * s[0] / s[1] * s[2] / p->P : 0.0;
}

/* Every stage on the host, pair after pair (REF and CPU). u: the upstream
 * gradient; loss, metrics and pair_loss may be NULL (the backward). */
static inline void lmloss_pref_host(const lmloss_pref_par *p, const lmloss_pref_inputs *in,
                                    double *ws, double u, float *loss, float *metrics, int64_t ms,
                                    const lmloss_tensor *pair_loss, const lmloss_tensor *dchosen,
                                    const lmloss_tensor *drejected) {
  const int64_t P = in->chosen.rows;
  const int aot = p->w[LMLOSS_PREF_AOT] != 0.0 || p->w[LMLOSS_PREF_AOT_UNPAIRED] != 0.0;
  double sft[3] = {0, 0, 0}, m[LMLOSS_PREF_METRICS] = {0}, total = 0.0, dsft;
  for (int64_t i = 0; i < P; i++) {
    lmloss_pref_in x = lmloss_pref_load(in, i);
    lmloss_pref_sft_add(&x, sft);
    if (aot) lmloss_pref_lists(&x, ws, P, i);
  }
  for (int64_t i = 0; aot && i < P; i++)
    lmloss_pref_sort(ws, P, i);
  const double lsft = lmloss_pref_sft(p, sft, &dsft);
  for (int64_t i = 0; i < P; i++) {
    lmloss_pref_in x = lmloss_pref_load(in, i);
    double dc, dr, own;
    total += lmloss_pref_element(p, &x, ws, P, i, &dc, &dr, &own);
    if (pair_loss) ((float *)pair_loss->data)[i * pair_loss->row_stride] = (float)own;
    lmloss_pref_metrics_add(p, &x, m);
    if (dchosen)
      ((float *)dchosen->data)[i * dchosen->row_stride] = (float)(u * (dc / p->P + dsft));
    if (drejected) ((float *)drejected->data)[i * drejected->row_stride] = (float)(u * dr / p->P);
  }
  if (loss) *loss = (float)(total / p->P + lsft);
  for (int k = 0; metrics && k < LMLOSS_PREF_METRICS; k++)
    metrics[k * ms] = (float)m[k];
}

#ifndef __CUDACC__
/* A backend's call on the host (REF's and the CPU's). */
static inline lmloss_status
lmloss_pref_host_call(const lmloss_pref_inputs *in, const lmloss_pref_options *opt,
                      const lmloss_pref_outputs *out, const lmloss_tensor *dloss,
                      const lmloss_tensor *dchosen, const lmloss_tensor *drejected, void *ws) {
  const lmloss_pref_par p = lmloss_pref_par_make(opt, in->chosen.rows);
  const double u = dloss ? ((const float *)dloss->data)[0] : 1.0;
  lmloss_pref_host(&p, in, (double *)((char *)ws + LMLOSS_PREF_WS_HEADER), u,
                   out ? (float *)out->loss.data : NULL,
                   out && out->metrics.data ? (float *)out->metrics.data : NULL,
                   out ? out->metrics.row_stride : 0,
                   out && out->pair_loss.data ? &out->pair_loss : NULL, dchosen, drejected);
  return LMLOSS_OK;
}
#endif

/* KTO's options, resolved, and one completion's term (weighted; NaN
 * where its inputs are) with its derivative in logp. */
typedef struct {
  int type;
  double beta, wd, wu;
} lmloss_kto_par;

LMLOSS_HD lmloss_kto_par lmloss_kto_par_make(const lmloss_kto_options *o) {
  lmloss_kto_par p;
  p.type = (int)o->loss_type;
  p.beta = o->beta;
  p.wd = o->desirable_weight;
  p.wu = o->undesirable_weight;
  return p;
}

/* Desirable: 1 - sigmoid(x) = sigmoid(-x); undesirable: 1 - sigmoid(-x) =
 * sigmoid(x); x = beta (lr - kl) (KTO) or beta lr (APO_ZERO_UNPAIRED). */
LMLOSS_HD double lmloss_kto_term(const lmloss_kto_par *p, double lr, int desirable, double kl,
                                 double *d) {
  const double x = p->beta * (p->type == LMLOSS_KTO_KTO ? lr - kl : lr);
  const double w = desirable ? p->wd : p->wu;
  const double sx = lmloss_pref_sigmoid(x), snx = lmloss_pref_sigmoid(-x);
  *d = w * (desirable ? -1.0 : 1.0) * p->beta * sx * snx;
  return w * (desirable ? snx : sx);
}

/* A completion's metrics' terms (m: 8 doubles; [6] counts the non-NaN
 * losses, the mean's divisor). */
LMLOSS_HD void lmloss_kto_add(const lmloss_kto_par *p, double lp, double lr, int desirable,
                              double loss, double *m) {
  const int k = desirable ? 0 : 1;
  m[LMLOSS_KTO_M_CHOSEN + k] += 1.0;
  if (!isnan(lr)) m[LMLOSS_KTO_M_REWARD_CHOSEN + k] += p->beta * lr;
  if (!isnan(lp)) m[LMLOSS_KTO_M_LOGP_CHOSEN + k] += lp;
  m[6] += !isnan(loss);
  m[7] += isnan(loss) ? 0.0 : loss;
}

/* Completion i's inputs: its log-prob sum, log ratio and label. */
LMLOSS_HD void lmloss_kto_load(const lmloss_kto_inputs *in, int64_t i, double *lp, double *lr,
                               int *desirable) {
  *lp = lmloss_pref_at(&in->logps, i);
  *lr = *lp - lmloss_pref_at(&in->ref_logps, i);
  *desirable = ((const unsigned char *)in->label.data)[i * in->label.row_stride] != 0;
}

#ifndef __CUDACC__
/* The call on the host (REF's and the CPU's): the metrics' sums (the mean's
 * divisor among them), then each completion's gradient. */
static inline lmloss_status lmloss_kto_host_call(const lmloss_kto_inputs *in,
                                                 const lmloss_kto_options *opt,
                                                 const lmloss_kto_outputs *out,
                                                 const lmloss_tensor *dloss,
                                                 const lmloss_tensor *dlogps) {
  const lmloss_kto_par p = lmloss_kto_par_make(opt);
  const int64_t N = in->logps.rows;
  const double kl = in->kl.data ? ((const float *)in->kl.data)[0] : 0.0;
  const double u = dloss ? ((const float *)dloss->data)[0] : 1.0;
  double m[8] = {0}, lp, lr, d;
  int des;
  for (int64_t i = 0; i < N; i++) {
    lmloss_kto_load(in, i, &lp, &lr, &des);
    lmloss_kto_add(&p, lp, lr, des, lmloss_kto_term(&p, lr, des, kl, &d), m);
  }
  for (int64_t i = 0; dlogps && i < N; i++) {
    lmloss_kto_load(in, i, &lp, &lr, &des);
    const double l = lmloss_kto_term(&p, lr, des, kl, &d);
    ((float *)dlogps->data)[i * dlogps->row_stride] = (float)(isnan(l) ? 0.0 : u * d / m[6]);
  }
  if (out) {
    *(float *)out->loss.data = (float)(m[7] / m[6]);
    for (int k = 0; out->metrics.data && k < LMLOSS_KTO_METRICS; k++)
      ((float *)out->metrics.data)[k * out->metrics.row_stride] = (float)(k < 6 ? m[k] : 0.0);
  }
  return LMLOSS_OK;
}
#endif

#endif
