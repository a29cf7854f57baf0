/*
 * limits.c - the machine's limits, measured in the same run as a
 * benchmark: on the CPU one pass that reads every logit and takes a
 * vectorized exp of each (glibc's libmvec: this file is built with
 * -ffast-math), on CUDA a device-to-device copy, and for the fused head
 * the three GEMMs it cannot avoid (OpenBLAS / cuBLAS) on materialized
 * buffers.
 */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cli.h"
#include "cpu/dispatch.h"

#ifdef LMLOSS_CLI_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

LMLOSS_CPU_DISPATCH static float exp_pass(const float *x, int64_t n, int threads) {
  float total = 0.0f;
#pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
  for (int64_t b = 0; b < n; b += 4096) {
    const int64_t e = b + 4096 < n ? b + 4096 : n;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = b; j < e; j++)
      s += expf(x[j]);
    total += s;
  }
  return total;
}

double cli_limit_exp_pass_ms(const float *x, int64_t n, int threads) {
  double t[7];
  volatile float sink = 0;
  if (threads <= 0) threads = omp_get_max_threads();
  for (int r = -1; r < 7; r++) {
    double t0 = cli_now_ms();
    sink += exp_pass(x, n, threads);
    if (r >= 0) t[r] = cli_now_ms() - t0;
  }
  (void)sink;
  return cli_median(t, 7);
}

double cli_limit_copy_gbs(lmloss_device dev, size_t bytes, int queue) {
#ifdef LMLOSS_CLI_CUDA
  void *a = cli_alloc(dev, bytes), *b = cli_alloc(dev, bytes);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  float t[20];
  for (int r = -2; r < 20; r++) {
    cudaEventRecord(e0, 0);
    for (int q = 0; q < queue; q++)
      cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0);
    cudaEventRecord(e1, 0);
    cudaEventSynchronize(e1);
    if (r >= 0) cudaEventElapsedTime(&t[r], e0, e1);
  }
  double d[20];
  for (int r = 0; r < 20; r++)
    d[r] = t[r] / queue;
  cli_median(d, 20);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  cli_free(dev, a), cli_free(dev, b);
  return 2.0 * bytes / (d[10] * 1e6);
#else
  (void)dev, (void)bytes, (void)queue;
  return 0;
#endif
}

#ifdef LMLOSS_CLI_CUDA
/* Row-major C[m,n] = op(A) op(B) as column-major C^T = op(B)^T op(A)^T. */
static void cu_gemm(cublasHandle_t h, int ta, int tb, int64_t m, int64_t n, int64_t k,
                    const void *A, int64_t lda, cudaDataType at, const void *B, int64_t ldb,
                    void *C, int64_t ldc, cudaDataType ct) {
  const float one = 1.0f, zero = 0.0f;
  cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n, (int)m,
               (int)k, &one, B, at, (int)ldb, A, at, (int)lda, &zero, C, ct, (int)ldc,
               at == CUDA_R_32F ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}
#endif

/* The op's three GEMMs alone: logits = h W^T (fp32), dhidden = dl W
 * (hidden dtype), dW = dl^T h (fp32); on CUDA queue times a sample. */
double cli_limit_gemm_ms(const cli_case *c, int reps, int queue) {
  const int64_t N = c->N, V = c->V, H = c->H;
  double *t = cli_host_alloc((size_t)reps, sizeof(double), 0), ms;
  if (c->dev == LMLOSS_CPU) {
    float *logits = cli_host_alloc((size_t)(N * V), sizeof(float), 0);
    float *dh = cli_host_alloc((size_t)(N * H), sizeof(float), 0),
          *dw = cli_host_alloc((size_t)(V * H), sizeof(float), 0);
    const float *h = c->hidden.data, *w = c->weight.data;
    for (int r = -1; r < reps; r++) {
      double t0 = cli_now_ms();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, V, H, 1, h, H, w, H, 0, logits, V);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, H, V, 1, logits, V, w, H, 0, dh, H);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, H, N, 1, logits, V, h, H, 0, dw, H);
      if (r >= 0) t[r] = cli_now_ms() - t0;
    }
    free(logits), free(dh), free(dw);
  } else {
#ifdef LMLOSS_CLI_CUDA
    cudaDataType at = c->dt == LMLOSS_F32    ? CUDA_R_32F
                      : c->dt == LMLOSS_BF16 ? CUDA_R_16BF
                                             : CUDA_R_16F;
    size_t es = c->dt == LMLOSS_F32 ? 4 : 2;
    void *logits = cli_alloc(c->dev, (size_t)(N * V) * 4),
         *dl = cli_alloc(c->dev, (size_t)(N * V) * es);
    void *dh = cli_alloc(c->dev, (size_t)(N * H) * es),
         *dw = cli_alloc(c->dev, (size_t)(V * H) * 4);
    cudaMemset(dl, 0x3c, (size_t)(N * V) * es); /* non-zero operands */
    cublasHandle_t hd;
    cublasCreate(&hd);
    if (c->dt == LMLOSS_F32) cublasSetMathMode(hd, CUBLAS_PEDANTIC_MATH); /* no TF32 */
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    for (int r = -2; r < reps; r++) {
      cudaEventRecord(e0, 0);
      for (int q = 0; q < queue; q++) {
        cu_gemm(hd, 0, 1, N, V, H, c->hidden.data, H, at, c->weight.data, H, logits, V, CUDA_R_32F);
        cu_gemm(hd, 0, 0, N, H, V, dl, V, at, c->weight.data, H, dh, H, at);
        cu_gemm(hd, 1, 0, V, H, N, dl, V, at, c->hidden.data, H, dw, H, CUDA_R_32F);
      }
      cudaEventRecord(e1, 0);
      cudaEventSynchronize(e1);
      float f;
      cudaEventElapsedTime(&f, e0, e1);
      if (r >= 0) t[r] = f / queue;
    }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cublasDestroy(hd);
    cli_free(c->dev, logits), cli_free(c->dev, dl), cli_free(c->dev, dh), cli_free(c->dev, dw);
#endif
  }
  ms = cli_median(t, reps);
  free(t);
  return ms;
}
