/*
 * fused_linear.cu - the CUDA building blocks of the fused linear head
 * (src/core/fused_linear.c runs the chunk loop): cuBLAS GEMMs (fp32
 * accumulation; fp32 operands use the pedantic mode, so never TF32), row
 * gathers and scatters, and small reductions, all on the caller's stream.
 * select_rows reads the number of supervised rows back to the host: the
 * one synchronization of a fused-head call (it sizes the GEMMs). The
 * cuBLAS handles are created once per device and thread-safely reused.
 */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <mutex>

#include "common.cuh"

namespace lmc {

static cudaDataType cuda_type(lmloss_dtype d) {
  return d == LMLOSS_F32 ? CUDA_R_32F : d == LMLOSS_BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

/* The cuBLAS and cuBLASLt handles of the current device. */
static lmloss_status handles_for(const lmloss_context *ctx, cublasHandle_t *out,
                                 cublasLtHandle_t *lt_out) {
  static std::mutex lock;
  static cublasHandle_t handles[64];
  static cublasLtHandle_t lts[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= 64)
    return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "CUDA: no current device");
  std::lock_guard<std::mutex> g(lock);
  if (!handles[dev] && cublasCreate(&handles[dev]) != CUBLAS_STATUS_SUCCESS)
    return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "cuBLAS: cannot create a handle");
  if (!lts[dev] && cublasLtCreate(&lts[dev]) != CUBLAS_STATUS_SUCCESS)
    return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "cuBLASLt: cannot create a handle");
  if (cublasSetStream(handles[dev], stream_of(ctx)) != CUBLAS_STATUS_SUCCESS)
    return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "cuBLAS: cannot set the stream");
  *out = handles[dev];
  if (lt_out) *lt_out = lts[dev];
  return LMLOSS_OK;
}

static cublasComputeType_t compute_type(lmloss_dtype d) {
  return d == LMLOSS_F32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
}

/* Row-major c = alpha op(a) op(b) + beta c is column-major
 * c^T = alpha op(b)^T op(a)^T + beta c^T: swap the operands. */
static lmloss_status gemm(const lmloss_context *ctx, int t_a, int t_b, float alpha,
                          const lmloss_tensor *a, const lmloss_tensor *b, float beta,
                          const lmloss_tensor *c) {
  cublasHandle_t h = nullptr;
  lmloss_status s = handles_for(ctx, &h, nullptr);
  if (s != LMLOSS_OK) return s;
  const int64_t m = c->rows, n = c->cols, k = t_a ? a->rows : a->cols;
  if (m == 0 || n == 0) return LMLOSS_OK;
  const cublasComputeType_t ct = compute_type(a->dtype);
  cublasStatus_t st =
      cublasGemmEx(h, t_b ? CUBLAS_OP_T : CUBLAS_OP_N, t_a ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n,
                   (int)m, (int)k, &alpha, b->data, cuda_type(b->dtype), (int)b->row_stride,
                   a->data, cuda_type(a->dtype), (int)a->row_stride, &beta, c->data,
                   cuda_type(c->dtype), (int)c->row_stride, ct, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS)
    return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "cuBLAS GEMM failed (status %d)", (int)st);
  return LMLOSS_OK;
}

/* One block scans the labels in order: flags, a block-wide prefix sum per
 * tile, the list, and (in a fixed order) the class-weight sum. */
__global__ void select_kernel(const void *labels, lmloss_dtype dt, int64_t stride, int64_t n,
                              int64_t ignore, const float *cw, int64_t cw_stride, int64_t *list,
                              double *result) {
  __shared__ int64_t base;
  __shared__ int scan[1024];
  __shared__ double wsum[1024];
  const int t = threadIdx.x;
  if (t == 0) base = 0;
  double w = 0.0;
  for (int64_t i0 = 0; i0 < n; i0 += blockDim.x) {
    const int64_t i = i0 + t;
    int keep = 0;
    int64_t y = 0;
    if (i < n) {
      if (dt == LMLOSS_BOOL)
        keep = labels ? ((const unsigned char *)labels)[i * stride] != 0 : 1;
      else {
        y = dt == LMLOSS_I64 ? ((const int64_t *)labels)[i * stride]
                             : (int64_t)((const int32_t *)labels)[i * stride];
        keep = y != ignore;
      }
    }
    if (keep) w += (dt != LMLOSS_BOOL && cw) ? (double)cw[y * cw_stride] : 1.0;
    scan[t] = keep;
    __syncthreads();
    for (int off = 1; off < (int)blockDim.x; off <<= 1) { /* inclusive Hillis-Steele */
      int v = t >= off ? scan[t - off] : 0;
      __syncthreads();
      scan[t] += v;
      __syncthreads();
    }
    if (keep) list[base + scan[t] - 1] = i;
    __syncthreads();
    if (t == blockDim.x - 1) base += scan[t];
    __syncthreads();
  }
  wsum[t] = w;
  __syncthreads();
  for (int off = blockDim.x / 2; off > 0; off >>= 1) {
    if (t < off) wsum[t] += wsum[t + off];
    __syncthreads();
  }
  if (t == 0) result[0] = (double)base, result[1] = wsum[0];
}

static lmloss_status select_rows(const lmloss_context *ctx, const lmloss_tensor *labels,
                                 int64_t ignore, const lmloss_tensor *cw, int64_t *list,
                                 int64_t *count, double *weight_sum) {
  cudaStream_t st = stream_of(ctx);
  /* two doubles of device scratch: just past the list's N entries */
  double *res = (double *)(list + labels->rows);
  const float *w = (cw && cw->data) ? (const float *)cw->data : nullptr;
  select_kernel<<<1, 1024, 0, st>>>(labels->data, labels->dtype, labels->row_stride, labels->rows,
                                    ignore, w, cw ? cw->row_stride : 0, list, res);
  lmloss_status s = check_launch("select_rows");
  if (s != LMLOSS_OK) return s;
  double host[2];
  cudaError_t e = cudaMemcpyAsync(host, res, sizeof host, cudaMemcpyDeviceToHost, st);
  if (e == cudaSuccess) e = cudaStreamSynchronize(st);
  if (e != cudaSuccess)
    return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "CUDA select_rows: %s", cudaGetErrorString(e));
  *count = (int64_t)host[0];
  *weight_sum = host[1];
  return LMLOSS_OK;
}

/* Copies of whole rows: a block per row, 4-byte words when they fit. */
template <typename W>
__global__ void copy_rows_kernel(const char *src, int64_t src_stride, char *dst, int64_t dst_stride,
                                 const int64_t *list, int gather, int64_t rows, int64_t words) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t s = gather ? list[r] : r, d = gather ? r : list[r];
    const W *in = (const W *)(src + s * src_stride);
    W *out = (W *)(dst + d * dst_stride);
    for (int64_t j = threadIdx.x; j < words; j += blockDim.x)
      out[j] = in[j];
  }
}

static lmloss_status copy_rows(const lmloss_context *ctx, const lmloss_tensor *src,
                               const int64_t *list, const lmloss_tensor *dst, int gather) {
  const int64_t rows = gather ? dst->rows : src->rows;
  if (rows == 0) return LMLOSS_OK;
  const size_t es = lmloss_dtype_size(src->dtype);
  const int64_t bytes = src->cols * (int64_t)es;
  const int64_t ss = src->row_stride * (int64_t)es, ds = dst->row_stride * (int64_t)es;
  const unsigned grid = (unsigned)(rows < 65535 ? rows : 65535);
  const int wide = bytes % 4 == 0 && ss % 4 == 0 && ds % 4 == 0 &&
                   ((uintptr_t)src->data | (uintptr_t)dst->data) % 4 == 0;
  if (wide)
    copy_rows_kernel<uint32_t><<<grid, 256, 0, stream_of(ctx)>>>(
        (const char *)src->data, ss, (char *)dst->data, ds, list, gather, rows, bytes / 4);
  else
    copy_rows_kernel<uint8_t><<<grid, 256, 0, stream_of(ctx)>>>(
        (const char *)src->data, ss, (char *)dst->data, ds, list, gather, rows, bytes);
  return check_launch(gather ? "gather_rows" : "scatter_rows");
}

static lmloss_status gather_rows(const lmloss_context *ctx, const lmloss_tensor *src,
                                 const int64_t *list, const lmloss_tensor *dst) {
  return copy_rows(ctx, src, list, dst, 1);
}

static lmloss_status scatter_rows(const lmloss_context *ctx, const lmloss_tensor *src,
                                  const int64_t *list, const lmloss_tensor *dst) {
  return copy_rows(ctx, src, list, dst, 0);
}

/* Element-wise kernels over a [rows, cols] view: fill, cast, broadcast,
 * scale by the F32 at src, scale each row by its F32 in src [rows, 1]. */
__global__ void elementwise_kernel(int mode, const void *src, lmloss_dtype sdt, int64_t sstride,
                                   void *dst, lmloss_dtype ddt, int64_t dstride, int64_t rows,
                                   int64_t cols, double v) {
  if (mode == 3 && *(const float *)src == 1.0f) return; /* scale by 1: nothing to do */
  const int64_t n = rows * cols;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = e / cols, j = e % cols;
    char *row = (char *)dst + (size_t)(i * dstride) * lmloss_dtype_size(ddt);
    if (ddt == LMLOSS_I64) {
      ((int64_t *)row)[j] = (int64_t)v;
      continue;
    }
    float x = (float)v;
    if (mode == 1) /* cast */
      x = lmloss_load((const char *)src + (size_t)(i * sstride) * lmloss_dtype_size(sdt), sdt, j);
    if (mode == 2) /* broadcast of a [cols, 1] vector */
      x = lmloss_load(src, sdt, j * sstride);
    if (mode == 3) /* scale */
      x = lmloss_load(row, ddt, j) * *(const float *)src;
    if (mode == 4) /* scale rows */
      x = lmloss_load(row, ddt, j) * ((const float *)src)[i * sstride];
    lmloss_store(row, ddt, j, x);
  }
}

static lmloss_status elementwise(const lmloss_context *ctx, int mode, const lmloss_tensor *src,
                                 const lmloss_tensor *dst, double v) {
  const int64_t n = dst->rows * dst->cols;
  if (n == 0) return LMLOSS_OK;
  const int64_t blocks = (n + 255) / 256;
  elementwise_kernel<<<(unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, stream_of(ctx)>>>(
      mode, src ? src->data : nullptr, src ? src->dtype : LMLOSS_F32, src ? src->row_stride : 0,
      dst->data, dst->dtype, dst->row_stride, dst->rows, dst->cols, v);
  return check_launch("elementwise");
}

static lmloss_status fill(const lmloss_context *ctx, const lmloss_tensor *t, double v) {
  return elementwise(ctx, 0, nullptr, t, v);
}

static lmloss_status broadcast_row(const lmloss_context *ctx, const lmloss_tensor *vec,
                                   const lmloss_tensor *c) {
  return elementwise(ctx, 2, vec, c, 0.0);
}

/* Whether entry s of a row of kept entries (cols: the row's) is the
 * first in its column: a label may repeat, or be the argmax. */
__device__ __forceinline__ bool first_in_row(const int64_t *cols, int64_t s) {
  for (int64_t q = 0; q < s; q++)
    if (cols[q] == cols[s]) return false;
  return true;
}

/* t *= s[0] over n contiguous elements, 16 bytes per thread and step
 * (torch's in-place multiply by a 0-dim device tensor broadcasts it with
 * a zero stride, which keeps it element by element, far below memory
 * bandwidth on a dW). A scale of 1, the upstream of a loss whose backward
 * starts there, returns at once: the pass over t is the whole cost. */
template <typename T> __global__ void scale_kernel(T *t, int64_t n, const float *s) {
  constexpr int NV = elt<T>::NV;
  const float a = *s;
  if (a == 1.0f) return;
  const int64_t nv = n / NV, step = (int64_t)gridDim.x * blockDim.x;
  const int64_t first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  for (int64_t v = first; v < nv; v += step) {
    Raw<T> r;
    r.u = ld16<STREAM>(t + v * NV);
    float x[NV];
    unpack<T, NV>(r, x);
#pragma unroll
    for (int e = 0; e < NV; e++)
      x[e] *= a;
    store_whole<T, NV>(t + v * NV, x);
  }
  for (int64_t j = nv * NV + first; j < n; j += step)
    t[j] = fromf<T>(tof(t[j]) * a);
}

static lmloss_status scale(const lmloss_context *ctx, const lmloss_tensor *t, const float *s) {
  const int64_t n = t->rows * t->cols;
  if (n == 0) return LMLOSS_OK;
  const bool flat = (t->rows == 1 || t->row_stride == t->cols) && (uintptr_t)t->data % 16 == 0;
  if (!flat) {
    lmloss_tensor by = {};
    by.data = (void *)s;
    return elementwise(ctx, 3, &by, t, 0.0);
  }
  /* a few CTAs an SM stride over t: enough for bandwidth, and few to
   * launch where a scale of 1 returns at once */
  const int64_t blocks = (n / 8 + 255) / 256 + 1;
  const unsigned grid = (unsigned)(blocks < 2048 ? blocks : 2048);
  cudaStream_t st = stream_of(ctx);
  switch (t->dtype) {
  case LMLOSS_BF16: scale_kernel<bf16><<<grid, 256, 0, st>>>((bf16 *)t->data, n, s); break;
  case LMLOSS_F16: scale_kernel<f16><<<grid, 256, 0, st>>>((f16 *)t->data, n, s); break;
  default: scale_kernel<float><<<grid, 256, 0, st>>>((float *)t->data, n, s); break;
  }
  return check_launch("scale");
}

static lmloss_status scale_rows(const lmloss_context *ctx, const lmloss_tensor *t,
                                const lmloss_tensor *s) {
  return elementwise(ctx, 4, s, t, 0.0);
}

/* c = h w^T + bias through cuBLASLt's bias epilogue: the bias is added as
 * the GEMM writes c, where a broadcast pass over c and a GEMM reading c
 * back (beta = 1) had cost two more passes over the slab. false where
 * cuBLASLt offers no algorithm for it (then the caller does it that way). */
static bool logits_lt(const lmloss_context *ctx, cublasLtHandle_t lt, const lmloss_tensor *h,
                      const lmloss_tensor *w, const lmloss_tensor *bias, const lmloss_tensor *c) {
  /* column-major: c^T [V, n] = w [H, V]^T h^T [H, n], bias along c^T's rows */
  const uint64_t V = (uint64_t)c->cols, n = (uint64_t)c->rows, H = (uint64_t)h->cols;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t lw = nullptr, lh = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  const cublasOperation_t tr = CUBLAS_OP_T, nt = CUBLAS_OP_N;
  const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
  const cudaDataType bt = CUDA_R_32F; /* the core passes an F32 bias (see backend.h) */
  const void *bp = bias->data;
  const size_t no_ws = 0;
  cublasLtMatmulHeuristicResult_t res = {};
  int found = 0;
  bool ok =
      cublasLtMatmulDescCreate(&op, compute_type(h->dtype), CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof tr) == 0 &&
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt) == 0 &&
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi) == 0 &&
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp) == 0 &&
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt) ==
          0 &&
      cublasLtMatrixLayoutCreate(&lw, cuda_type(w->dtype), H, V, w->row_stride) == 0 &&
      cublasLtMatrixLayoutCreate(&lh, cuda_type(h->dtype), H, n, h->row_stride) == 0 &&
      cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, V, n, c->row_stride) == 0 &&
      cublasLtMatmulPreferenceCreate(&pref) == 0 &&
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &no_ws,
                                           sizeof no_ws) == 0 &&
      cublasLtMatmulAlgoGetHeuristic(lt, op, lw, lh, lc, lc, pref, 1, &res, &found) == 0 &&
      found > 0;
  const float one = 1.0f, zero = 0.0f;
  if (ok)
    ok = cublasLtMatmul(lt, op, &one, w->data, lw, h->data, lh, &zero, c->data, lc, c->data, lc,
                        &res.algo, nullptr, 0, stream_of(ctx)) == CUBLAS_STATUS_SUCCESS;
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (lc) cublasLtMatrixLayoutDestroy(lc);
  if (lh) cublasLtMatrixLayoutDestroy(lh);
  if (lw) cublasLtMatrixLayoutDestroy(lw);
  if (op) cublasLtMatmulDescDestroy(op);
  return ok;
}

static lmloss_status logits(const lmloss_context *ctx, const lmloss_tensor *h,
                            const lmloss_tensor *w, const lmloss_tensor *bias,
                            const lmloss_tensor *c) {
  if (!lmloss_present(bias)) return gemm(ctx, 0, 1, 1.0f, h, w, 0.0f, c);
  cublasHandle_t hd = nullptr;
  cublasLtHandle_t lt = nullptr;
  lmloss_status s = handles_for(ctx, &hd, &lt);
  if (s != LMLOSS_OK) return s;
  if (c->rows == 0 || c->cols == 0) return LMLOSS_OK;
  if (bias->row_stride == 1 && logits_lt(ctx, lt, h, w, bias, c)) return LMLOSS_OK;
  s = broadcast_row(ctx, bias, c);
  return s != LMLOSS_OK ? s : gemm(ctx, 0, 1, 1.0f, h, w, 1.0f, c);
}

/* Column sums of gradient rows: a CTA per 32 NV columns (NV elements in
 * 16 bytes), so that a warp reads 512 contiguous bytes of a row; its
 * eight warps take every eighth row, four rows' loads in flight per lane.
 * The warps' sums meet in shared memory and are added in warp order.
 * Then, with kept entries, what rounding took from those in the CTA's
 * columns (the first of a column in a row) is added in row order: the
 * CTA reads the entries a batch per thread, and only a batch holding one
 * of its columns (few do) is walked by each column's thread. So the sum
 * is that of the rows with the exact entries in place, to fp32 rounding,
 * in the same order every run. (A thread per column walking every row's
 * entries was far slower.) */
template <typename T>
__global__ void __launch_bounds__(256)
    colsum_kernel(const T *a, int64_t astride, int64_t rows, int64_t cols, bool aligned,
                  lmloss_row_keep kp, float beta, void *out, lmloss_dtype odt, int64_t ostride) {
  constexpr int NV = 16 / sizeof(T), W = 8, C = 32 * NV, B = 256; /* C <= B threads */
  __shared__ float part[W][C], lost[B];
  __shared__ int hit[B]; /* per batch: the column (from j0) entry t restores, or -1 */
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t j0 = blockIdx.x * (int64_t)C, jl = j0 + lane * NV;
  float acc[NV] = {};
  auto add = [&](const Raw<T> &v) {
    float x[NV];
    unpack<T, NV>(v, x);
#pragma unroll
    for (int e = 0; e < NV; e++)
      acc[e] += x[e];
  };
  if (aligned && jl + NV <= cols) {
    int64_t r = warp;
    for (; r + 3 * W < rows; r += 4 * W) {
      Raw<T> v[4];
#pragma unroll
      for (int q = 0; q < 4; q++) /* all four loads in flight before any use */
        v[q].u = ld16<STREAM>(a + (r + q * W) * astride + jl);
#pragma unroll
      for (int q = 0; q < 4; q++)
        add(v[q]);
    }
    for (; r < rows; r += W) {
      Raw<T> v;
      v.u = ld16<STREAM>(a + r * astride + jl);
      add(v);
    }
  } else {
    for (int64_t r = warp; r < rows; r += W)
#pragma unroll
      for (int e = 0; e < NV; e++)
        if (jl + e < cols) acc[e] += tof(a[r * astride + jl + e]);
  }
#pragma unroll
  for (int e = 0; e < NV; e++)
    part[warp][lane * NV + e] = acc[e];
  __syncthreads();
  const int t = threadIdx.x;
  const int64_t j = j0 + t, ne = kp.cols ? rows * kp.count : 0;
  float sum = 0.0f;
  if (t < C) {
#pragma unroll
    for (int w = 0; w < W; w++)
      sum += part[w][t];
  }
  for (int64_t e0 = 0; e0 < ne; e0 += B) {
    int h = -1;
    if (e0 + t < ne) {
      const int64_t i = (e0 + t) / kp.count, s = (e0 + t) % kp.count;
      const int64_t *cr = kp.cols + i * kp.stride, c = cr[s];
      if (c >= j0 && c < j0 + C && c < cols && first_in_row(cr, s)) {
        h = (int)(c - j0);
        lost[t] = kp.vals[i * kp.stride + s] - tof(a[i * astride + c]);
      }
    }
    hit[t] = h;
    if (__syncthreads_or(h >= 0))
      for (int q = 0; q < B; q++)
        if (hit[q] == t) sum += lost[q];
    __syncthreads();
  }
  if (t < C && j < cols) {
    const int64_t o = j * ostride;
    const float prev = beta != 0.0f ? beta * lmloss_load(out, odt, o) : 0.0f;
    lmloss_store(out, odt, o, prev + sum);
  }
}

template <typename T>
static void launch_colsum(const lmloss_context *ctx, const lmloss_tensor *a,
                          const lmloss_row_keep &kp, float beta, const lmloss_tensor *out) {
  constexpr int64_t C = 32 * (16 / sizeof(T));
  const bool aligned = (a->row_stride * sizeof(T)) % 16 == 0 && (uintptr_t)a->data % 16 == 0;
  colsum_kernel<T><<<(unsigned)((a->cols + C - 1) / C), 256, 0, stream_of(ctx)>>>(
      (const T *)a->data, a->row_stride, a->rows, a->cols, aligned, kp, beta, out->data, out->dtype,
      out->row_stride);
}

static lmloss_status colsum(const lmloss_context *ctx, const lmloss_tensor *a,
                            const lmloss_row_keep *entries, float beta, const lmloss_tensor *out) {
  if (a->cols == 0) return LMLOSS_OK;
  const lmloss_row_keep kp = entries ? *entries : lmloss_row_keep{};
  if (a->dtype == LMLOSS_BF16)
    launch_colsum<bf16>(ctx, a, kp, beta, out);
  else if (a->dtype == LMLOSS_F16)
    launch_colsum<f16>(ctx, a, kp, beta, out);
  else
    launch_colsum<float>(ctx, a, kp, beta, out);
  return check_launch("colsum");
}

__global__ void sum_kernel(const float *src, int64_t stride, int64_t n, float *dst) {
  __shared__ double part[256];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    s += src[i * stride];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int off = blockDim.x / 2; off > 0; off >>= 1) {
    if ((int)threadIdx.x < off) part[threadIdx.x] += part[threadIdx.x + off];
    __syncthreads();
  }
  if (threadIdx.x == 0) *dst = (float)part[0];
}

static lmloss_status sum(const lmloss_context *ctx, const lmloss_tensor *src,
                         const lmloss_tensor *dst) {
  sum_kernel<<<1, 256, 0, stream_of(ctx)>>>((const float *)src->data, src->row_stride, src->rows,
                                            (float *)dst->data);
  return check_launch("sum");
}

/* Rows of F32 rounded to a 16-bit dtype (dhidden's fp32 sum, a dW tile's
 * or dbias's): elementwise and memory-bound, a row per blockIdx.y, eight
 * columns per thread across blockIdx.x (two 16-byte loads, one 16-byte
 * store where aligned). */
template <typename O>
__global__ void round_rows_kernel(const float *src, int64_t sstride, O *dst, int64_t dstride,
                                  int64_t rows, int64_t cols, bool aligned) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float *s = src + r * sstride;
    O *d = dst + r * dstride;
    for (int64_t j = 8 * (blockIdx.x * (int64_t)blockDim.x + threadIdx.x); j < cols;
         j += 8 * (int64_t)gridDim.x * blockDim.x) {
      if (aligned && j + 8 <= cols) {
        const Raw<float> lo = load_vec<float, STREAM>(s, j, cols, true),
                         hi = load_vec<float, STREAM>(s, j + 4, cols, true);
        const float x[8] = {lo.e[0], lo.e[1], lo.e[2], lo.e[3], hi.e[0], hi.e[1], hi.e[2], hi.e[3]};
        store_whole<O, 8>(d + j, x);
      } else {
        for (int64_t k = j; k < j + 8 && k < cols; k++)
          d[k] = fromf<O>(s[k]);
      }
    }
  }
}

static lmloss_status cast(const lmloss_context *ctx, const lmloss_tensor *src,
                          const lmloss_tensor *dst) {
  const bool to16 = dst->dtype == LMLOSS_BF16 || dst->dtype == LMLOSS_F16;
  if (src->dtype != LMLOSS_F32 || !to16) return elementwise(ctx, 1, src, dst, 0.0);
  const int64_t n = src->rows, bx = (src->cols + 2047) / 2048;
  if (n == 0 || src->cols == 0) return LMLOSS_OK;
  const dim3 grid((unsigned)(bx < 64 ? bx : 64), (unsigned)(n < 65535 ? n : 65535));
  const bool aligned = src->row_stride % 4 == 0 && dst->row_stride % 8 == 0 &&
                       ((uintptr_t)src->data | (uintptr_t)dst->data) % 16 == 0;
  if (dst->dtype == LMLOSS_BF16)
    round_rows_kernel<bf16><<<grid, 256, 0, stream_of(ctx)>>>(
        (const float *)src->data, src->row_stride, (bf16 *)dst->data, dst->row_stride, n, src->cols,
        aligned);
  else
    round_rows_kernel<f16><<<grid, 256, 0, stream_of(ctx)>>>(
        (const float *)src->data, src->row_stride, (f16 *)dst->data, dst->row_stride, n, src->cols,
        aligned);
  return check_launch("cast");
}

/* A CTA per row, its threads across H, the row's entries in order (so no
 * two threads add to one element): the few W rows it reads are what the
 * lo half of a second dhidden GEMM would have read in full. */
template <typename W>
__global__ void restore_kernel(lmloss_row_keep kp, const W *w, int64_t wstride, int64_t V,
                               float *acc, int64_t astride, int64_t rows, int64_t H) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t *cr = kp.cols + r * kp.stride;
    float *a = acc + r * astride;
    for (int64_t s = 0; s < kp.count; s++) {
      const int64_t c = cr[s];
      const float v = kp.vals[r * kp.stride + s], rv = tof(fromf<W>(v));
      if (c < 0 || c >= V || !isfinite(rv) || v == rv || !first_in_row(cr, s)) continue;
      const float lost = v - rv; /* exact in fp32 */
      for (int64_t k = threadIdx.x; k < H; k += blockDim.x)
        a[k] = fmaf(lost, tof(w[c * wstride + k]), a[k]);
    }
  }
}

static lmloss_status restore_entries(const lmloss_context *ctx, const lmloss_row_keep *entries,
                                     const lmloss_tensor *weight, const lmloss_tensor *acc) {
  const int64_t n = acc->rows;
  if (n == 0 || entries->count == 0) return LMLOSS_OK;
  const unsigned grid = (unsigned)(n < 65535 ? n : 65535);
  if (weight->dtype == LMLOSS_BF16)
    restore_kernel<bf16><<<grid, 256, 0, stream_of(ctx)>>>(
        *entries, (const bf16 *)weight->data, weight->row_stride, weight->rows, (float *)acc->data,
        acc->row_stride, n, acc->cols);
  else
    restore_kernel<f16><<<grid, 256, 0, stream_of(ctx)>>>(
        *entries, (const f16 *)weight->data, weight->row_stride, weight->rows, (float *)acc->data,
        acc->row_stride, n, acc->cols);
  return check_launch("restore_entries");
}

} // namespace lmc

extern "C" const lmloss_linear_prims lmloss_cuda_linear = {
    lmc::gemm, lmc::select_rows, lmc::gather_rows,     lmc::scatter_rows,
    lmc::fill, lmc::logits,      lmc::colsum,          lmc::sum,
    lmc::cast, lmc::scale,       lmc::restore_entries, lmc::scale_rows,
};
