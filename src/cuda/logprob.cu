/*
 * logprob.cu - log-probs (selective log-softmax), entropy, and their
 * backward on CUDA.
 *
 * Forward: logp[i, k] = (w_idx - m) k - log1p(R) (exact -log1p(R) at the
 * max), entropy = t / (1 + R) + log1p(R). An index outside [0, V) (not
 * checked on the host for device memory) gives NaN for that entry.
 * Backward, in z units, with D = sum_k dlogp_k, inv = 1 / (1 + R):
 *   dz_j = sum_{k: idx_k = j} dlogp_k - D p_j - dH p_j ((w_j - m) k + t inv)
 * (log p_j + H = (w_j - m) k + t / (1 + R): the log1p(R) cancels
 * analytically), and at the argmax the dlogp part uses 1 - p_a = R inv.
 * An out-of-range index makes its whole gradient row NaN.
 */
#include <type_traits>

#include "common.cuh"

namespace lmc {

struct LpArgs {
  const void *x;
  int64_t N, V, xs;
  const void *idx;
  int idx64;
  int64_t is, K;
  const unsigned char *mask;
  int64_t ms;
  Xf X;
  void *logp;
  int64_t lps;
  float *ent;
  int64_t ents;
  const float *dlogp;
  int64_t dlps;
  const float *dent;
  int64_t dents;
  void *dx;
  int64_t dxs;
  lmloss_grad_keep keep; /* optional arrays, backward */
  int cs;
  int64_t chunk;
  int staged;
};

/* One pass over the row, launched as make_plan (common.cuh) plans a
 * one-pass row: one CTA streaming it through registers (see first_pass).
 * The chunk, cluster and stage parameters are the shared row machinery's
 * (rank 0 gathers the K log-probs after the merge). Four CTAs per SM (64
 * registers, no spills): more loads in flight; measured on the H200, bf16
 * 8192 x 152064, 0.655 ms at three CTAs, 0.611 ms at four. */
template <typename In, typename O, bool T>
__global__ void __launch_bounds__(256, 4) lp_fwd(LpArgs a) {
  constexpr int NV = elt<In>::NV;
  extern __shared__ uint4 stage[];
  __shared__ RedSmem red;
  RowWalk rw(a.cs, &red);
  const Xf &X = a.X;
  const float k = X.f.k;
  const Chunk ch = my_chunk<NV>(a.V, a.chunk, rw.rank);
  Stage st(stage, red.halves, ch, false);
  for (int64_t i = rw.first; i < a.N; i += rw.step) {
    O *lrow = (O *)a.logp + i * a.lps;
    if (a.mask && !a.mask[i * a.ms]) {
      if (rw.rank == 0) {
        for (int64_t q = threadIdx.x; q < a.K; q += blockDim.x)
          lrow[q] = fromf<O>(0.0f);
        if (a.ent && threadIdx.x == 0) a.ent[i * a.ents] = 0.0f;
      }
      continue;
    }
    const In *row = (const In *)a.x + i * a.xs;
    const bool al = is_aligned16(row);
    Acc acc;
    acc.init(X);
    /* never staged (a one-pass plan): a literal false keeps the staged
     * loops out of this kernel and its 64 registers */
    const bool one_max =
        first_pass<T>(false, st, RowPart<In>{row, ch, a.V, al}, false, X, Smooth{}, acc, &red);

    Part P = reduce_row(acc, k, T, false, &red, rw, one_max);
    if (rw.rank != 0) continue;
    const lmloss_rowstat &s = P.s;
    const bool ok = !P.bad && lmloss_rowstat_finite(&s);
    const float l1r = log1pf(s.r);
    for (int64_t q = threadIdx.x; q < a.K; q += blockDim.x) {
      long long j = ld_index(a.idx, a.idx64, i * a.is + q);
      float lp = NAN;
      if (ok && j >= 0 && j < a.V) {
        float wj = lmloss_xform_w(&X.f, tof(row[j]));
        lp = (float)((double)(wj - s.m) * k - l1r);
      }
      lrow[q] = fromf<O>(lp);
    }
    if (a.ent && threadIdx.x == 0) a.ent[i * a.ents] = ok ? lmloss_rowstat_entropy(&s) : NAN;
  }
  rw.finish();
}

/* Same shape as the cross-entropy gradient (see ce_rows). Positions that
 * need the exact formula (the argmax, the K indices) are flagged in a
 * per-vector bitmap in shared memory, so the hot loop pays one shared load
 * per 16 bytes whatever K is. */
template <typename In, typename O, bool T, int BS> __global__ void ROW_BOUNDS(BS) lp_bwd(LpArgs a) {
  constexpr int NV = elt<In>::NV;
  extern __shared__ uint4 stage[];
  __shared__ RedSmem red;
  RowWalk rw(a.cs, &red);
  const Xf &X = a.X;
  const float k = X.f.k;
  const Chunk ch = my_chunk<NV>(a.V, a.chunk, rw.rank);
  const int64_t nvmax = a.chunk / NV;
  unsigned *bm = (unsigned *)(stage + (a.staged ? nvmax : 0));
  const int64_t nwords = (nvmax + 31) / 32;
  Stage st(stage, red.halves, ch, a.staged);

  /* The next row's mask, indices and upstream gradients are prefetched
   * into L1 a row ahead, and loaded before pass 1 (see ce_rows). */
  for (int64_t i = rw.first; i < a.N; i += rw.step) {
    const In *row = (const In *)a.x + i * a.xs;
    O *drow = (O *)a.dx + i * a.dxs;
    const int64_t in = i + rw.step;
    if (in < a.N) {
      if (a.mask) prefetch_l1(a.mask + in * a.ms);
      if (a.dlogp && a.K > 0) {
        prefetch_index(a.idx, a.idx64, in * a.is);
        prefetch_l1(a.dlogp + in * a.dlps);
      }
      if (a.dent) prefetch_l1(a.dent + in * a.dents);
    }
    if (a.mask && !a.mask[i * a.ms]) {
      zero_chunk<In, O>(drow, ch, a.V);
      continue;
    }
    /* Row scalars' inputs; every thread sums dlogp in the same order. */
    bool idx_ok = true;
    float D = 0.0f;
    if (a.dlogp) {
      for (int64_t q = 0; q < a.K; q++) {
        long long j = ld_index(a.idx, a.idx64, i * a.is + q);
        if (j < 0 || j >= a.V) idx_ok = false;
        D += a.dlogp[i * a.dlps + q];
      }
    }
    const float dH = a.dent ? a.dent[i * a.dents] : 0.0f;

    const bool in_al = is_aligned16(row);
    const RowPart<In> part = {row, ch, a.V, in_al};
    Acc acc;
    acc.init(X);
    const bool one_max = first_pass<T>(a.staged, st, part, true, X, Smooth{}, acc, &red);
    /* Its barriers also order the previous row's bitmap reads before the clear. */
    Part P = reduce_row(acc, k, T, false, &red, rw, one_max);
    for (int64_t q = threadIdx.x; q < nwords; q += blockDim.x)
      bm[q] = 0u;
    const lmloss_rowstat s = P.s;
    const bool ok = idx_ok && !P.bad && lmloss_rowstat_finite(&s);
    const float inv = 1.0f / (1.0f + s.r);
    const float tinv = T ? s.t * inv : 0.0f;
    /* without softcap dx = k dz, folded into the coefficients (kx) */
    const float kx = X.f.cap > 0.0f ? 1.0f : k;
    const float Pz = -inv * (D + dH * tinv), P2z = -inv * dH; /* z units */
    float c0 = Pz * kx, c1 = P2z * k * kx;
    if (!ok) c0 = c1 = NAN;
    const float m = s.m;
    const long long am = s.a;
    float *const kv = kept_vals<In>(a.keep, i);   /* entries: the K indices, then the argmax */
    if constexpr (std::is_same<In, float>::value) /* the only logits keep is asked with */
      if (rw.rank == 0 && threadIdx.x == 0) {
        if (a.keep.coef)
          a.keep.coef[i] = ok ? lmloss_grad_coef_make(&s, Pz, P2z, 0.0f) : lmloss_grad_coef_nan();
        for (int64_t q = 0; q < a.K; q++)
          keep_col(a.keep, i, (int)q, ld_index(a.idx, a.idx64, i * a.is + q), a.V);
        keep_col(a.keep, i, (int)a.K, am, a.V);
      }
    /* g = e_j (c1 d_j + c0) with d_j = w_j - m = (p'_j - ml) / kh (Ref) */
    Ref ref;
    ref.set(X, m);
    const float C1 = c1 * ref.s() / X.kh, C0 = (c0 - c1 * ref.ml / X.kh) * ref.s();

    /* Flag the vectors holding the argmax or an index. */
    __syncthreads();
    if (threadIdx.x == 0 && am >= ch.jb && am < ch.je) {
      int64_t v = (am - ch.jb) / NV;
      atomicOr(&bm[v >> 5], 1u << (v & 31));
    }
    if (a.dlogp) {
      for (int64_t q = threadIdx.x; q < a.K; q += blockDim.x) {
        long long j = ld_index(a.idx, a.idx64, i * a.is + q);
        if (j >= ch.jb && j < ch.je) {
          int64_t v = (j - ch.jb) / NV;
          atomicOr(&bm[v >> 5], 1u << (v & 31));
        }
      }
    }
    __syncthreads();

    const ChunkOut<O, NV> out(drow, ch, a.V);
    const auto kout = noting<NV>(
        out, [&](int v) { return kv && ((bm[v >> 5] >> (v & 31)) & 1u); },
        [&](int64_t j, float g) {
          for (int64_t q = 0; q < a.K; q++)
            if (ld_index(a.idx, a.idx64, i * a.is + q) == j) kv[q] = g;
          if (j == am) kv[a.K] = g;
        },
        ch.jb, a.V);
    auto body = [&](int v, const Raw<In> &rv, auto cap) {
      write_grad(X, rv, kout, v, cap, [&](const float *w, float *g) {
#pragma unroll
        for (int e = 0; e < NV; e++) {
          if constexpr (T) { /* the clamp keeps C1 p finite at -inf logits */
            const float p = fmaxf(ref.p(X, w[e]), X.pmin);
            g[e] = ex2(p) * fmaf(C1, p, C0);
          } else { /* C1 = 0; a -inf logit gives ex2(-inf) = 0 */
            g[e] = ex2(ref.p(X, w[e])) * C0;
          }
        }
        if ((bm[v >> 5] >> (v & 31)) & 1u) {
          const int64_t j0 = ch.jb + (int64_t)v * NV;
#pragma unroll
          for (int e = 0; e < NV; e++) {
            const long long j = j0 + e;
            float Dj = 0.0f;
            bool hit = j == am;
            if (a.dlogp) {
              for (int64_t q = 0; q < a.K; q++) {
                if (ld_index(a.idx, a.idx64, i * a.is + q) == j) {
                  Dj += a.dlogp[i * a.dlps + q];
                  hit = true;
                }
              }
            }
            if (!hit) continue;
            const float d = fmaxf(w[e] - m, X.dmin), pj = cexp(X, d) * inv;
            float dl = j == am ? Dj * (s.r * inv) - (D - Dj) * pj : Dj - D * pj;
            float gz = dl - dH * pj * fmaf(d, k, tinv);
            g[e] = ok ? gz * kx : NAN;
          }
        }
      });
    };

    /* the next row, copied in unless masked */
    const bool has = a.staged && in < a.N && (!a.mask || a.mask[in * a.ms]);
    const NextRow<In> next(has, a.x, in, a.xs, part);
    second_pass(a.staged, st, part, next, X.f.cap > 0.0f, body);
  }
  rw.finish();
}

template <typename In, typename O>
static lmloss_status launch_fwd(const DevInfo &d, LpArgs &a, bool T, cudaStream_t st) {
  auto k = T ? lp_fwd<In, O, true> : lp_fwd<In, O, false>;
  return launch_rows(k, k, d, elt<In>::NV, 0, 0, st, a, "log_probs");
}

template <typename In, typename O>
static lmloss_status launch_bwd(const DevInfo &d, LpArgs &a, bool T, cudaStream_t st) {
  if (T)
    return launch_rows(lp_bwd<In, O, true, 128>, lp_bwd<In, O, true, 256>, d, elt<In>::NV, 1, 1, st,
                       a, "log_probs_backward");
  return launch_rows(lp_bwd<In, O, false, 128>, lp_bwd<In, O, false, 256>, d, elt<In>::NV, 1, 1, st,
                     a, "log_probs_backward");
}

template <typename In>
static lmloss_status dispatch_out(const DevInfo &d, LpArgs &a, bool T, lmloss_dtype od, int bwd,
                                  cudaStream_t st) {
  switch (od) {
  case LMLOSS_BF16:
    return bwd ? launch_bwd<In, bf16>(d, a, T, st) : launch_fwd<In, bf16>(d, a, T, st);
  case LMLOSS_F16: return bwd ? launch_bwd<In, f16>(d, a, T, st) : launch_fwd<In, f16>(d, a, T, st);
  default: return bwd ? launch_bwd<In, float>(d, a, T, st) : launch_fwd<In, float>(d, a, T, st);
  }
}

static LpArgs common_args(const lmloss_tensor *logits, const lmloss_tensor *index,
                          const lmloss_tensor *mask, const lmloss_transform *tr) {
  LpArgs a = {};
  a.x = logits->data;
  a.N = logits->rows;
  a.V = logits->cols;
  a.xs = logits->row_stride;
  if (lmloss_present(index)) {
    a.idx = index->data;
    a.idx64 = index->dtype == LMLOSS_I64;
    a.is = index->row_stride;
    a.K = index->cols;
  }
  if (lmloss_present(mask)) {
    a.mask = (const unsigned char *)mask->data;
    a.ms = mask->row_stride;
  }
  a.X = make_xf(*tr);
  return a;
}

static lmloss_status run(LpArgs &a, lmloss_dtype in, lmloss_dtype od, bool T, int bwd,
                         const lmloss_context *ctx) {
  DevInfo d;
  lmloss_status s = dev_info(&d);
  if (s != LMLOSS_OK) return s;
  cudaStream_t st = stream_of(ctx);
  switch (in) {
  case LMLOSS_BF16: return dispatch_out<bf16>(d, a, T, od, bwd, st);
  case LMLOSS_F16: return dispatch_out<f16>(d, a, T, od, bwd, st);
  default: return dispatch_out<float>(d, a, T, od, bwd, st);
  }
}

} // namespace lmc

extern "C" lmloss_status
lmloss_cuda_log_probs(const lmloss_context *ctx, const lmloss_tensor *logits,
                      const lmloss_tensor *index, const lmloss_tensor *mask,
                      const lmloss_transform *tr, const lmloss_tensor *logp,
                      const lmloss_tensor *entropy) {
  lmc::LpArgs a = lmc::common_args(logits, index, mask, tr);
  lmloss_dtype od = LMLOSS_F32;
  if (lmloss_present(logp)) {
    a.logp = logp->data;
    a.lps = logp->row_stride;
    od = logp->dtype;
  } else {
    a.K = 0;
  }
  if (lmloss_present(entropy)) {
    a.ent = (float *)entropy->data;
    a.ents = entropy->row_stride;
  }
  return lmc::run(a, logits->dtype, od, a.ent != NULL, 0, ctx);
}

extern "C" lmloss_status lmloss_cuda_log_probs_backward(
    const lmloss_context *ctx, const lmloss_tensor *logits, const lmloss_tensor *index,
    const lmloss_tensor *mask, const lmloss_transform *tr, const lmloss_tensor *dlogp,
    const lmloss_tensor *dentropy, const lmloss_tensor *dlogits, lmloss_grad_keep *keep) {
  lmc::LpArgs a = lmc::common_args(logits, index, mask, tr);
  if (keep) a.keep = *keep;
  if (keep && logits->dtype != LMLOSS_F32)
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED, "CUDA: kept gradient entries of F32 logits only");
  if (lmloss_present(dlogp)) {
    a.dlogp = (const float *)dlogp->data;
    a.dlps = dlogp->row_stride;
  } else {
    a.K = 0;
  }
  if (lmloss_present(dentropy)) {
    a.dent = (const float *)dentropy->data;
    a.dents = dentropy->row_stride;
  }
  a.dx = dlogits->data;
  a.dxs = dlogits->row_stride;
  return lmc::run(a, logits->dtype, dlogits->dtype, a.dent != NULL, 1, ctx);
}
