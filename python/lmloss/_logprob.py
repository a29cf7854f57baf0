"""Per-token log-probs (selective log-softmax), entropy, and their backward."""

from typing import Optional, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike

from . import _lib
from ._tensor import (Rows, as_array, index_shape, matrix, optional_vector, out_matrix, out_vector,
                      shape_error, vector)


def log_probs(logits: ArrayLike, index: ArrayLike, *, temperature: float = 1.0,
              mask: Optional[ArrayLike] = None, entropy: bool = False, stats: bool = False,
              backend: str = "auto", num_threads: int = 0
              ) -> Union[np.ndarray, Tuple[np.ndarray, ...]]:
    """log softmax(logits / temperature) gathered at index.

    logits [..., V] (fp32, fp64 computed in fp32, bf16 as ml_dtypes.bfloat16
    or uint16 bits, fp16); index [...] or [..., K] int64/int32 with
    0 <= index < V, K <= V. Returns float32 shaped like index, or
    (logp, entropy) with entropy=True (entropy float32 shaped [...]).
    mask: optional bool/uint8 [...]; masked-out rows (0) are not read and
    read 0 in every result. [B, T, V] inputs are one call over B*T rows.
    stats=True appends the rows' statistics (float32 [..., 4], V <= 2^24),
    which log_probs_backward takes to read the logits once.
    backend: "auto", "cpu" or "ref"; num_threads: 0 = default.
    """
    ctx = _lib.make_context(backend, num_threads)
    x = Rows(logits, "logits")
    k, shape = index_shape(x, index)
    idx, idx_t = matrix(index, x.n, k, "index", "index")
    keep = [idx]
    mask_t = optional_vector(mask, x.n, x.lead, "mask", "mask", keep)
    logp, logp_t = out_matrix(x.n, k)
    ent, ent_t = out_vector(x.n) if entropy else (None, None)
    st, st_t = stats_out(x.n) if stats else (None, None)
    tr = _lib.make_transform(temperature=temperature)
    _lib.check(_lib.log_probs(ctx, x.t, idx_t, mask_t, tr, logp_t, ent_t, st_t))
    out = (logp.reshape(shape),) + ((ent.reshape(x.lead),) if entropy else ())
    out += (st.reshape(x.lead + (_lib.ROW_STATS,)),) if stats else ()
    return out if len(out) > 1 else out[0]


selective_log_softmax = log_probs  # TRL's name: gather(log_softmax(logits), index)


def log_probs_backward(logits: ArrayLike, index: Optional[ArrayLike],
                       dlogp: Optional[ArrayLike], dentropy: Optional[ArrayLike] = None, *,
                       temperature: float = 1.0, mask: Optional[ArrayLike] = None,
                       stats: Optional[ArrayLike] = None, backend: str = "auto",
                       num_threads: int = 0) -> np.ndarray:
    """dlogits = d/dlogits of sum(dlogp * logp) + sum(dentropy * entropy).

    Shapes as in log_probs; dlogp (shaped like index) and dentropy (shaped
    [...]) are converted to float32; dlogp may be None when dentropy is
    given (index may then be None too). stats: what log_probs(stats=True)
    returned for these logits, mask and temperature (then the logits are
    read once), or None (recomputed). Returns dlogits shaped like logits:
    float32 for fp32/fp64 logits, else the logits' dtype (bf16, fp16).
    """
    ctx = _lib.make_context(backend, num_threads)
    x = Rows(logits, "logits")
    keep, idx_t, dlogp_t, dent_t, _ = backward_args(x, x.n, index, dlogp, dentropy)
    mask_t = optional_vector(mask, x.n, x.lead, "mask", "mask", keep)
    st_t = stats_in(stats, x, keep)
    dx, dx_t = x.empty(x.out_dtype())
    tr = _lib.make_transform(temperature=temperature)
    _lib.check(_lib.log_probs_backward(ctx, x.t, idx_t, mask_t, tr, dlogp_t, dent_t, dx_t,
                                       st_t))
    return dx.reshape(x.lead + (x.v,))


def stats_out(n):
    """A new float32 [n, 4] array for the rows' statistics, and its tensor."""
    return out_matrix(n, _lib.ROW_STATS)


def stats_in(stats, x, keep):
    """The tensor of given statistics ([..., 4] over the rows of x), or None."""
    if stats is None:
        return None
    got = as_array(stats).shape
    if got != x.lead + (_lib.ROW_STATS,):
        raise shape_error("stats has shape %s, expected %s" % (got, x.lead + (_lib.ROW_STATS,)))
    st, st_t = matrix(stats, x.n, _lib.ROW_STATS, "stats", "f32")
    keep.append(st)
    return st_t


def backward_args(x, n, index, dlogp, dentropy):
    """Views of a log-probs backward's index, dlogp and dentropy over n rows
    of x: (arrays to keep alive, index, dlogp, dentropy, K of dlogp or 0)."""
    keep, idx_t, dlogp_t, dent_t, k = [], None, None, None, 0
    if index is not None:
        kk, shape = index_shape(x, index)
        idx, idx_t = matrix(index, n, kk, "index", "index")
        keep.append(idx)
        if dlogp is not None:
            got = as_array(dlogp).shape
            if got != shape:
                raise shape_error("dlogp has shape %s, expected %s" % (got, shape))
            g, dlogp_t = matrix(dlogp, n, kk, "dlogp", "f32")
            keep.append(g)
            k = kk
    elif dlogp is not None:
        raise _lib.Error("LMLOSS_ERR_NULL_POINTER", "dlogp given without index")
    if dentropy is not None:
        d, dent_t = vector(dentropy, n, x.lead, "dentropy", "f32")
        keep.append(d)
    return keep, idx_t, dlogp_t, dent_t, k


def entropy(logits: ArrayLike, *, temperature: float = 1.0, backend: str = "auto",
            num_threads: int = 0) -> np.ndarray:
    """Entropy (nats) of softmax(logits / temperature) per row of logits
    [..., V] (fp32, fp64 computed in fp32, bf16, fp16): float32 [...]."""
    ctx = _lib.make_context(backend, num_threads)
    x = Rows(logits, "logits")
    ent, ent_t = out_vector(x.n)
    _lib.check(_lib.entropy(ctx, x.t, _lib.make_transform(temperature=temperature), ent_t))
    return ent.reshape(x.lead)
