"""Test helpers: inputs with a given margin, dtype forms, the tolerance, and
the fused head's smallest memory budget (one_row_budget).

Tolerance (written once): |got - ref| <= rtol * |ref| + floor + 1e-5 * B,
rtol = 1e-5 for fp32 outputs, plus the output dtype's unit roundoff for
bf16 (2^-8) and fp16 (2^-11); floor = the output dtype's smallest normal
(FLT_MIN = 2^-126 for fp32 and bf16, 2^-14 for fp16); B = the magnitude of
the constant part a gradient formula subtracts (reference.py), 0 elsewhere.
"""

import ml_dtypes
import numpy as np

import lmloss
import reference

MARGINS = [0, 5, 17, 20, 30, 50, 100, 1000]
VOCABS = [1, 2, 3, 17, 1003, 40001]
FORMS = ["f32", "bf16", "bf16bits", "f16"]
RTOL = {"f32": 1e-5, "bf16": 1e-5 + 2.0 ** -8, "bf16bits": 1e-5 + 2.0 ** -8,
        "f16": 1e-5 + 2.0 ** -11}
FLOOR = {"f32": 2.0 ** -126, "bf16": 2.0 ** -126, "bf16bits": 2.0 ** -126, "f16": 2.0 ** -14}


def as_form(x, form):
    """float array in one of the FORMS (bf16bits: uint16 bf16 patterns)."""
    x = np.asarray(x)
    if form == "f32":
        return x.astype(np.float32)
    if form == "f16":
        return x.astype(np.float16)
    b = x.astype(ml_dtypes.bfloat16)
    return b.view(np.uint16) if form == "bf16bits" else b


def form_of(a):
    if a.dtype == np.uint16:
        return "bf16bits"
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[a.dtype.name]


def peaked(rng, n, v, margin, form="f32", scale=2.0):
    """logits [n, v] in `form` whose target leads the rest by `margin`
    (a tie when 0; the rest are scale * N(0, 1)), and targets [n]."""
    x = rng.standard_normal((n, v)) * scale
    y = rng.integers(0, v, n)
    for i in range(n):
        others = np.delete(x[i], y[i])
        x[i, y[i]] = (others.max() if v > 1 else 0.0) + margin
    return as_form(x, form), y


def check(got, ref, form="f32", bfloor=None, what=""):
    """Assert the tolerance above; NaN must match NaN."""
    got = reference.f64(got)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    tol = RTOL[form] * np.abs(ref) + FLOOR[form]
    if bfloor is not None:
        tol = tol + 1e-5 * bfloor
    err = np.abs(got - ref)
    bad = ~((err <= tol) | (np.isnan(got) & np.isnan(ref)))
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err / tol, 0)), bad.shape) if bad.ndim else ()
        raise AssertionError("%s: %d bad of %d; worst at %s: got %r ref %r tol %r"
                             % (what, bad.sum(), bad.size, i, got[i], ref[i], tol[i]))


def one_row_budget(fn):
    """The smallest memory_budget fn accepts (fn(budget) calls a fused-head
    function): chunks of exactly one row."""
    lo, hi = 1, 1 << 30
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            fn(mid)
            hi = mid
        except lmloss.Error as e:
            assert e.status == "LMLOSS_ERR_WORKSPACE_TOO_SMALL"
            lo = mid + 1
    return lo
