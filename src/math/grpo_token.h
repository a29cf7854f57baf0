/*
 * grpo_token.h - one token's GRPO loss and derivatives, written once over
 * a real type R: grpo.h includes it twice, in double (every stage of every
 * backend) and in float (names ending in _f: the upstream of CUDA's one
 * pass on logits, lmloss_grpo_one_pass_dlogp). No include guard for that
 * reason; it needs grpo.h's lmloss_grpo_par.
 *
 * Why a float form: the one pass forms a token's upstream between its
 * row's statistics and its gradient's stores, in one thread while the
 * row waits in registers. In double the formula's registers made the
 * whole row kernel spill. The upstream multiplies fp32 probabilities
 * into a gradient stored in the logits' dtype, and TRL forms the same
 * formula in fp32, so float loses nothing either would keep. Where the
 * KL's term and the policy's cancel it loses what double keeps, and
 * lmloss_grpo_one_pass_dlogp takes the double form there. The loss and
 * metrics come from the stages, in double.
 */
#ifndef LMLOSS_GRPO_REAL
#define LMLOSS_GRPO_REAL double
#define LMLOSS_GRPO_NAME(name) name
#endif

#define R LMLOSS_GRPO_REAL
#define FN LMLOSS_GRPO_NAME

/* k3 = e^d - 1 - d: its Taylor series where expm1(d) - d would cancel
 * (|d| < 1/4: the terms to d^11 leave 1e-16 of it), else that difference,
 * which then loses at most a factor 8. */
LMLOSS_HD R FN(lmloss_grpo_k3)(R d) {
  if (fabs(d) < (R)0.25) {
    R s = (R)(1.0 / 39916800.0);
    s = (R)(1.0 / 3628800.0) + d * s;
    s = (R)(1.0 / 362880.0) + d * s;
    s = (R)(1.0 / 40320.0) + d * s;
    s = (R)(1.0 / 5040.0) + d * s;
    s = (R)(1.0 / 720.0) + d * s;
    s = (R)(1.0 / 120.0) + d * s;
    s = (R)(1.0 / 24.0) + d * s;
    s = (R)(1.0 / 6.0) + d * s;
    s = (R)0.5 + d * s;
    return d * d * s;
  }
  return expm1(d) - d;
}

/* One token's per-token loss and its derivatives. */
typedef struct {
  R loss; /* the per-token loss (before m and the weights) */
  R dlw;  /* d loss / d lw, through the ratio */
  R dlp;  /* d loss / d logp, directly */
  R kl;   /* beta's k3 (bias-corrected), 0 without beta */
  int low, high, cispo;
} FN(lmloss_grpo_tok);

/* lw: the token's log weight (r, or its sequence's); d: ref - logp; s:
 * the product of the masks and the IS ratio that scale the policy term;
 * phi: VESPO's. The differences come formed: a float caller forms them
 * in double, so that log-probs near -1000 keep their ratio.
 * min(a1, a2)'s gradient goes to the lesser, half to each on a tie, and
 * a clip passes it strictly inside its range: torch's rules since 2.14,
 * which TRL's gradient follows (with epsilon 0 and a ratio of 1, half of
 * it; torch 2.13's clip passed it at its bounds too, all of it). */
LMLOSS_HD FN(lmloss_grpo_tok)
    FN(lmloss_grpo_token)(const lmloss_grpo_par *p, R lw, R logp, R d, R adv, R s, R phi) {
  FN(lmloss_grpo_tok) o;
  const R c = exp(lw), lo = (R)p->lo, hi = (R)p->hi, delta = (R)p->delta;
  R pol = 0, dc = 0, dlp = 0;
  o.low = o.high = o.cispo = 0;
  if (p->type == LMLOSS_GRPO_CISPO) {
    const R cc = fmin(c, (R)p->eps_high);
    pol = -cc * adv * logp;
    dlp = -cc * adv;
    o.cispo = c > (R)p->eps_high && adv > 0;
  } else if (p->type == LMLOSS_GRPO_SAPO) {
    const R tau = (R)(adv > 0 ? p->tau_pos : p->tau_neg);
    const R x = tau * expm1(lw), e = exp(-fabs(x));
    const R sig = x >= 0 ? 1 / (1 + e) : e / (1 + e);
    pol = -sig * 4 / tau * adv;
    dc = -4 * e / ((1 + e) * (1 + e)) * adv; /* sigma (1 - sigma) */
  } else if (p->type == LMLOSS_GRPO_VESPO) {
    pol = -phi * adv * logp;
    dlp = -phi * adv;
  } else {
    const R c2 = fmin(fmax(c, lo), hi);
    const R c1 = delta > 0 ? fmin(c, delta) : c;
    const R g1 = delta > 0 && c >= delta ? 0 : adv;
    const R g2 = c > lo && c < hi ? adv : 0;
    const R a1 = c1 * adv, a2 = c2 * adv;
    pol = -fmin(a1, a2);
    dc = -(a1 < a2 ? g1 : a1 > a2 ? g2 : (R)0.5 * (g1 + g2));
    o.low = c1 < lo && adv < 0;
    o.high = c1 > hi && adv > 0;
  }
  o.loss = s * pol;
  dc *= s;
  dlp *= s;
  o.kl = 0;
  if (p->ref) {
    const R beta = (R)p->beta, k3 = FN(lmloss_grpo_k3)(d), dk = -expm1(d);
    const R w = p->bias ? c : 1;
    o.kl = k3 * w;
    o.loss += beta * o.kl;
    dlp += beta * dk * w;
    if (p->bias) dc += beta * k3;
  }
  o.dlw = dc * c;
  o.dlp = dlp;
  return o;
}

#undef R
#undef FN
#undef LMLOSS_GRPO_REAL
#undef LMLOSS_GRPO_NAME
