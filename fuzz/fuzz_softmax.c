/*
 * fuzz_softmax.c - lmloss_softmax and lmloss_softmax_backward (softmax
 * and log-softmax, in place or not) on the CPU and REF backends.
 */
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_in in = {data, size, size};
  fz_pool pool = {0};
  const int64_t N = fz_range(&in, 0, 6) - fz_chance(&in, 4);
  const int64_t V = fz_chance(&in, 16) ? fz_range(&in, 2040, 4500) : fz_range(&in, 0, 80);
  const int log = (int)fz_range(&in, 0, 1) + (fz_chance(&in, 4) ? 5 : 0);
  const int backward = (int)fz_range(&in, 0, 1), inplace = fz_chance(&in, 64);
  const lmloss_dtype xdt = fz_float_dtype(&in);
  lmloss_tensor x = fz_tensor(&in, &pool, xdt, N, V, V, 0);
  lmloss_tensor dy = fz_tensor(&in, &pool, fz_dtype(&in, xdt), N, V, V, 0);
  lmloss_tensor out = fz_tensor(&in, &pool, fz_dtype(&in, xdt), N, V, V, 0);
  lmloss_context cpu = fz_context(&in, LMLOSS_BACKEND_CPU), ref = cpu;
  ref.backend = LMLOSS_BACKEND_REF;

  /* In place: the output over the input it may alias (x forward, dy
   * backward), each backend its own copy of it. */
  const lmloss_tensor *src = backward ? &dy : &x;
  lmloss_tensor oc = inplace ? fz_clone(&pool, src) : out, orf = fz_clone(&pool, &oc);
  fz_outs wc = {0}, wr = {0};
  fz_watch(&wc, &pool, &oc), fz_watch(&wr, &pool, &orf);
  if (inplace && fz_span(src)) {
    memcpy(oc.data, src->data, fz_span(src)), memcpy(orf.data, src->data, fz_span(src));
    memcpy(wc.before[0], src->data, fz_span(src)), memcpy(wr.before[0], src->data, fz_span(src));
  }
  lmloss_status sc, sr;
  if (!backward) {
    sc = lmloss_softmax(&cpu, inplace ? &oc : &x, log, &oc);
    sr = lmloss_softmax(&ref, inplace ? &orf : &x, log, &orf);
  } else {
    sc = lmloss_softmax_backward(&cpu, &x, inplace ? &oc : &dy, log, &oc);
    sr = lmloss_softmax_backward(&ref, &x, inplace ? &orf : &dy, log, &orf);
  }
  fz_check(sc, &wc, "softmax on CPU");
  fz_check(sr, &wr, "softmax on REF");
  fz_agree(sc, sr, "softmax");
  fz_release(&pool);
  return 0;
}
