/*
 * ce.cu - cross-entropy forward, fused forward+backward and backward on
 * CUDA, with every option of lmloss_ce_options.
 *
 * Launch sequence (all on the caller's stream, nothing allocated):
 *   [ce_denominator]  MEAN with a gradient: sum of class_weight[y] over
 *                     supervised rows into the workspace header, so the
 *                     row kernel can scale gradients in the same pass.
 *   ce_rows           per row: statistics, loss, optional outputs, and
 *                     the gradient row when asked (ce_held instead for
 *                     the plain gradient rows of held.cuh's plan).
 *   [ce_finalize]     reduced losses: fixed-order sum of the per-row
 *                     losses and weights kept in the workspace (double).
 * ce_rows also runs the row contract's phases over a vocabulary shard
 * (CeShard): a state is its first pass, a finish the rest from the
 * merged state.
 * Workspace: header (256 bytes: [0] denominator, double), then per-row
 * loss [N] and per-row weight [N] in double; the trailing N int64 unused.
 * A target outside [0, V) that is not ignore_index gives NaN for its row
 * (loss and gradient) and weight 0 in the MEAN denominator.
 */
#include <type_traits>

#include "held.cuh"
#include "math/grpo.h"
#include "staged.cuh"

namespace lmc {

/* GRPO on logits in one pass (lmloss_grpo_logits): row i = b T + t is
 * token t of sequence b; its upstream is -(d loss / d logp) of its
 * log-prob, formed once the row's statistics are known, and its logp
 * goes where a NONE loss would. */
struct GrpoPass {
  int on;
  int64_t T;
  lmloss_grpo_par p;
  lmloss_grpo_inputs in;
  const double *scale; /* [B]: lmloss_grpo_token_scale of each sequence */
  /* [N]: each row's mask and target logit (gather_targets). A masked row
   * (mask 0) has a zero gradient and no use for its log-prob: its
   * gradient is written without its logits being read, its log-prob as 0. */
  const float2 *row;
};

/* A row's GRPO inputs and its upstream, in the CTA's shared memory: its
 * first thread loads the inputs while the row's logits are read, and
 * forms the upstream from them once the row's log-prob is known. */
struct GrpoRow {
  lmloss_grpo_in x; /* lmloss_grpo_load_given's */
  double sc;        /* the sequence's lmloss_grpo_token_scale */
  float G;
};

__device__ __forceinline__ void grpo_stage(const GrpoPass &g, int64_t i, GrpoRow *r) {
  if (threadIdx.x != 0) return;
  const int64_t b = i / g.T, t = i % g.T;
  r->x = lmloss_grpo_load_given(&g.p, &g.in, b, t);
  r->sc = g.scale[b];
}

/* Row i's upstream, the gradient of its CE loss -logp being -dlogp, from
 * grpo_stage's r: formed by the CTA's first thread (in every thread, the
 * formula cost a row's CTAs more issue slots than its elements). Every
 * thread of the CTA calls it. */
__device__ __forceinline__ float grpo_upstream(const GrpoPass &g, double logp, GrpoRow *r) {
  if (threadIdx.x == 0) {
    const lmloss_grpo_in x = lmloss_grpo_with_logp(&g.p, r->x, logp);
    r->G = -lmloss_grpo_one_pass_dlogp(&g.p, &x, (float)r->sc);
  }
  __syncthreads();
  return r->G;
}

/* CE_STATE: a vocabulary shard's row states (lmloss.h's row contract)
 * instead of outputs. */
enum CeMode { CE_FWD = 0, CE_FUSED = 1, CE_BWD = 2, CE_STATE = 3 };

/* Whether a mode writes a gradient (the host's test; ce_rows spells it
 * out, where a call here changed the kernel's register allocation). */
static constexpr bool ce_writes_grad(int mode) { return mode == CE_FUSED || mode == CE_BWD; }

/* A vocabulary shard: the logits' V columns are [col0, col0 + V) of vocab
 * (the one-shot call: 0 and V). CE_STATE writes each row's state to
 * state_out; a finish (any other mode) takes the merged states state_in
 * in place of its first pass. Rows of sts floats. */
struct CeShard {
  int64_t col0, vocab, sts;
  float *state_out;
  const float *state_in;
  int entropy; /* CE_STATE: carry the entropy sum t */
};

struct CeArgs {
  const void *x;
  int64_t N, V, xs;
  const void *tgt;
  int tgt64;
  int64_t ts;
  const float *tw;
  int64_t tws;
  const float *cw;
  int64_t cws;
  long long ignore;
  float eps, zl;
  int dft, mode, reduction, zero_ignored;
  Xf X;
  /* outputs */
  float *loss; /* NONE (forward): [N] */
  int64_t ls;
  float *lse, *ent;
  int64_t lses, ents;
  long long *amax;
  int64_t ams;
  void *dx;
  int64_t dxs;
  lmloss_dtype dxt;        /* dx's dtype */
  lmloss_row_keep keep;    /* optional arrays, with dx */
  double *ws_loss, *ws_wt; /* forward: per-row loss and weight */
  const double *den;       /* MEAN with a gradient */
  float grad_output;       /* fused */
  const float *dloss;      /* backward */
  int64_t dls;
  double num_items;
  int cs;
  int64_t chunk;
  int staged;
  GrpoPass grpo;
  CeShard sh;
};

/* The weight of row i in the MEAN denominator (0 when ignored or out of
 * range). */
__device__ __forceinline__ double row_weight(const CeArgs &a, long long y) {
  if (y == a.ignore || y < 0 || y >= a.sh.vocab) return 0.0;
  return a.cw ? (double)a.cw[y * a.cws] : 1.0;
}

/* The upstream gradient of a row's loss: dl (grad_output or dloss)
 * through the reduction (den: MEAN's denominator) and its token weight. */
__device__ __forceinline__ float ce_upstream(const CeArgs &a, float dl, double den, float tw) {
  float G = dl;
  if (a.reduction == LMLOSS_REDUCE_MEAN)
    G = den != 0.0 ? (float)(G / den) : 0.0f;
  else if (a.reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS)
    G = (float)(G / a.num_items);
  return G * tw;
}

/* Row i's loss li: the output itself (NONE), or its loss and weight wt
 * (the MEAN denominator's share) for ce_finalize. */
__device__ __forceinline__ void put_loss(const CeArgs &a, int64_t i, double li, double wt) {
  if (a.reduction == LMLOSS_REDUCE_NONE) {
    a.loss[i * a.ls] = (float)li;
  } else {
    a.ws_loss[i] = li;
    a.ws_wt[i] = wt;
  }
}

__global__ void ce_denominator(CeArgs a, double *out) {
  __shared__ double sh[33];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < a.N; i += blockDim.x)
    s += row_weight(a, ld_index(a.tgt, a.tgt64, i * a.ts));
  s = block_sum(s, sh);
  if (threadIdx.x == 0) *out = s;
}

__global__ void ce_finalize(CeArgs a, float *loss) {
  __shared__ double sh[33];
  double l = 0.0, w = 0.0;
  for (int64_t i = threadIdx.x; i < a.N; i += blockDim.x) {
    l += a.ws_loss[i];
    w += a.ws_wt[i];
  }
  l = block_sum(l, sh);
  w = block_sum(w, sh);
  if (threadIdx.x == 0) {
    double r = l;
    if (a.reduction == LMLOSS_REDUCE_MEAN) r = w != 0.0 ? l / w : 0.0;
    if (a.reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS) r = l / a.num_items;
    *loss = (float)r;
  }
}

/* The exact dz of a column the fast form cannot hold (the target's or the
 * argmax's), at its transformed logit w; inv = 1 / (1 + R). */
__device__ __forceinline__ float ce_entry_dz(const Xf &X, const lmloss_ce_coef &q,
                                             const lmloss_rowstat &s, lmloss_ce_upstream u, float w,
                                             float inv, float cj, bool is_y, bool is_a) {
  return lmloss_ce_entry_z(&q, &s, u, cexp(X, fmaxf(w - s.m, X.dmin)) * inv, cj, is_y, is_a);
}

/* A row's packed state (lmloss.h's row contract) from its stats phase. */
__device__ __forceinline__ void put_state(float *out, const lmloss_rowstat &s, float wy,
                                          int flags) {
  lmloss_rowstate x;
  x.s = s, x.wy = wy, x.flags = flags;
  lmloss_rowstate_pack(&x, out);
}

/* Shaped as make_plan (staged.cuh) says. With a gradient: one row per
 * cluster; the gradient needs the row statistics before its first write,
 * so each CTA stages its chunk and writes the gradient from shared memory
 * after the cluster has merged the row state. Forward only: the same
 * kernel, one CTA per row streaming it once (see first_pass). GRPO: the
 * GRPO pass's rows that the held plan does not take (GrpoPass). */
template <typename In, bool ENTROPY, int THREADS = 128, bool GRPO = false>
__global__ void ROW_BOUNDS(THREADS) ce_rows(CeArgs a) {
  constexpr int NV = elt<In>::NV;
  extern __shared__ uint4 stage[];
  __shared__ RedSmem red;
  __shared__ GrpoRow grpo;
  RowWalk rw(a.cs, &red);
  const Xf &X = a.X;
  const float k = X.f.k;
  const bool smoothing = a.eps > 0.0f;
  const Chunk ch = my_chunk<NV>(a.V, a.chunk, rw.rank);
  Stage st(stage, red.halves, ch, a.staged);

  /* Every per-row global load is issued a pass ahead of its use: the
   * next row's target and its logit (the GRPO pass: also its mask) are
   * prefetched into L1 during this row, the upstream gradient and
   * weights are loaded before pass 1.
   * Loaded where they were used, each stalled every warp of the CTA every
   * row; a prefetch, not a load carried to the
   * next row, since the compiler moves a uniform load's value into a
   * uniform register right after the load, which waits for it. */
  for (int64_t i = rw.first; i < a.N; i += rw.step) {
    const In *row = (const In *)a.x + i * a.xs;
    const long long y = ld_index(a.tgt, a.tgt64, i * a.ts);
    const int64_t in = i + rw.step;
    if (in < a.N) {
      prefetch_index(a.tgt, a.tgt64, in * a.ts);
      if constexpr (GRPO) prefetch_l1(a.grpo.row + in);
    }
    const bool grad = a.mode == CE_FUSED || a.mode == CE_BWD;
    if (y == a.ignore || (GRPO && a.grpo.row[i].x == 0.0f)) {
      if (rw.rank == 0 && threadIdx.x == 0) {
        if (a.mode == CE_FWD || a.mode == CE_FUSED) {
          put_loss(a, i, 0.0, 0.0);
          if (a.lse) a.lse[i * a.lses] = 0.0f;
          if (a.ent) a.ent[i * a.ents] = 0.0f;
          if (a.amax) a.amax[i * a.ams] = -1;
        }
        if (a.mode == CE_STATE) {
          const lmloss_rowstate e = lmloss_rowstate_empty();
          lmloss_rowstate_pack(&e, a.sh.state_out + i * a.sh.sts);
        }
      }
      if (grad && a.zero_ignored)
        zero_chunk<NV>(DynChunkOut<NV>(a.dx, a.dxt, i * a.dxs, ch, a.V), ch);
      continue;
    }
    const bool in_al = is_aligned16(row);
    /* The target's logit, read before any CTA of the cluster writes (the
     * gradient may overwrite the logits in place): its NaN flag goes into
     * this CTA's part, which every peer waits for before it writes. A
     * shard holds it only in its columns (yl: the target's column there);
     * a finish has it from the merged state. */
    const bool y_ok = y >= 0 && y < a.sh.vocab;
    const long long yl = y - a.sh.col0;
    const bool y_here = yl >= 0 && yl < a.V;
    const bool finish = !GRPO && a.sh.state_in;
    const float xy = y_here && !finish ? tof(row[yl]) : 0.0f;
    if constexpr (GRPO) grpo_stage(a.grpo, i, &grpo);
    const float tw = a.tw ? a.tw[i * a.tws] : 1.0f;
    const float cy = y_ok ? (a.cw ? a.cw[y * a.cws] : 1.0f) : 0.0f;
    /* the upstream gradient's inputs, used after the merge */
    const float dl = !grad                               ? 0.0f
                     : a.mode == CE_FUSED                ? a.grad_output
                     : a.reduction == LMLOSS_REDUCE_NONE ? a.dloss[i * a.dls]
                                                         : a.dloss[0];
    const double den = grad && a.reduction == LMLOSS_REDUCE_MEAN ? *a.den : 1.0;

    /* Pass 1: statistics of this CTA's chunk (staged, or kept in L2 for
     * a second read when the row is too wide to stage), in the
     * vocabulary's columns; a finish takes them from the merged state. */
    const RowPart<In> part = {row, ch, a.V, in_al};
    lmloss_rowstat s;
    float wy;
    bool bad;                /* no finite statistics (a finish: or no label's w) */
    int flags = 0;           /* the stats phase's lmloss_rowstate flags */
    long long yn = a.ignore; /* the next row's target (a finish stages no next row) */
    if (!finish) {
      Acc acc;
      acc.init(X);
      const float *cw_here = a.cw ? a.cw + a.sh.col0 * a.cws : nullptr;
      const bool one_max = first_pass<ENTROPY>(a.staged, st, part, grad, X,
                                               Smooth{smoothing, cw_here, a.cws}, acc, &red);
      acc.bad |= xy != xy;
      wy = y_here ? lmloss_xform_w(&X.f, xy) : 0.0f;
      const Part P = reduce_row<false>(acc, k, ENTROPY, smoothing, &red, rw, one_max);
      yn = in < a.N ? ld_index(a.tgt, a.tgt64, in * a.ts) : a.ignore;
      const long long ynl = yn - a.sh.col0;
      if (ynl >= 0 && ynl < a.V) prefetch_l1((const In *)a.x + in * a.xs + ynl);
      s = P.s;
      s.u += P.ue;
      s.c += P.ce;
      if (s.a >= 0) s.a += a.sh.col0;
      bad = P.bad || !P.fin;
      flags = part_flags(P) | (y_here ? LMLOSS_STATE_LABEL : 0);
      if (!GRPO && a.mode == CE_STATE) {
        if (rw.rank == 0 && threadIdx.x == 0)
          put_state(a.sh.state_out + i * a.sh.sts, s, wy, flags);
        continue;
      }
    } else {
      const lmloss_rowstate x = lmloss_rowstate_unpack(a.sh.state_in + i * a.sh.sts, a.sh.vocab);
      s = x.s, wy = x.wy;
      bad = !lmloss_rowstate_ok_label(&x);
    }
    const bool ok = y_ok && !bad && lmloss_rowstat_finite(&s);

    /* Row scalars (identical in every CTA of the cluster). */
    const float inv = 1.0f / (1.0f + s.r);
    const float C = a.cw ? s.c : (float)a.sh.vocab;
    const lmloss_ce_terms c = lmloss_ce_terms_make(&s, k, wy, cy, C, a.eps, a.sh.vocab, a.dft);
    double li = GRPO ? -c.nll : lmloss_ce_row_loss(&c, tw, a.zl);
    if (!ok) li = NAN;

    if (rw.rank == 0 && threadIdx.x == 0 && a.mode != CE_BWD) {
      put_loss(a, i, li, y_ok ? (double)cy : 0.0);
      const bool fin = !bad && lmloss_rowstat_finite(&s);
      if (a.lse) a.lse[i * a.lses] = fin ? (float)c.lse : NAN;
      if (a.ent) a.ent[i * a.ents] = fin ? lmloss_rowstat_entropy(&s) : NAN;
      if (a.amax) a.amax[i * a.ams] = fin ? s.a : -1;
    }
    if (!grad) continue;

    float G;
    if constexpr (GRPO)
      G = grpo_upstream(a.grpo, -c.nll, &grpo);
    else
      G = ce_upstream(a, dl, den, tw);
    /* dz_j = e_j F1 - F0 c_j away from the target and the argmax; without
     * softcap dx = k dz, folded into the coefficients (kx). */
    const float kx = X.f.cap > 0.0f ? 1.0f : k;
    const lmloss_ce_upstream u = lmloss_ce_upstream_make(&c, a.zl, G);
    float Pz, Qz; /* z units */
    lmloss_ce_pass_coefs(&c.q, &s, u, &Pz, &Qz);
    float F1 = Pz * kx, F0 = Qz * kx;
    if (!ok) F1 = F0 = NAN;
    const float m = s.m;
    const long long am = s.a - a.sh.col0; /* the argmax's column in this shard, if it holds it */
    float *const kv = kept_vals<In>(a.keep, i);   /* entries: the target, then the argmax */
    if constexpr (std::is_same<In, float>::value) /* the only logits keep is asked with */
      if (rw.rank == 0 && threadIdx.x == 0) {
        if (a.keep.state) put_state(a.keep.state + i * LMLOSS_ROW_STATE_COLS, s, wy, flags);
        keep_col(a.keep, i, 0, yl, a.V);
        keep_col(a.keep, i, 1, am, a.V);
      }
    Ref ref;
    ref.set(X, m);
    const float F1s = F1 * ref.s();
    const DynChunkOut<NV> out(a.dx, a.dxt, i * a.dxs, ch, a.V);
    /* The vectors of this CTA's chunk that hold the target and the argmax
     * (-1: elsewhere): one 32-bit compare each per vector. */
    const int vy = yl >= ch.jb && yl < ch.je ? (int)((yl - ch.jb) / NV) : -1;
    const int va = am >= ch.jb && am < ch.je ? (int)((am - ch.jb) / NV) : -1;
    const auto kout = noting<NV>(
        out, [&](int v) { return kv && (v == vy || v == va); },
        [&](int64_t j, float g) {
          if (j == yl) kv[0] = g;
          if (j == am) kv[1] = g;
        },
        ch.jb, a.V);

    /* The CTA's next row, copied in by the gradient pass unless ignored. */
    const bool has = a.staged && in < a.N && yn != a.ignore;
    const NextRow<In> next(has, a.x, in, a.xs, part);

    /* The gradient pass, one loop per class-weight case (a runtime branch
     * in one loop let the compiler hoist the weights' 64-bit addressing
     * into every vector). The softcap stays a test per vector: a loop per
     * softcap case as well (second_pass) made the 128-thread kernel
     * spill. */
    auto grad_pass = [&](auto with_cw) {
      second_pass_loops(a.staged, st, part, next, [&](int v, const Raw<In> &rv) {
        write_grad(X, rv, kout, v, X.f.cap > 0.0f, [&](const float *w, float *g) {
          if constexpr (decltype(with_cw)::value) {
            const int64_t j0 = ch.jb + (int64_t)v * NV;
#pragma unroll
            for (int e = 0; e < NV; e++) {
              const float cj = j0 + e < a.V ? a.cw[(a.sh.col0 + j0 + e) * a.cws] : 1.0f;
              g[e] = fmaf(ex2(ref.p(X, w[e])), F1s, -F0 * cj);
            }
          } else {
#pragma unroll
            for (int e = 0; e < NV; e++) /* -inf logits: ex2(-inf) = 0 */
              g[e] = fmaf(ex2(ref.p(X, w[e])), F1s, -F0);
          }
          if (v == vy || v == va) {
            const int64_t j0 = ch.jb + (int64_t)v * NV;
#pragma unroll
            for (int e = 0; e < NV; e++) {
              long long j = j0 + e;
              if (j == yl || j == am) {
                float cj = a.cw ? a.cw[(a.sh.col0 + j) * a.cws] : 1.0f;
                g[e] = ok ? ce_entry_dz(X, c.q, s, u, w[e], inv, cj, j == yl, j == am) * kx : NAN;
              }
            }
          }
        });
      });
    };
    if (a.cw)
      grad_pass(std::true_type{});
    else
      grad_pass(std::false_type{});
  }
  rw.finish();
}

/* The held plan (held.cuh) takes a whole gradient row (not a shard's
 * finish) whose options add no per-element or per-row work beyond the
 * plain loss: no softcap, label
 * smoothing, class weights, DFT, entropy or argmax output, or kept
 * entries (z-loss, token weights, scale and temperature are per-row
 * coefficients). */
static bool ce_held_applies(const CeArgs &a, bool entropy) {
  return ce_writes_grad(a.mode) && !a.sh.state_in && a.eps == 0.0f && !a.cw && !a.dft &&
         a.X.f.cap == 0.0f && !entropy && !a.amax && !a.keep.state && !a.keep.vals;
}

/* The plain CE gradient row, held (see ce_held_applies). The row's
 * scalars are loaded after its vectors, in the source too: written
 * before them, ptxas moved the target into a uniform register ahead of
 * the row's loads (waiting for it there). So
 * an ignored row is read too, and left as it was (or zeroed). The
 * target's own logit comes from the registers of the thread that holds
 * it, which writes the loss. GRPO: the GRPO pass's rows, a kernel of
 * their own, so that the formula's registers do not make the plain rows
 * spill. */
template <typename In, typename O, bool CLUSTER, bool GRPO>
__global__ void HELD_BOUNDS(In, CLUSTER) ce_held(CeArgs a) {
  constexpr int NV = elt<In>::NV;
  __shared__ HeldSmem sm;
  constexpr int SLOTS = GRPO ? HELD_GRPO_SHARED_SLOTS : HELD_SHARED_SLOTS;
  __shared__ HeldSlots<SLOTS> slots;
  const int64_t i = blockIdx.x / a.cs;
  HeldRow<In, CLUSTER, SLOTS> h(&sm, &slots, a.cs, a.chunk, a.V);
  const In *xrow = (const In *)a.x + i * a.xs;
  /* the GRPO pass's row: its mask, before the row's loads (a masked row
   * is not read), and the target's logit that gather_targets read before
   * this kernel and before any gradient over the logits (loaded here from
   * the row, it waited for the target index's own load, a second memory
   * latency on each row's path to its stores) */
  float xy0 = 0.0f;
  if constexpr (GRPO) {
    const float2 q = a.grpo.row[i];
    if (q.x == 0.0f) { /* the whole cluster returns here */
      if (h.rank == 0 && threadIdx.x == 0) put_loss(a, i, 0.0, 0.0);
      zero_chunk<NV>(ChunkOut<O, NV>((O *)a.dx + i * a.dxs, h.ch, a.V), h.ch);
      return;
    }
    xy0 = q.y;
  }
  h.load<true>(xrow, a.V);
  const long long y = ld_index(a.tgt, a.tgt64, i * a.ts);
  const float tw = a.tw ? a.tw[i * a.tws] : 1.0f;
  const float dl = a.mode == CE_FUSED ? a.grad_output
                                      : a.dloss[a.reduction == LMLOSS_REDUCE_NONE ? i * a.dls : 0];
  const double den = a.reduction == LMLOSS_REDUCE_MEAN ? *a.den : 1.0;
  O *drow = (O *)a.dx + i * a.dxs;
  const bool lead = h.rank == 0 && threadIdx.x == 0, fwd = a.mode == CE_FUSED;
  if (y == a.ignore) { /* the whole cluster returns here */
    if (lead && fwd) {
      put_loss(a, i, 0.0, 0.0);
      if (a.lse) a.lse[i * a.lses] = 0.0f;
    }
    if (a.zero_ignored) zero_chunk<NV>(ChunkOut<O, NV>(drow, h.ch, a.V), h.ch);
    h.settle();
    return;
  }
  /* G formed while the row's loads fly, and log(1 + R) and the lse below
   * only where used: formed in every thread after the statistics, these
   * per-row scalars made CE's per-row code longer than the log-probs
   * backward's. */
  float G = GRPO ? 0.0f : ce_upstream(a, dl, den, tw); /* GRPO's: grpo_upstream's, below */
  const bool y_ok = y >= 0 && y < a.V;
  __shared__ GrpoRow grpo;
  if constexpr (GRPO) grpo_stage(a.grpo, i, &grpo);
  h.arrive();
  const Xf &X = a.X;
  const float k = X.f.k;
  const bool fin = h.stats(X);
  const bool ok = fin && y_ok;
  const float m = h.m, inv = 1.0f / (1.0f + h.rs);
  /* used by the lead, the target's thread, and every thread under a z-loss */
  const auto l1r = [&] { return log1pf(h.rs); };
  const auto lse = [&] { return (double)m * k + l1r(); };
  const auto ly_of = [&](float xy) { return (double)(m - xy) * k + l1r(); }; /* lse - z_y */
  if (GRPO && y_ok) G = grpo_upstream(a.grpo, -ly_of(xy0), &grpo);
  if (lead && fwd) {
    if (a.lse) a.lse[i * a.lses] = fin ? (float)lse() : NAN;
    if (!y_ok) put_loss(a, i, NAN, 0.0); /* no CTA holds the target */
  }
  const float Gz = a.zl != 0.0f ? G * 2.0f * a.zl * (float)lse() : 0.0f;
  /* The target's entry, by the thread that holds it (v = vy, element ey). */
  const int64_t jy = y - h.ch.jb;
  const int vy = y_ok && jy >= 0 && y < h.ch.je ? (int)(jy / NV) : -1, ey = (int)(jy % NV);
  float gy = 0.0f;
  if (vy >= 0 && h.holds(vy)) {
    const float xy = h.at(vy, ey);
    lmloss_rowstat s = lmloss_rowstat_empty();
    s.m = m, s.r = h.rs;
    const lmloss_ce_terms c = lmloss_ce_terms_make(&s, k, xy, 1.0f, (float)a.V, 0.0f, a.V, 0);
    gy = ok ? ce_entry_dz(X, c.q, s, lmloss_ce_upstream{G, Gz}, xy, inv, 1.0f, true, xy == m) * k
            : NAN;
    if (fwd) put_loss(a, i, !ok ? NAN : GRPO ? -c.nll : lmloss_ce_row_loss(&c, tw, a.zl), 1.0);
  }
  /* dx_j = k (G + Gz) p_j off the target: lmloss_ce_pass_coefs' P at the
   * plain options (A = 1, no smoothing), in every thread without its terms */
  h.store_exp(X, xrow, ChunkOut<O, NV>(drow, h.ch, a.V), ok ? (G + Gz) * inv * k : NAN, vy, ey, gy);
}

/* A finish's gradient over a shard of F32 logits into a 16-bit gradient
 * (the fused head's vocab tiles, a few thousand columns a row) on the
 * slice plan (slice_grid), as the log-probs' lp_bwd_saved: ce_rows'
 * one-pass plan (a CTA a row, two loads in flight a thread, issued after
 * the scalars) ran these tiles slower than the coefficient kernel they
 * replaced. The exact entries: thread 0 the target's, thread 1 the
 * argmax's, stored over the fast form. Never in place (backend.h: only
 * the log-probs' tiles are) and with no kept entries (a finish has none). */
template <typename O, bool CW> __global__ void __launch_bounds__(SLICE_BS, 6) ce_tile(CeArgs a) {
  constexpr int NV = 4;
  const Xf &X = a.X;
  const float k = X.f.k, kx = X.f.cap > 0.0f ? 1.0f : k; /* without softcap dx = k dz */
  const Chunk ch = my_chunk<NV>(a.V, a.chunk, blockIdx.x);
  for (int64_t i = blockIdx.y; i < a.N; i += gridDim.y) {
    const float *row = (const float *)a.x + i * a.xs;
    O *drow = (O *)a.dx + i * a.dxs;
    const long long y = ld_index(a.tgt, a.tgt64, i * a.ts);
    if (y == a.ignore) {
      if (a.zero_ignored) zero_chunk<NV>(ChunkOut<O, NV>(drow, ch, a.V), ch);
      continue;
    }
    const RowPart<float> part = {row, ch, a.V, is_aligned16(row)};
    SliceVecs<float> sv;
    sv.load(part);
    const lmloss_rowstate x = lmloss_rowstate_unpack(a.sh.state_in + i * a.sh.sts, a.sh.vocab);
    const lmloss_rowstat &s = x.s;
    const bool y_ok = y >= 0 && y < a.sh.vocab;
    const bool ok = y_ok && lmloss_rowstate_ok_label(&x) && lmloss_rowstat_finite(&s);
    const float tw = a.tw ? a.tw[i * a.tws] : 1.0f;
    const float cy = y_ok ? (a.cw ? a.cw[y * a.cws] : 1.0f) : 0.0f;
    const float dl = a.dloss[a.reduction == LMLOSS_REDUCE_NONE ? i * a.dls : 0];
    const double den = a.reduction == LMLOSS_REDUCE_MEAN ? *a.den : 1.0;
    const float C = a.cw ? s.c : (float)a.sh.vocab;
    const lmloss_ce_terms c = lmloss_ce_terms_make(&s, k, x.wy, cy, C, a.eps, a.sh.vocab, a.dft);
    const lmloss_ce_upstream u = lmloss_ce_upstream_make(&c, a.zl, ce_upstream(a, dl, den, tw));
    float Pz, Qz; /* z units */
    lmloss_ce_pass_coefs(&c.q, &s, u, &Pz, &Qz);
    const float F1 = ok ? Pz * kx : NAN, F0 = ok ? Qz * kx : NAN;
    Ref ref;
    ref.set(X, s.m);
    const float F1s = F1 * ref.s();
    const int q = threadIdx.x;
    const long long ce = q == 0 ? y : q == 1 ? (long long)s.a : -1, cx = ce - a.sh.col0;
    const bool mine = q < 2 && cx >= ch.jb && cx < ch.je;
    float gc = 0.0f;
    if (mine) {
      const float xc = row[cx], w = lmloss_xform_w(&X.f, xc);
      const float cj = CW ? a.cw[ce * a.cws] : 1.0f;
      const float gz = ce_entry_dz(X, c.q, s, u, w, 1.0f / (1.0f + s.r), cj, ce == y, ce == s.a);
      gc = ok ? gz * kx * (X.f.cap > 0.0f ? lmloss_xform_dzdx(&X.f, xc) : 1.0f) : NAN;
    }
    sv.write(X, ChunkOut<O, NV>(drow, ch, a.V), ch.nv, [&](int v, const float *w, float *g) {
#pragma unroll
      for (int e = 0; e < NV; e++) { /* -inf logits: ex2(-inf) = 0 */
        const int64_t j = ch.jb + (int64_t)v * NV + e;
        const float cj = CW && j < a.V ? a.cw[(a.sh.col0 + j) * a.cws] : 1.0f;
        g[e] = fmaf(ex2(ref.p(X, w[e])), F1s, -F0 * cj);
      }
    });
    __syncthreads(); /* the entries over the fast form (the target at the
                        argmax: one value twice) */
    if (mine) drow[cx] = fromf<O>(gc);
  }
}

template <typename O> static lmloss_status launch_ce_tile(CeArgs &a, cudaStream_t st) {
  const dim3 grid = slice_grid(a.V, a.N, 4, &a.chunk);
  if (a.cw)
    ce_tile<O, true><<<grid, SLICE_BS, 0, st>>>(a);
  else
    ce_tile<O, false><<<grid, SLICE_BS, 0, st>>>(a);
  return check_launch("cross_entropy finish (tile)");
}

/* The held plan for a gradient of dtype O; false where it does not take
 * the row (launch_held). */
template <typename In, typename O>
static bool launch_ce_held(const DevInfo &d, CeArgs &a, cudaStream_t st, lmloss_status *s) {
  const int64_t dxb = a.dxs * (int64_t)sizeof(O);
  if (!a.grpo.on)
    return launch_held(ce_held<In, O, false, false>, ce_held<In, O, true, false>, d, elt<In>::NV,
                       a.dx, dxb, st, a, "cross_entropy", s);
  if constexpr (std::is_same<In, O>::value) /* the GRPO pass: dlogits as the logits */
    return launch_held(ce_held<In, O, false, true>, ce_held<In, O, true, true>, d, elt<In>::NV,
                       a.dx, dxb, st, a, "cross_entropy", s);
  return false;
}

/* The staged kernels take every gradient dtype at run time, the held
 * ones those launch_held_for builds. */
template <typename In>
static lmloss_status launch_ce(const DevInfo &d, CeArgs &a, bool entropy, cudaStream_t st) {
  lmloss_status s;
  if constexpr (std::is_same<In, float>::value) /* a vocab tile's finish (ce_tile) */
    if (a.sh.state_in && a.mode == CE_BWD) {
      if (a.dxt == LMLOSS_BF16) return launch_ce_tile<bf16>(a, st);
      if (a.dxt == LMLOSS_F16) return launch_ce_tile<f16>(a, st);
    }
  if (ce_held_applies(a, entropy) && launch_held_for<In>(a.dxt, [&](auto o) {
        return launch_ce_held<In, typename decltype(o)::type>(d, a, st, &s);
      }))
    return s;
  /* The GRPO pass (no entropy output) has kernels of its own: its
   * upstream's code in every CE kernel made the plain ones slower. */
  using K = void (*)(CeArgs);
  const auto kernel = [&](auto in, auto threads) -> K {
    using I = typename decltype(in)::type;
    constexpr int T = decltype(threads)::value;
    return a.grpo.on ? ce_rows<I, false, T, true>
           : entropy ? ce_rows<I, true, T>
                     : ce_rows<I, false, T>;
  };
  const K k128 = kernel(type_tag<In>{}, std::integral_constant<int, 128>{});
  const K k256 = wide_row_kernel<In, K>(
      [&](auto in) { return kernel(in, std::integral_constant<int, 256>{}); });
  /* a shard's state and finish read the row once: one-pass plans */
  const bool two_pass = ce_writes_grad(a.mode) && !a.sh.state_in;
  return launch_rows(k128, k256, d, elt<In>::NV, two_pass, 0, st, a, "cross_entropy");
}

static lmloss_status run_ce(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                            const lmloss_ce_options *opt, const lmloss_ce_outputs *out,
                            const lmloss_tensor *dloss, const lmloss_tensor *dlogits, void *ws,
                            int mode, lmloss_row_keep *keep, const GrpoPass *grpo = nullptr,
                            const CeShard *shard = nullptr) {
  cudaStream_t st = stream_of(ctx);
  DevInfo d;
  lmloss_status s = dev_info(&d);
  if (s != LMLOSS_OK) return s;
  CeArgs a = {};
  a.x = in->logits.data;
  a.N = in->logits.rows;
  a.V = in->logits.cols;
  a.xs = in->logits.row_stride;
  a.tgt = in->target.data;
  a.tgt64 = in->target.dtype == LMLOSS_I64;
  a.ts = in->target.row_stride;
  a.tw = (const float *)in->token_weight.data;
  a.tws = in->token_weight.row_stride;
  a.cw = (const float *)in->class_weight.data;
  a.cws = in->class_weight.row_stride;
  a.ignore = opt->ignore_index;
  a.eps = opt->label_smoothing;
  a.zl = opt->z_loss;
  a.dft = opt->dft;
  a.mode = mode;
  a.reduction = opt->reduction;
  a.zero_ignored = opt->zero_ignored_rows;
  a.X = make_xf(opt->transform);
  a.grad_output = opt->grad_output;
  a.num_items = opt->num_items;
  if (grpo) a.grpo = *grpo;
  a.sh.vocab = a.V;
  if (shard) a.sh = *shard;
  double *hdr = (double *)ws; /* none for a shard's states */
  if (ws) {
    a.ws_loss = (double *)((char *)ws + LMLOSS_CE_WS_HEADER);
    a.ws_wt = a.ws_loss + a.N;
    a.den = hdr;
  }
  /* the entropy's sums: a state's when its shard carries them; a finish
   * has them in its merged state */
  bool entropy = mode == CE_STATE && a.sh.entropy;
  if (out) {
    a.loss = (float *)out->loss.data;
    a.ls = out->loss.row_stride;
    a.lse = (float *)out->lse.data;
    a.lses = out->lse.row_stride;
    a.ent = (float *)out->entropy.data;
    a.ents = out->entropy.row_stride;
    a.amax = (long long *)out->argmax.data;
    a.ams = out->argmax.row_stride;
    entropy = a.ent != NULL && !a.sh.state_in;
  }
  a.dxt = LMLOSS_F32;
  if (dlogits) {
    a.dx = dlogits->data;
    a.dxs = dlogits->row_stride;
    a.dxt = dlogits->dtype;
    if (keep) a.keep = *keep;
    if (keep && in->logits.dtype != LMLOSS_F32)
      return lmloss_fail(LMLOSS_ERR_UNSUPPORTED, "CUDA: kept gradient entries of F32 logits only");
  }
  if (dloss) {
    a.dloss = (const float *)dloss->data;
    a.dls = dloss->row_stride;
  }
  const bool reduced = (mode == CE_FWD || mode == CE_FUSED) && opt->reduction != LMLOSS_REDUCE_NONE;
  if (a.N == 0) {
    if (reduced) {
      /* empty sum: 0 */
      cudaError_t e = cudaMemsetAsync(out->loss.data, 0, sizeof(float), st);
      if (e != cudaSuccess)
        return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "CUDA memset: %s", cudaGetErrorString(e));
    }
    return LMLOSS_OK;
  }
  if (ce_writes_grad(mode) && opt->reduction == LMLOSS_REDUCE_MEAN) {
    ce_denominator<<<1, 1024, 0, st>>>(a, hdr);
    if ((s = check_launch("cross_entropy denominator")) != LMLOSS_OK) return s;
  }
  switch (in->logits.dtype) {
  case LMLOSS_BF16: s = launch_ce<bf16>(d, a, entropy, st); break;
  case LMLOSS_F16: s = launch_ce<f16>(d, a, entropy, st); break;
  default: s = launch_ce<float>(d, a, entropy, st); break;
  }
  if (s != LMLOSS_OK) return s;
  if (reduced) {
    ce_finalize<<<1, 1024, 0, st>>>(a, (float *)out->loss.data);
    return check_launch("cross_entropy finalize");
  }
  return LMLOSS_OK;
}

} // namespace lmc

extern "C" lmloss_status lmloss_cuda_cross_entropy(const lmloss_context *ctx,
                                                   const lmloss_ce_inputs *in,
                                                   const lmloss_ce_options *opt,
                                                   const lmloss_ce_outputs *out, void *ws,
                                                   size_t ws_bytes, lmloss_row_keep *keep) {
  (void)ws_bytes;
  const lmloss_tensor *dl = lmloss_present(&out->dlogits) ? &out->dlogits : NULL;
  return lmc::run_ce(ctx, in, opt, out, NULL, dl, ws, dl ? lmc::CE_FUSED : lmc::CE_FWD, keep);
}

extern "C" lmloss_status lmloss_cuda_grpo_scales(const lmloss_context *, const lmloss_grpo_inputs *,
                                                 const lmloss_grpo_options *,
                                                 double *); /* grpo.cu */

namespace lmc {
/* Row i's mask and target logit x[i, y_i] as floats (the logit 0 for a
 * target outside [0, V), whose row is NaN), for the GRPO pass's rows
 * (GrpoPass::row): row i is token i % T of sequence i / T. */
template <typename In>
__global__ void gather_targets(const In *x, int64_t xs, const void *tgt, int tgt64, int64_t ts,
                               lmloss_tensor mask, int64_t N, int64_t V, float2 *row) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= N) return;
  const long long y = ld_index(tgt, tgt64, i * ts);
  const float m = (float)lmloss_grpo_at(&mask, i / mask.cols, i % mask.cols);
  row[i] = make_float2(m, y >= 0 && y < V ? tof(x[i * xs + y]) : 0.0f);
}

static lmloss_status launch_gather(const lmloss_tensor *x, const lmloss_tensor *idx,
                                   const lmloss_tensor *mask, float2 *row, cudaStream_t st) {
  const int64_t N = x->rows;
  const auto go = [&](const auto *logits) {
    gather_targets<<<(unsigned)((N + 255) / 256), 256, 0, st>>>(
        logits, x->row_stride, idx->data, idx->dtype == LMLOSS_I64, idx->row_stride, *mask, N,
        x->cols, row);
  };
  switch (x->dtype) {
  case LMLOSS_BF16: go((const bf16 *)x->data); break;
  case LMLOSS_F16: go((const f16 *)x->data); break;
  default: go((const float *)x->data);
  }
  return check_launch("grpo target logits");
}
} // namespace lmc

/* The CE row op at reduction NONE whose rows' upstreams are GRPO's
 * (GrpoPass): its loss output is the log-probs, its gradient GRPO's. */
extern "C" lmloss_status
lmloss_cuda_grpo_logits(const lmloss_context *ctx, const lmloss_tensor *logits,
                        const lmloss_tensor *index, const lmloss_transform *tr,
                        const lmloss_grpo_inputs *in, const lmloss_grpo_options *opt,
                        const lmloss_tensor *dlogits, void *ws, size_t ws_bytes) {
  (void)ws_bytes;
  const int64_t B = in->logp.rows, T = in->logp.cols;
  lmc::GrpoPass g = {};
  g.on = 1, g.T = T, g.p = lmloss_grpo_par_make(opt, in), g.in = *in;
  double *scale = (double *)ws;
  float2 *row = (float2 *)((char *)ws + lmloss_grpo_pass_rows(B));
  g.scale = scale, g.row = row;
  lmloss_status s = lmloss_cuda_grpo_scales(ctx, in, opt, scale);
  if (s == LMLOSS_OK) s = lmc::launch_gather(logits, index, &in->mask, row, lmc::stream_of(ctx));
  if (s != LMLOSS_OK) return s;
  void *ce_ws = (char *)ws + lmloss_grpo_pass_ce_ws(B, B * T);
  lmloss_ce_options o = lmloss_ce_options_default();
  o.ignore_index = -1; /* never an index: they lie in [0, V) */
  o.transform = *tr;
  o.reduction = LMLOSS_REDUCE_NONE;
  const lmloss_ce_inputs ci = {*logits, *index, {}, {}};
  lmloss_ce_outputs co = {};
  co.loss.data = in->logp.data, co.loss.dtype = LMLOSS_F32, co.loss.device = in->logp.device;
  co.loss.rows = B * T, co.loss.cols = 1, co.loss.row_stride = 1;
  return lmc::run_ce(ctx, &ci, &o, &co, NULL, dlogits, ce_ws, lmc::CE_FUSED, NULL, &g);
}

extern "C" lmloss_status
lmloss_cuda_cross_entropy_backward(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                   const lmloss_ce_options *opt, const lmloss_tensor *dloss,
                                   const lmloss_tensor *dlogits, void *ws, size_t ws_bytes,
                                   lmloss_row_keep *keep) {
  (void)ws_bytes;
  return lmc::run_ce(ctx, in, opt, NULL, dloss, dlogits, ws, lmc::CE_BWD, keep);
}

/* The row contract's CE phases over a vocabulary shard (lmloss.h), on
 * the one-shot kernels' plans: the states by ce_rows's first pass, a
 * finish by its outputs and gradient pass from the merged states. */
extern "C" lmloss_status lmloss_cuda_ce_state(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                              const lmloss_ce_options *opt, const lmloss_shard *sh,
                                              const lmloss_tensor *state) {
  const lmc::CeShard s = {sh->col0, sh->vocab,  state->row_stride, (float *)state->data,
                          nullptr,  sh->entropy};
  return lmc::run_ce(ctx, in, opt, NULL, NULL, NULL, NULL, lmc::CE_STATE, NULL, NULL, &s);
}

extern "C" lmloss_status lmloss_cuda_ce_finish(
    const lmloss_context *ctx, const lmloss_ce_inputs *in, const lmloss_ce_options *opt,
    const lmloss_shard *sh, const lmloss_tensor *state, const lmloss_ce_outputs *out,
    const lmloss_tensor *dloss, const lmloss_tensor *dlogits, void *ws, size_t ws_bytes) {
  (void)ws_bytes;
  const lmc::CeShard s = {
      sh->col0, sh->vocab, state->row_stride, nullptr, (const float *)state->data, 0};
  const int mode = dloss ? lmc::CE_BWD : dlogits ? lmc::CE_FUSED : lmc::CE_FWD;
  return lmc::run_ce(ctx, in, opt, out, dloss, dlogits, ws, mode, NULL, NULL, &s);
}
