/* The smallest program against an installed lmloss: the cross-entropy of a
 * small peaked batch (each row's target logit 8 above the rest), printed
 * per row and as the mean. Built by examples/hello/CMakeLists.txt through
 * find_package(lmloss), or by hand through pkg-config:
 *   cc main.c $(pkg-config --cflags --libs lmloss) -o hello */
#include <math.h>
#include <stdio.h>

#include "lmloss.h"

enum { N = 4, V = 16 };

int main(void) {
  float logits[N * V], loss[N];
  int64_t target[N] = {3, 0, 15, 7};
  for (int i = 0; i < N; i++)
    for (int j = 0; j < V; j++)
      logits[i * V + j] = (j == target[i]) ? 8.0f : 0.01f * j;

  lmloss_ce_inputs in = {.logits = {logits, LMLOSS_F32, LMLOSS_CPU, N, V, V},
                         .target = {target, LMLOSS_I64, LMLOSS_CPU, N, 1, 1}};
  lmloss_ce_options opt = lmloss_ce_options_default();
  opt.reduction = LMLOSS_REDUCE_NONE;
  lmloss_ce_outputs out = {.loss = {loss, LMLOSS_F32, LMLOSS_CPU, N, 1, 1}};
  static unsigned char ws[4096];
  size_t ws_bytes = lmloss_cross_entropy_workspace_size(N);
  if (ws_bytes > sizeof ws) {
    fprintf(stderr, "hello: workspace of %zu bytes > %zu\n", ws_bytes, sizeof ws);
    return 1;
  }
  if (lmloss_cross_entropy(NULL, &in, &opt, &out, ws, ws_bytes) != LMLOSS_OK) {
    fprintf(stderr, "hello: %s\n", lmloss_last_error());
    return 1;
  }

  int v = lmloss_version();
  printf("lmloss %d.%d.%d (header %d.%d.%d)\n", v / 10000, v / 100 % 100, v % 100,
         LMLOSS_VERSION_MAJOR, LMLOSS_VERSION_MINOR, LMLOSS_VERSION_PATCH);
  double mean = 0;
  for (int i = 0; i < N; i++) {
    printf("row %d target %2lld loss %.6e\n", i, (long long)target[i], loss[i]);
    mean += loss[i] / N;
  }
  printf("mean cross-entropy %.6e\n", mean);
  /* Every row: log(e^8 + the sum of the 15 others e^(0.01 j)) - 8, about 5.4e-3. */
  for (int i = 0; i < N; i++)
    if (!(loss[i] > 1e-3f && loss[i] < 1e-2f && isfinite(loss[i]))) return 1;
  return 0;
}
