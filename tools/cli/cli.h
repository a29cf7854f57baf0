/*
 * cli.h - the `lmloss` command: shared pieces of its subcommands.
 *
 * A case is one op at one shape, dtype and device, with random inputs
 * (optionally peaked rows: the target leads the rest by `margin`) and its
 * output buffers. The same case runs on any backend; check compares a
 * backend's outputs with the float64 REF backend's on the same inputs,
 * bench times it against the limit measured in the same run.
 */
#ifndef LMLOSS_CLI_H
#define LMLOSS_CLI_H

#include <stddef.h>
#include <stdlib.h>
#include <time.h>

#include "lmloss.h"

static inline double cli_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static inline int cli_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Median of n timings (sorts them). */
static inline double cli_median(double *t, int n) {
  qsort(t, (size_t)n, sizeof t[0], cli_cmp_double);
  return t[n / 2];
}

typedef enum {
  OP_CE,                /* CE forward, mean, smoothing + z-loss, lse + entropy */
  OP_CE_GRAD,           /* CE forward + backward in one pass (dlogits) */
  OP_CE_BWD,            /* CE backward from dloss */
  OP_LOGPROB,           /* log-probs forward, K indices */
  OP_LOGPROB_ENT,       /* log-probs + entropy forward */
  OP_LOGPROB_BWD,       /* log-probs backward from dlogp and dentropy */
  OP_LOGPROB_BWD_SAVED, /* the same from the forward's saved row statistics */
  OP_SOFTMAX,           /* softmax forward */
  OP_LOG_SOFTMAX,       /* log-softmax forward */
  OP_SOFTMAX_BWD,       /* softmax backward from y */
  OP_LINEAR_CE,         /* fused head CE, forward + dhidden, dW, dbias */
  OP_LINEAR_LP,         /* fused head log-probs + entropy, then their backward from its stats */
  /* divergences between the logits (student) and a teacher, forward and
   * the student's gradient in one call (batchmean; the JSD at beta 0.5) */
  OP_KL,
  OP_REVERSE_KL,
  OP_JSD,
  OP_TVD,
  OP_COUNT
} cli_op;

typedef struct {
  cli_op op;
  int64_t N, V, H, K;
  lmloss_dtype dt;
  lmloss_device dev;
  double margin; /* 0: plain random rows */
  int plain;     /* no ignored rows, no CE options, no dentropy (the bare ops) */
  /* tensors of the case, on dev; outputs listed in out[] */
  lmloss_tensor x, idx, dloss, dlogp, dent, hidden, weight, bias, y, teacher;
  /* The forward's row statistics: OP_LOGPROB_BWD_SAVED's (and its
   * log-probs), formed by the case's first run on the context it runs on;
   * OP_LINEAR_LP's, formed by each run's forward */
  lmloss_tensor stats, stats_logp;
  int stats_ready;
  lmloss_tensor out[5];
  int nout;
  void *ws;
  size_t ws_bytes;
} cli_case;

const char *cli_op_name(cli_op op);
int cli_op_parse(const char *name, cli_op *op);
int cli_op_is_linear(cli_op op);
int cli_op_is_ce(cli_op op);  /* the ops with targets (and ignored rows) */
int cli_op_is_div(cli_op op); /* the ops with a teacher */
/* Minimum bytes the op must move (bandwidth ops) and its GEMM flops. */
double cli_op_bytes(const cli_case *c);
double cli_op_flops(const cli_case *c);

/* Inputs from `seed` (identical on every device), outputs allocated; the
 * CE ops supervise a `supervised` fraction of the rows (1: all), spread
 * evenly, and ignore the rest. */
int cli_case_init(cli_case *c, cli_op op, int64_t N, int64_t V, int64_t H, lmloss_dtype dt,
                  lmloss_device dev, double margin, int plain, double supervised, unsigned seed);
lmloss_status cli_case_run(cli_case *c, const lmloss_context *ctx);
/* Output k as doubles on the host (malloc'd, *n elements, *cols per row). */
double *cli_case_fetch(const cli_case *c, int k, size_t *n, int64_t *cols);
void cli_case_free(cli_case *c);

/* Device memory (CUDA only when built with it). Every allocation of the
 * command goes through cli_host_alloc or cli_alloc, which print what
 * failed and exit with status 2 rather than return NULL. */
int cli_cuda_available(void);
void *cli_host_alloc(size_t n, size_t size, int zero); /* n elements of size bytes */
void *cli_alloc(lmloss_device dev, size_t bytes);
void cli_free(lmloss_device dev, void *p);
void cli_upload(lmloss_device dev, void *dst, const void *src, size_t bytes);
void cli_download(lmloss_device dev, void *dst, const void *src, size_t bytes);
void cli_sync(lmloss_device dev);

/* Limits measured on this machine, in the same run as the timings. */
double cli_limit_exp_pass_ms(const float *x, int64_t n, int threads);  /* CPU */
double cli_limit_copy_gbs(lmloss_device dev, size_t bytes, int queue); /* CUDA D2D */
double cli_limit_gemm_ms(const cli_case *c, int reps, int queue);      /* the op's GEMMs */

int cmd_check(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_collapse(int argc, char **argv);

#endif
