/* status.c - status names and the thread-local last-error message. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "backend.h"

static _Thread_local char last_error[512];

lmloss_status lmloss_fail(lmloss_status s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return s;
}

const char *lmloss_last_error(void) { return last_error; }

const char *lmloss_status_string(lmloss_status s) {
  switch (s) {
  case LMLOSS_OK: return "LMLOSS_OK";
  case LMLOSS_ERR_NULL_POINTER: return "LMLOSS_ERR_NULL_POINTER";
  case LMLOSS_ERR_BAD_DTYPE: return "LMLOSS_ERR_BAD_DTYPE";
  case LMLOSS_ERR_BAD_SHAPE: return "LMLOSS_ERR_BAD_SHAPE";
  case LMLOSS_ERR_BAD_STRIDE: return "LMLOSS_ERR_BAD_STRIDE";
  case LMLOSS_ERR_INDEX_OUT_OF_RANGE: return "LMLOSS_ERR_INDEX_OUT_OF_RANGE";
  case LMLOSS_ERR_BAD_OPTION: return "LMLOSS_ERR_BAD_OPTION";
  case LMLOSS_ERR_WORKSPACE_TOO_SMALL: return "LMLOSS_ERR_WORKSPACE_TOO_SMALL";
  case LMLOSS_ERR_BAD_DEVICE: return "LMLOSS_ERR_BAD_DEVICE";
  case LMLOSS_ERR_UNSUPPORTED: return "LMLOSS_ERR_UNSUPPORTED";
  case LMLOSS_ERR_DEVICE_FAILURE: return "LMLOSS_ERR_DEVICE_FAILURE";
  case LMLOSS_ERR_OUT_OF_MEMORY: return "LMLOSS_ERR_OUT_OF_MEMORY";
  }
  return "LMLOSS_ERR_UNKNOWN";
}

lmloss_context lmloss_context_default(void) {
  lmloss_context c = {LMLOSS_BACKEND_AUTO, NULL, 0};
  return c;
}

lmloss_transform lmloss_transform_default(void) {
  lmloss_transform t = {1.0f, 0.0f, 1.0f};
  return t;
}

lmloss_ce_options lmloss_ce_options_default(void) {
  lmloss_ce_options o;
  o.ignore_index = -100;
  o.label_smoothing = 0.0f;
  o.z_loss = 0.0f;
  o.transform = lmloss_transform_default();
  o.reduction = LMLOSS_REDUCE_MEAN;
  o.num_items = 1.0;
  o.dft = 0;
  o.grad_output = 1.0f;
  o.zero_ignored_rows = 1;
  return o;
}

size_t lmloss_cross_entropy_workspace_size(int64_t rows) {
  if (rows < 0) rows = 0;
  return LMLOSS_CE_WS_HEADER + (size_t)rows * 3 * sizeof(double);
}

int lmloss_has_cuda(void) {
#ifdef LMLOSS_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

int lmloss_version(void) {
  return LMLOSS_VERSION_MAJOR * 10000 + LMLOSS_VERSION_MINOR * 100 + LMLOSS_VERSION_PATCH;
}

lmloss_shard lmloss_shard_default(void) {
  lmloss_shard s = {0, 0, 0};
  return s;
}

size_t lmloss_struct_size(const char *name) {
#define LMLOSS_STRUCT(t)                                                                           \
  { #t, sizeof(t) }
  static const struct {
    const char *name;
    size_t size;
  } structs[] = {
      LMLOSS_STRUCT(lmloss_tensor),
      LMLOSS_STRUCT(lmloss_context),
      LMLOSS_STRUCT(lmloss_transform),
      LMLOSS_STRUCT(lmloss_ce_options),
      LMLOSS_STRUCT(lmloss_ce_inputs),
      LMLOSS_STRUCT(lmloss_ce_outputs),
      LMLOSS_STRUCT(lmloss_head),
      LMLOSS_STRUCT(lmloss_head_options),
      LMLOSS_STRUCT(lmloss_head_grads),
      LMLOSS_STRUCT(lmloss_shard),
      LMLOSS_STRUCT(lmloss_div_options),
      LMLOSS_STRUCT(lmloss_div_inputs),
      LMLOSS_STRUCT(lmloss_div_outputs),
      LMLOSS_STRUCT(lmloss_grpo_options),
      LMLOSS_STRUCT(lmloss_grpo_inputs),
      LMLOSS_STRUCT(lmloss_grpo_outputs),
      LMLOSS_STRUCT(lmloss_pref_options),
      LMLOSS_STRUCT(lmloss_pref_inputs),
      LMLOSS_STRUCT(lmloss_pref_outputs),
      LMLOSS_STRUCT(lmloss_kto_options),
      LMLOSS_STRUCT(lmloss_kto_inputs),
      LMLOSS_STRUCT(lmloss_kto_outputs),
      LMLOSS_STRUCT(lmloss_linear_pref_inputs),
      LMLOSS_STRUCT(lmloss_linear_pref_outputs),
  };
#undef LMLOSS_STRUCT
  for (size_t i = 0; name && i < sizeof structs / sizeof *structs; i++)
    if (strcmp(name, structs[i].name) == 0) return structs[i].size;
  return 0;
}
