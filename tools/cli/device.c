/* device.c - host or CUDA memory for the command's cases. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

static void out_of_memory(const char *where, double bytes, const char *why) {
  fprintf(stderr, "lmloss: cannot allocate %.1f GiB of %s memory%s (a smaller --shape?)\n",
          bytes / (1024.0 * 1024.0 * 1024.0), where, why);
  exit(2);
}

void *cli_host_alloc(size_t n, size_t size, int zero) {
  const double bytes = (double)n * (double)size;
  /* Beyond the physical memory an overcommitting kernel may still grant
   * the allocation, then kill the process when it touches the pages. */
  const double phys = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
  if (n && size > SIZE_MAX / n) out_of_memory("host", bytes, ": the size overflows");
  if (phys > 0 && bytes > phys) out_of_memory("host", bytes, ", more than this machine has");
  const size_t total = n * size;
  void *p = zero ? calloc(total ? n : 1, total ? size : 1) : malloc(total ? total : 1);
  if (!p) out_of_memory("host", bytes, "");
  return p;
}

void *cli_alloc(lmloss_device dev, size_t bytes) {
  if (dev == LMLOSS_CPU) return cli_host_alloc(bytes, 1, 0);
  void *p = NULL;
#ifdef LMLOSS_CLI_CUDA
  if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
    cudaGetLastError(); /* clear it: the message says what failed */
    out_of_memory("device", (double)bytes, "");
  }
#endif
  if (!p) out_of_memory("device", (double)bytes, "");
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
