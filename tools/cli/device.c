/* device.c - host or CUDA memory for the command's cases. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

#ifdef LMLOSS_CLI_CUDA
#include <cuda_runtime.h>

static void cuda_ok(cudaError_t e, const char *what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "lmloss: CUDA %s failed: %s\n", what, cudaGetErrorString(e));
    exit(2);
  }
}
#endif

int cli_cuda_available(void) {
#ifdef LMLOSS_CLI_CUDA
  int n = 0;
  return lmloss_has_cuda() && cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return 0;
#endif
}

void *cli_alloc(lmloss_device dev, size_t bytes) {
  void *p = NULL;
  if (dev == LMLOSS_CPU) p = malloc(bytes);
#ifdef LMLOSS_CLI_CUDA
  else
    cuda_ok(cudaMalloc(&p, bytes), "cudaMalloc");
#endif
  if (!p) {
    fprintf(stderr, "lmloss: out of memory (%zu bytes)\n", bytes);
    exit(2);
  }
  return p;
}

void cli_free(lmloss_device dev, void *p) {
  if (dev == LMLOSS_CPU) free(p);
#ifdef LMLOSS_CLI_CUDA
  else
    cudaFree(p);
#endif
}

void cli_upload(lmloss_device dev, void *dst, const void *src, size_t bytes) {
  if (dev == LMLOSS_CPU) memcpy(dst, src, bytes);
#ifdef LMLOSS_CLI_CUDA
  else
    cuda_ok(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "upload");
#endif
}

void cli_download(lmloss_device dev, void *dst, const void *src, size_t bytes) {
  if (dev == LMLOSS_CPU) memcpy(dst, src, bytes);
#ifdef LMLOSS_CLI_CUDA
  else
    cuda_ok(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "download");
#endif
}

void cli_sync(lmloss_device dev) {
#ifdef LMLOSS_CLI_CUDA
  if (dev == LMLOSS_CUDA) cuda_ok(cudaDeviceSynchronize(), "synchronize");
#endif
  (void)dev;
}
