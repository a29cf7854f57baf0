/*
 * grpo.h - the GRPO family's per-token and per-sequence formulas
 * (lmloss.h's lmloss_grpo), written once for C and CUDA, in double: a
 * token's values cost nothing beside the log-probs that feed them, and
 * double keeps the ratio, its clip and k3 exact to fp32's last bit.
 *
 * A backend runs three stages over the sequences: (A) per-sequence sums of
 * lmloss_grpo_seq_add over the tokens, into a record of LMLOSS_GRPO_S_N
 * doubles per sequence; (B) the records' mask counts summed in sequence
 * order (BNPO's and the entropy bonus' divisors); (C) per token
 * lmloss_grpo_token with the sequence's scalars, its loss and metrics
 * summed into the record and its gradient written; then the records
 * summed in sequence order into the loss and metrics (lmloss_grpo_finish).
 * Every sum has a fixed order, so results do not depend on threads.
 */
#ifndef LMLOSS_MATH_GRPO_H
#define LMLOSS_MATH_GRPO_H

#include <float.h>
#include <math.h>

#include "rowstats.h"

/* A sequence's record (doubles): stage A's sums (MSUM to LIS), then stage
 * C's (POLICY to BENT). */
enum {
  LMLOSS_GRPO_S_MSUM,   /* sum of m */
  LMLOSS_GRPO_S_LR,     /* sum of r m (the sequence-level log weight) */
  LMLOSS_GRPO_S_OFF,    /* sum of (sampling - logp) m, NaN as 0 */
  LMLOSS_GRPO_S_VESPO,  /* VESPO's sum of clipped r m and log IS */
  LMLOSS_GRPO_S_EFF,    /* the bonus' tokens: m where the entropy mask keeps */
  LMLOSS_GRPO_S_LIS,    /* sum of (old - sampling) m, NaN as 0 (sequence IS modes) */
  LMLOSS_GRPO_S_POLICY, /* sum of the per-token loss m, weighted */
  LMLOSS_GRPO_S_KL,
  LMLOSS_GRPO_S_ENT,
  LMLOSS_GRPO_S_LOW,
  LMLOSS_GRPO_S_HIGH,
  LMLOSS_GRPO_S_REGION,
  LMLOSS_GRPO_S_CISPO,
  LMLOSS_GRPO_S_PHI,
  LMLOSS_GRPO_S_BENT, /* sum of entropy over the bonus' tokens */
  LMLOSS_GRPO_S_N = 16
};

/* The workspace: a header of two doubles (stage B's totals of MSUM and
 * EFF) on its own 256 bytes, then B records. */
#define LMLOSS_GRPO_WS_HEADER 256

/* The options, resolved for the formulas (lmloss_grpo_par_make). */
typedef struct {
  int type;       /* lmloss_grpo_loss_type */
  int seq;        /* SEQUENCE level */
  int bias;       /* bias-corrected KL */
  int off_policy; /* the off-policy mask */
  int thr;        /* an entropy threshold is given */
  int ent;        /* entropy is given */
  int ref;        /* beta > 0 */
  int is_cols;    /* 0 (no IS ratio), 1 or T */
  int adv_cols;   /* 1 or T */
  int old;        /* old_logp given */
  int samp;       /* sampling_logp given */
  int is_mode;    /* lmloss_grpo_is_mode */
  double lo, hi, eps_high, delta, beta;
  double tau_pos, tau_neg, k_pos, lam_pos, k_neg, lam_neg;
  double off_thr, coef, accum, lmax, B, is_min, is_max;
} lmloss_grpo_par;

LMLOSS_HD lmloss_grpo_par lmloss_grpo_par_make(const lmloss_grpo_options *o,
                                               const lmloss_grpo_inputs *in) {
  lmloss_grpo_par p;
  p.type = (int)o->loss_type;
  p.seq = o->level == LMLOSS_GRPO_SEQUENCE;
  p.bias = o->bias_correction_kl;
  p.off_policy = o->off_policy_mask;
  p.thr = in->entropy_threshold.data != 0;
  p.ent = in->entropy.data != 0;
  p.ref = o->beta > 0.0f;
  p.is_cols = in->is_ratio.data ? (int)in->is_ratio.cols : 0;
  p.adv_cols = (int)in->advantages.cols;
  p.old = in->old_logp.data != 0;
  p.samp = in->sampling_logp.data != 0;
  p.is_mode = (int)o->is_mode;
  p.is_min = o->is_min;
  p.is_max = o->is_max;
  if (p.is_mode != LMLOSS_GRPO_IS_GIVEN) /* formed per token, or once per sequence */
    p.is_cols = p.is_mode >= LMLOSS_GRPO_IS_SEQUENCE_TRUNCATE ? 1 : 2;
  p.lo = 1.0 - (double)o->epsilon_low;
  p.hi = 1.0 + (double)o->epsilon_high;
  p.eps_high = o->epsilon_high;
  p.delta = o->delta;
  p.beta = o->beta;
  p.tau_pos = o->sapo_temperature_pos;
  p.tau_neg = o->sapo_temperature_neg;
  p.k_pos = o->vespo_k_pos;
  p.lam_pos = o->vespo_lambda_pos;
  p.k_neg = o->vespo_k_neg;
  p.lam_neg = o->vespo_lambda_neg;
  p.off_thr = o->off_policy_threshold;
  p.coef = o->entropy_coef;
  p.accum = o->accumulation_steps;
  p.lmax = o->max_completion_length > 0 ? (double)o->max_completion_length : (double)in->logp.cols;
  p.B = (double)in->logp.rows;
  return p;
}

/* The token-sum types, which num_items divides (and not accumulation). */
LMLOSS_HD int lmloss_grpo_by_items(const lmloss_grpo_par *p) {
  return p->type == LMLOSS_GRPO_DAPO || p->type == LMLOSS_GRPO_CISPO ||
         p->type == LMLOSS_GRPO_VESPO;
}

/* The types of the two-sided clip, whose clip metrics TRL logs. */
LMLOSS_HD int lmloss_grpo_clipped(const lmloss_grpo_par *p) {
  return p->type != LMLOSS_GRPO_CISPO && p->type != LMLOSS_GRPO_SAPO &&
         p->type != LMLOSS_GRPO_VESPO;
}

/* torch.nan_to_num in fp32: NaN 0, infinities the largest floats. */
LMLOSS_HD double lmloss_grpo_nan0(double x) {
  if (isnan(x)) return 0.0;
  return fmin(fmax(x, -(double)FLT_MAX), (double)FLT_MAX);
}

/* Whether the entropy mask keeps a token (no threshold: every token). */
LMLOSS_HD int lmloss_grpo_keep_entropy(const lmloss_grpo_par *p, double ent, double m, double thr) {
  return !p->thr || (ent * m >= thr && m != 0.0);
}

/* A token's log(IS ratio) in VESPO's sum: clipped to [log 1e-8, 20]. */
LMLOSS_HD double lmloss_grpo_log_is(double is) { return fmin(fmax(log(is), log(1e-8)), 20.0); }

/* Stage A: a token's terms of its sequence's record (m != 0). thr: the
 * entropy threshold; is: the token's IS ratio (is_cols T). */
LMLOSS_HD void lmloss_grpo_seq_add(const lmloss_grpo_par *p, double *rec, double m, double logp,
                                   double old, double samp, double ent, double thr) {
  const double r = logp - old;
  rec[LMLOSS_GRPO_S_MSUM] += m;
  rec[LMLOSS_GRPO_S_LR] += r * m;
  if (p->off_policy) rec[LMLOSS_GRPO_S_OFF] += lmloss_grpo_nan0(samp - logp) * m;
  if (p->type == LMLOSS_GRPO_VESPO) rec[LMLOSS_GRPO_S_VESPO] += fmin(fmax(r, -20.0), 20.0) * m;
  if (lmloss_grpo_keep_entropy(p, ent, m, thr)) rec[LMLOSS_GRPO_S_EFF] += m;
}

/* The sequence's log importance weight (SEQUENCE level). */
LMLOSS_HD double lmloss_grpo_seq_lw(const double *rec) {
  return rec[LMLOSS_GRPO_S_LR] / fmax(rec[LMLOSS_GRPO_S_MSUM], 1.0);
}

/* Whether the off-policy mask keeps a token of advantage adv. */
LMLOSS_HD int lmloss_grpo_keep_off(const lmloss_grpo_par *p, const double *rec, double adv) {
  return !p->off_policy || adv >= 0.0 ||
         rec[LMLOSS_GRPO_S_OFF] / fmax(rec[LMLOSS_GRPO_S_MSUM], 1.0) <= p->off_thr;
}

/* VESPO's gamma weight phi of a sequence (its record's sum) for adv,
 * normalized so that phi(1) = 1; a non-finite phi reads 0. */
LMLOSS_HD double lmloss_grpo_phi(const lmloss_grpo_par *p, const double *rec, double adv) {
  const double lw = fmin(fmax(rec[LMLOSS_GRPO_S_VESPO], log(1e-8)), 20.0);
  const double k = adv >= 0.0 ? p->k_pos : p->k_neg;
  const double lam = fmax(adv >= 0.0 ? p->lam_pos : p->lam_neg, 1e-4);
  const double phi = exp(lam + k * lw - lam * exp(lw));
  return isfinite(phi) ? phi : 0.0;
}

/* The weight of a sequence's token sum in the policy term, before
 * accumulation (msum: its mask's sum; total: all sequences'). */
LMLOSS_HD double lmloss_grpo_seq_weight(const lmloss_grpo_par *p, double msum, double total,
                                        double items) {
  switch (p->type) {
  case LMLOSS_GRPO_GRPO:
  case LMLOSS_GRPO_SAPO: return 1.0 / (p->B * fmax(msum, 1.0));
  case LMLOSS_GRPO_BNPO: return 1.0 / fmax(total, 1.0);
  case LMLOSS_GRPO_DR_GRPO: return 1.0 / (p->B * p->lmax);
  case LMLOSS_GRPO_LUSPO: return 1.0 / p->B;
  default: return 1.0 / items;
  }
}

/* What the policy term is divided by beside its weights. */
LMLOSS_HD double lmloss_grpo_accum_div(const lmloss_grpo_par *p) {
  return lmloss_grpo_by_items(p) ? 1.0 : p->accum;
}

/* A token's inputs, with the absent ones' stand-ins: old = logp,
 * sampling = old, entropy 0, IS ratio 1. */
typedef struct {
  double m, logp, old, samp, ref, adv, ent, is;
} lmloss_grpo_in;

#include "grpo_token.h" /* in double: every stage's formula */
#define LMLOSS_GRPO_REAL float
#define LMLOSS_GRPO_NAME(name) name##_f
#include "grpo_token.h" /* in float: the one pass's upstream (grpo_token.h says why) */

/* Per-sequence clip metrics (SEQUENCE with advantages [B, 1]: TRL's
 * flags are [B, 1] then), counted once per sequence whatever its mask. */
LMLOSS_HD int lmloss_grpo_clip_per_seq(const lmloss_grpo_par *p) {
  return p->seq && p->adv_cols == 1;
}

/* vLLM's ratio from its log (a formed is_mode): clipped or masked. */
LMLOSS_HD double lmloss_grpo_is_of(const lmloss_grpo_par *p, double log_ratio) {
  const double r = exp(log_ratio);
  if (p->is_mode == LMLOSS_GRPO_IS_TOKEN_TRUNCATE || p->is_mode == LMLOSS_GRPO_IS_SEQUENCE_TRUNCATE)
    return fmin(fmax(r, p->is_min), p->is_max);
  return r < p->is_min || r > p->is_max ? 0.0 : r;
}

/* A token's log IS ratio term, (old - sampling) m with NaN as 0. */
LMLOSS_HD double lmloss_grpo_is_log(double old, double samp, double m) {
  return lmloss_grpo_nan0((old - samp) * m);
}

/* Element (b, j) of an F32 [B, T] or [B, 1] tensor (broadcast over j). */
LMLOSS_HD double lmloss_grpo_at(const lmloss_tensor *t, int64_t b, int64_t j) {
  return ((const float *)t->data)[b * t->row_stride + (t->cols == 1 ? 0 : j)];
}

/* Token (b, t)'s given inputs, before its log-prob is known (the one
 * pass on logits loads them while the row's logits are read); the
 * stand-ins are lmloss_grpo_with_logp's. */
LMLOSS_HD lmloss_grpo_in lmloss_grpo_load_given(const lmloss_grpo_par *p,
                                                const lmloss_grpo_inputs *in, int64_t b,
                                                int64_t t) {
  lmloss_grpo_in x;
  x.m = lmloss_grpo_at(&in->mask, b, t);
  x.logp = 0.0;
  x.old = p->old ? lmloss_grpo_at(&in->old_logp, b, t) : 0.0;
  x.samp = p->samp ? lmloss_grpo_at(&in->sampling_logp, b, t) : 0.0;
  x.ref = p->ref ? lmloss_grpo_at(&in->ref_logp, b, t) : 0.0;
  x.adv = lmloss_grpo_at(&in->advantages, b, t);
  x.ent = p->ent ? lmloss_grpo_at(&in->entropy, b, t) : 0.0;
  x.is =
      p->is_mode == LMLOSS_GRPO_IS_GIVEN && p->is_cols ? lmloss_grpo_at(&in->is_ratio, b, t) : 1.0;
  return x;
}

/* x (lmloss_grpo_load_given's) with its log-prob, the stand-ins of the
 * absent inputs and an IS ratio formed per token. */
LMLOSS_HD lmloss_grpo_in lmloss_grpo_with_logp(const lmloss_grpo_par *p, lmloss_grpo_in x,
                                               double logp) {
  x.logp = logp;
  if (!p->old) x.old = x.logp;
  if (!p->samp) x.samp = x.old;
  if (p->is_mode != LMLOSS_GRPO_IS_GIVEN && p->is_mode < LMLOSS_GRPO_IS_SEQUENCE_TRUNCATE)
    x.is = lmloss_grpo_is_of(p, lmloss_grpo_is_log(x.old, x.samp, x.m));
  return x; /* a sequence mode's ratio is the sequence's: lmloss_grpo_stage_c */
}

LMLOSS_HD lmloss_grpo_in lmloss_grpo_load_at(const lmloss_grpo_par *p, const lmloss_grpo_inputs *in,
                                             int64_t b, int64_t t, double logp) {
  return lmloss_grpo_with_logp(p, lmloss_grpo_load_given(p, in, b, t), logp);
}

/* Token (b, t)'s inputs, its log-prob from in->logp (lmloss_grpo_load_at:
 * the one pass on logits forms it instead). */
LMLOSS_HD lmloss_grpo_in lmloss_grpo_load(const lmloss_grpo_par *p, const lmloss_grpo_inputs *in,
                                          int64_t b, int64_t t) {
  return lmloss_grpo_load_at(p, in, b, t, lmloss_grpo_at(&in->logp, b, t));
}

/* Stage A's terms of a token: those of its mask (m != 0), and VESPO's log
 * IS ratio, which TRL sums over every token of an IS ratio [B, T] and
 * takes once of one [B, 1] (t = 0). */
LMLOSS_HD void lmloss_grpo_stage_a(const lmloss_grpo_par *p, const lmloss_grpo_in *x, int64_t t,
                                   double thr, double *rec) {
  if (p->type == LMLOSS_GRPO_VESPO && p->is_cols && (p->is_cols > 1 || t == 0))
    rec[LMLOSS_GRPO_S_VESPO] += lmloss_grpo_log_is(x->is);
  if (x->m != 0.0) lmloss_grpo_seq_add(p, rec, x->m, x->logp, x->old, x->samp, x->ent, thr);
  if (p->is_mode >= LMLOSS_GRPO_IS_SEQUENCE_TRUNCATE && x->m != 0.0)
    rec[LMLOSS_GRPO_S_LIS] += lmloss_grpo_is_log(x->old, x->samp, x->m);
}

/* Stage C's per-token values: the multiplier s of the policy term and
 * the token's lmloss_grpo_token; *keep_e: the entropy mask's verdict. */
LMLOSS_HD lmloss_grpo_tok lmloss_grpo_stage_c(const lmloss_grpo_par *p, const double *rec,
                                              const lmloss_grpo_in *x, double thr, int *keep_e) {
  *keep_e = lmloss_grpo_keep_entropy(p, x->ent, x->m, thr);
  const double is = p->is_mode >= LMLOSS_GRPO_IS_SEQUENCE_TRUNCATE
                        ? lmloss_grpo_is_of(p, rec[LMLOSS_GRPO_S_LIS])
                        : x->is;
  const double s = (lmloss_grpo_keep_off(p, rec, x->adv) && *keep_e ? 1.0 : 0.0) *
                   (p->type == LMLOSS_GRPO_VESPO ? 1.0 : is);
  const double phi = p->type == LMLOSS_GRPO_VESPO ? lmloss_grpo_phi(p, rec, x->adv) : 0.0;
  const double lw = p->seq ? lmloss_grpo_seq_lw(rec) : x->logp - x->old;
  return lmloss_grpo_token(p, lw, x->logp, x->ref - x->logp, x->adv, s, phi);
}

/* The metrics of a token (m != 0) into rec (seq: its sequence's stage A
 * record; the two may be the same array); the per-sequence ones
 * (lmloss_grpo_clip_per_seq, VESPO's phi of advantages [B, 1]) are
 * lmloss_grpo_seq_metrics'. */
LMLOSS_HD void lmloss_grpo_token_metrics(const lmloss_grpo_par *p, const double *seq,
                                         const lmloss_grpo_in *x, const lmloss_grpo_tok *o,
                                         int keep_e, double *rec) {
  rec[LMLOSS_GRPO_S_KL] += o->kl * x->m;
  rec[LMLOSS_GRPO_S_ENT] += x->ent * x->m;
  if (keep_e) rec[LMLOSS_GRPO_S_BENT] += x->ent * x->m;
  if (!lmloss_grpo_clip_per_seq(p)) {
    rec[LMLOSS_GRPO_S_LOW] += o->low * x->m;
    rec[LMLOSS_GRPO_S_HIGH] += o->high * x->m;
    rec[LMLOSS_GRPO_S_REGION] += (o->low || o->high) * x->m;
    rec[LMLOSS_GRPO_S_CISPO] += o->cispo * x->m;
  }
  if (p->type == LMLOSS_GRPO_VESPO && p->adv_cols > 1)
    rec[LMLOSS_GRPO_S_PHI] += lmloss_grpo_phi(p, seq, x->adv) * x->m;
}

/* The per-sequence metrics of sequence b (whatever its mask). */
LMLOSS_HD void lmloss_grpo_seq_metrics(const lmloss_grpo_par *p, const lmloss_grpo_inputs *in,
                                       int64_t b, double *rec) {
  const double adv = lmloss_grpo_at(&in->advantages, b, 0);
  if (lmloss_grpo_clip_per_seq(p)) {
    lmloss_grpo_tok o = lmloss_grpo_token(p, lmloss_grpo_seq_lw(rec), 0.0, 0.0, adv, 1.0, 0.0);
    rec[LMLOSS_GRPO_S_LOW] = o.low;
    rec[LMLOSS_GRPO_S_HIGH] = o.high;
    rec[LMLOSS_GRPO_S_REGION] = o.low || o.high;
    rec[LMLOSS_GRPO_S_CISPO] = o.cispo;
  }
  if (p->type == LMLOSS_GRPO_VESPO && p->adv_cols == 1)
    rec[LMLOSS_GRPO_S_PHI] = lmloss_grpo_phi(p, rec, adv);
}

/* Whether a token's d loss / d logp needs only its own log-prob beside
 * its sequence's mask sum (lmloss_grpo_logits' one pass): token level, no
 * off-policy or entropy mask, no entropy bonus, no VESPO or sequence IS
 * ratio, each of which reads other tokens' log-probs or entropies. */
LMLOSS_HD int lmloss_grpo_one_pass(const lmloss_grpo_par *p) {
  return !p->seq && !p->off_policy && !p->thr && p->coef == 0.0 && p->type != LMLOSS_GRPO_VESPO &&
         p->is_mode < LMLOSS_GRPO_IS_SEQUENCE_TRUNCATE;
}

/* d loss / d logp of token x (its log-prob and stand-ins in place:
 * lmloss_grpo_with_logp) at upstream 1 where lmloss_grpo_one_pass holds,
 * so that no mask but its own applies and its weight is its own ratio:
 * stage C's value, with its sequence's factor sc
 * (lmloss_grpo_token_scale), in float for CUDA's one pass. Its
 * differences are formed in double before they are rounded, so that
 * log-probs near -1000 keep their ratio. Where the KL's term and the
 * policy's cancel to under 1/16 of their size, float's rounding of each
 * would be a visible part of the sum: such a token takes the double form,
 * a branch its row's thread rarely takes. */
LMLOSS_HD float lmloss_grpo_one_pass_dlogp(const lmloss_grpo_par *p, const lmloss_grpo_in *x,
                                           float sc) {
  if (x->m == 0.0) return 0.0f;
  const double lw = x->logp - x->old, d = x->ref - x->logp;
  const lmloss_grpo_tok_f o = lmloss_grpo_token_f(p, (float)lw, (float)x->logp, (float)d,
                                                  (float)x->adv, (float)x->is, 0.0f);
  float up = o.dlp + o.dlw;
  if (fabsf(up) < 0.0625f * (fabsf(o.dlp) + fabsf(o.dlw))) {
    const lmloss_grpo_tok e = lmloss_grpo_token(p, lw, x->logp, d, x->adv, x->is, 0.0);
    up = (float)(e.dlp + e.dlw);
  }
  return (float)x->m * sc * up;
}

/* The factor of a token's derivatives in the loss, m w / accumulation
 * (w: lmloss_grpo_seq_weight). */
LMLOSS_HD double lmloss_grpo_token_scale(const lmloss_grpo_par *p, const double *rec,
                                         const double *tot, double items) {
  return lmloss_grpo_seq_weight(p, rec[LMLOSS_GRPO_S_MSUM], tot[0], items) /
         lmloss_grpo_accum_div(p);
}

/* d loss / d entropy of a token the bonus keeps, per unit of m. */
LMLOSS_HD double lmloss_grpo_dentropy(const lmloss_grpo_par *p, const double *tot) {
  return -p->coef / fmax(tot[1], 1.0) / p->accum;
}

/* The least and greatest of a, b ignoring NaN (TRL's nanmin, nanmax). */
LMLOSS_HD double lmloss_grpo_nanmin(double a, double b) {
  return isnan(a) ? b : isnan(b) ? a : fmin(a, b);
}
LMLOSS_HD double lmloss_grpo_nanmax(double a, double b) {
  return isnan(a) ? b : isnan(b) ? a : fmax(a, b);
}

/* A sequence's mean of a clip flag (NaN for an empty sequence, as TRL's
 * 0 / 0), per token or per sequence. */
LMLOSS_HD double lmloss_grpo_seq_mean(const lmloss_grpo_par *p, const double *rec, int k) {
  return lmloss_grpo_clip_per_seq(p) ? rec[k] : rec[k] / rec[LMLOSS_GRPO_S_MSUM];
}

/* loss[0] and metrics[LMLOSS_GRPO_METRICS] (each metrics_stride apart;
 * metrics may be NULL) from the records summed in sequence order (acc)
 * and the least and greatest sequence means (NaN when none). */
LMLOSS_HD void lmloss_grpo_finish(const lmloss_grpo_par *p, const double *acc, double low_min,
                                  double high_max, float *loss, float *metrics,
                                  int64_t metrics_stride) {
  const double nan = NAN, bent = acc[LMLOSS_GRPO_S_BENT], beff = acc[LMLOSS_GRPO_S_EFF];
  const double policy = acc[LMLOSS_GRPO_S_POLICY];
  const double bonus = p->coef != 0.0 ? p->coef * (bent / fmax(beff, 1.0) / p->accum) : 0.0;
  *loss = (float)(policy / lmloss_grpo_accum_div(p) - bonus);
  if (!metrics) return;
  double m[LMLOSS_GRPO_METRICS];
  const int clip = lmloss_grpo_clipped(p);
  m[LMLOSS_GRPO_M_TOKENS] = acc[LMLOSS_GRPO_S_MSUM];
  m[LMLOSS_GRPO_M_KL] = p->ref ? acc[LMLOSS_GRPO_S_KL] : nan;
  m[LMLOSS_GRPO_M_ENTROPY] = p->ent ? acc[LMLOSS_GRPO_S_ENT] : nan;
  m[LMLOSS_GRPO_M_CLIP_LOW] = clip ? acc[LMLOSS_GRPO_S_LOW] : nan;
  m[LMLOSS_GRPO_M_CLIP_HIGH] = clip ? acc[LMLOSS_GRPO_S_HIGH] : nan;
  m[LMLOSS_GRPO_M_CLIP_REGION] = clip ? acc[LMLOSS_GRPO_S_REGION] : nan;
  m[LMLOSS_GRPO_M_CLIP_COUNT] = lmloss_grpo_clip_per_seq(p) ? p->B : acc[LMLOSS_GRPO_S_MSUM];
  m[LMLOSS_GRPO_M_CLIP_LOW_MIN] = clip ? low_min : nan;
  m[LMLOSS_GRPO_M_CLIP_HIGH_MAX] = clip ? high_max : nan;
  m[LMLOSS_GRPO_M_CISPO_CLIP] = p->type == LMLOSS_GRPO_CISPO ? acc[LMLOSS_GRPO_S_CISPO] : nan;
  m[LMLOSS_GRPO_M_PHI] = p->type == LMLOSS_GRPO_VESPO ? acc[LMLOSS_GRPO_S_PHI] : nan;
  m[LMLOSS_GRPO_M_PHI_COUNT] = p->adv_cols == 1 ? p->B : acc[LMLOSS_GRPO_S_MSUM];
  m[LMLOSS_GRPO_M_POLICY_LOSS] = policy;
  m[LMLOSS_GRPO_M_BONUS_ENTROPY] = p->ent ? bent : nan;
  m[LMLOSS_GRPO_M_BONUS_TOKENS] = beff;
  for (int k = LMLOSS_GRPO_M_BONUS_TOKENS + 1; k < LMLOSS_GRPO_METRICS; k++)
    m[k] = 0.0;
  for (int k = 0; k < LMLOSS_GRPO_METRICS; k++)
    metrics[k * metrics_stride] = (float)m[k];
}

/* The stages run one sequence at a time on the host (the REF and CPU
 * backends; CUDA splits each over a CTA). thr: the entropy threshold;
 * items: num_items; tot: stage B's totals; u: the upstream gradient. */
static inline void lmloss_grpo_host_a(const lmloss_grpo_par *p, const lmloss_grpo_inputs *in,
                                      int64_t b, double thr, double *rec) {
  for (int k = 0; k < LMLOSS_GRPO_S_N; k++)
    rec[k] = 0.0;
  for (int64_t t = 0; t < in->logp.cols; t++) {
    lmloss_grpo_in x = lmloss_grpo_load(p, in, b, t);
    lmloss_grpo_stage_a(p, &x, t, thr, rec);
  }
}

static inline void lmloss_grpo_host_c(const lmloss_grpo_par *p, const lmloss_grpo_inputs *in,
                                      int64_t b, double thr, double items, const double *tot,
                                      double u, int want_loss, const lmloss_tensor *dlogp,
                                      const lmloss_tensor *dentropy, double *rec) {
  const int64_t T = in->logp.cols;
  const double w = lmloss_grpo_seq_weight(p, rec[LMLOSS_GRPO_S_MSUM], tot[0], items);
  const double sc = lmloss_grpo_token_scale(p, rec, tot, items) * u;
  const double de = lmloss_grpo_dentropy(p, tot) * u;
  double g = 0.0; /* d loss / d lw of the sequence (SEQUENCE level) */
  float *dl = dlogp ? (float *)dlogp->data + b * dlogp->row_stride : 0;
  float *dh = dentropy ? (float *)dentropy->data + b * dentropy->row_stride : 0;
  for (int64_t t = 0; t < T; t++) {
    lmloss_grpo_in x = lmloss_grpo_load(p, in, b, t);
    double dlp = 0.0, dent = 0.0;
    if (x.m != 0.0) {
      int keep_e;
      lmloss_grpo_tok o = lmloss_grpo_stage_c(p, rec, &x, thr, &keep_e);
      if (want_loss) {
        rec[LMLOSS_GRPO_S_POLICY] += o.loss * x.m * w;
        lmloss_grpo_token_metrics(p, rec, &x, &o, keep_e, rec);
      }
      dlp = x.m * sc * (o.dlp + (p->seq ? 0.0 : o.dlw));
      g += x.m * sc * o.dlw;
      dent = keep_e ? de * x.m : 0.0;
    }
    if (dl && !p->seq) dl[t] = (float)dlp;
    if (dh) dh[t] = (float)dent;
  }
  if (want_loss) lmloss_grpo_seq_metrics(p, in, b, rec);
  if (!dl || !p->seq) return;
  /* SEQUENCE: each token's share of the sequence's log weight, m / max(sum m, 1) */
  for (int64_t t = 0; t < T; t++) {
    lmloss_grpo_in x = lmloss_grpo_load(p, in, b, t);
    double dlp = 0.0;
    if (x.m != 0.0) {
      int keep_e;
      lmloss_grpo_tok o = lmloss_grpo_stage_c(p, rec, &x, thr, &keep_e);
      dlp = x.m * sc * o.dlp + g * x.m / fmax(rec[LMLOSS_GRPO_S_MSUM], 1.0);
    }
    dl[t] = (float)dlp;
  }
}

/* The loss and metrics from B records, summed in sequence order. */
static inline void lmloss_grpo_host_finish(const lmloss_grpo_par *p, const double *recs, int64_t B,
                                           float *loss, float *metrics, int64_t metrics_stride) {
  double acc[LMLOSS_GRPO_S_N] = {0}, lo = NAN, hi = NAN;
  for (int64_t b = 0; b < B; b++) {
    const double *rec = recs + b * LMLOSS_GRPO_S_N;
    for (int k = 0; k < LMLOSS_GRPO_S_N; k++)
      acc[k] += rec[k];
    lo = lmloss_grpo_nanmin(lo, lmloss_grpo_seq_mean(p, rec, LMLOSS_GRPO_S_LOW));
    hi = lmloss_grpo_nanmax(hi, lmloss_grpo_seq_mean(p, rec, LMLOSS_GRPO_S_HIGH));
  }
  lmloss_grpo_finish(p, acc, lo, hi, loss, metrics, metrics_stride);
}

#ifndef __CUDACC__
/* Every stage over sequences [0, B) with `threads` OpenMP threads (1:
 * none): REF runs it on one, the CPU on its threads, with the same bits
 * (every sum in sequence order). ws: lmloss_grpo_workspace_size bytes. */
static inline lmloss_status lmloss_grpo_host(const lmloss_grpo_inputs *in,
                                             const lmloss_grpo_options *opt,
                                             const lmloss_grpo_outputs *out,
                                             const lmloss_tensor *dloss, const lmloss_tensor *dlogp,
                                             const lmloss_tensor *dentropy, void *ws, int threads) {
  const lmloss_grpo_par p = lmloss_grpo_par_make(opt, in);
  const int64_t B = in->logp.rows;
  double *tot = (double *)ws, *recs = (double *)((char *)ws + LMLOSS_GRPO_WS_HEADER);
  const double thr = p.thr ? ((const float *)in->entropy_threshold.data)[0] : 0.0;
  const double items = in->num_items.data ? ((const float *)in->num_items.data)[0] : opt->num_items;
  const double u = dloss ? ((const float *)dloss->data)[0] : 1.0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < B; b++)
    lmloss_grpo_host_a(&p, in, b, thr, recs + b * LMLOSS_GRPO_S_N);
  tot[0] = tot[1] = 0.0;
  for (int64_t b = 0; b < B; b++) {
    tot[0] += recs[b * LMLOSS_GRPO_S_N + LMLOSS_GRPO_S_MSUM];
    tot[1] += recs[b * LMLOSS_GRPO_S_N + LMLOSS_GRPO_S_EFF];
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < B; b++)
    lmloss_grpo_host_c(&p, in, b, thr, items, tot, u, out != NULL, dlogp, dentropy,
                       recs + b * LMLOSS_GRPO_S_N);
  if (out)
    lmloss_grpo_host_finish(&p, recs, B, (float *)out->loss.data,
                            out->metrics.data ? (float *)out->metrics.data : NULL,
                            out->metrics.row_stride);
  return LMLOSS_OK;
}
#endif

#endif
