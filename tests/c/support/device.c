/*
 * device.c - the backend under test and its memory. cpu: host buffers of
 * exactly the tensor's span (so ASan sees any overrun). cuda: libcudart
 * through dlopen; a missing runtime or GPU is a test failure, never a skip.
 */
#include <dlfcn.h>

#include "testing.h"

static int use_cuda = -1;
static int (*cu_malloc)(void **, size_t);
static int (*cu_free)(void *);
static int (*cu_memcpy)(void *, const void *, size_t, int);
static int (*cu_sync)(void);
static int (*cu_count)(int *);

static void die(const char *msg) {
  fprintf(stderr, "FAIL: LMLOSS_TEST_BACKEND=cuda: %s\n", msg);
  printf("FAIL: LMLOSS_TEST_BACKEND=cuda: %s\n", msg);
  exit(1);
}

void tb_init(void) {
  const char *e = getenv("LMLOSS_TEST_BACKEND");
  if (!e || !*e || !strcmp(e, "cpu")) {
    use_cuda = 0;
    return;
  }
  if (strcmp(e, "cuda")) {
    fprintf(stderr, "FAIL: unknown LMLOSS_TEST_BACKEND=%s (cpu or cuda)\n", e);
    exit(1);
  }
  use_cuda = 1;
  if (!lmloss_has_cuda()) die("this build of lmloss has no CUDA backend");
  const char *names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"};
  void *h = NULL;
  for (int i = 0; i < 4 && !h; i++)
    h = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
  if (!h) die("cannot dlopen libcudart");
  cu_malloc = (int (*)(void **, size_t))dlsym(h, "cudaMalloc");
  cu_free = (int (*)(void *))dlsym(h, "cudaFree");
  cu_memcpy = (int (*)(void *, const void *, size_t, int))dlsym(h, "cudaMemcpy");
  cu_sync = (int (*)(void))dlsym(h, "cudaDeviceSynchronize");
  cu_count = (int (*)(int *))dlsym(h, "cudaGetDeviceCount");
  if (!cu_malloc || !cu_free || !cu_memcpy || !cu_sync || !cu_count)
    die("libcudart lacks cudaMalloc/cudaFree/cudaMemcpy/cudaDeviceSynchronize");
  int n = 0;
  if (cu_count(&n) != 0 || n < 1) die("no CUDA device");
}

int tb_is_cuda(void) { return use_cuda == 1; }

const char *tb_name(void) { return use_cuda == 1 ? "[cuda]" : "[cpu]"; }

lmloss_context tb_ctx(void) {
  lmloss_context c = lmloss_context_default();
  c.backend = use_cuda == 1 ? LMLOSS_BACKEND_CUDA : LMLOSS_BACKEND_CPU;
  return c;
}

lmloss_context ref_ctx(void) {
  lmloss_context c = lmloss_context_default();
  c.backend = LMLOSS_BACKEND_REF;
  return c;
}

void *dev_alloc_bytes(size_t n) {
  void *p = NULL;
  if (use_cuda == 1) {
    if (cu_malloc(&p, n ? n : 1) != 0) die("cudaMalloc failed");
  } else if (!(p = malloc(n ? n : 1))) {
    fprintf(stderr, "FAIL: out of memory\n");
    exit(1);
  }
  return p;
}

void dev_free_bytes(void *p) {
  if (use_cuda == 1)
    cu_free(p);
  else
    free(p);
}

void dev_put(void *dev_dst, const void *host_src, size_t n) {
  if (use_cuda == 1) {
    if (n && cu_memcpy(dev_dst, host_src, n, 1) != 0) die("cudaMemcpy to device failed");
  } else if (n) {
    memcpy(dev_dst, host_src, n);
  }
}

lmloss_tensor dev_clone(const lmloss_tensor *host) {
  lmloss_tensor d = *host;
  if (!host->data) return d;
  size_t n = tensor_bytes(host);
  d.data = dev_alloc_bytes(n);
  d.device = use_cuda == 1 ? LMLOSS_CUDA : LMLOSS_CPU;
  dev_put(d.data, host->data, n);
  return d;
}

void dev_fetch(lmloss_tensor *host, const lmloss_tensor *dev) {
  size_t n = tensor_bytes(host);
  if (!host->data || !n) return;
  if (use_cuda == 1) {
    if (cu_sync() != 0) die("cudaDeviceSynchronize failed");
    if (cu_memcpy(host->data, dev->data, n, 2) != 0) die("cudaMemcpy to host failed");
  } else {
    memcpy(host->data, dev->data, n);
  }
}

void dev_free(lmloss_tensor *dev) {
  if (dev->data) dev_free_bytes(dev->data);
  dev->data = NULL;
}
