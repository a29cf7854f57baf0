"""Independent float64 NumPy reference of lmloss, collapse-free.

Every row statistic uses the max-split form: m = max z, a = first argmax,
R = sum_{j != a} exp(z_j - m); log p_a = -log1p(R), 1 - p_a = R / (1 + R),
log p_j = z_j - m - log1p(R) otherwise. Functions return float64 arrays and,
for gradients, a floor array: the magnitude of the constant parts that the
formula subtracts (B_j, in the brief's notation; for the softmax backward
the magnitudes summed into sum(dy) or sum(dy * y)), so a test may allow
1e-5 * floor of cancellation on top of the relative tolerance. Options
are rounded to float32 first, as the C structs hold them.
"""

import numpy as np


def f64(x):
    """float64 copy of x; uint16 arrays are bf16 bit patterns."""
    x = np.asarray(x)
    if x.dtype == np.uint16:
        x = (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float64)


def f32(v):
    """An option value as the C library receives it (a C float)."""
    return float(np.float32(v))


def transform(x, logit_scale=1.0, softcap=0.0, temperature=1.0):
    """z = transform(x) and dz/dx, elementwise."""
    logit_scale, softcap, temperature = f32(logit_scale), f32(softcap), f32(temperature)
    u = f64(x) * logit_scale
    dz = np.full_like(u, logit_scale)
    if softcap > 0:
        with np.errstate(over="ignore"):
            dz = dz / np.cosh(u / softcap) ** 2  # sech^2, no 1 - tanh^2 cancellation
        u = softcap * np.tanh(u / softcap)
    return u / temperature, dz / temperature


def stats(z):
    """Per row: argmax a, log-softmax lp, softmax p, q = 1 - p_a, lse."""
    z = np.atleast_2d(z)
    n = z.shape[0]
    rows = np.arange(n)
    a = np.argmax(z, axis=1)
    m = z[rows, a]
    e = np.exp(z - m[:, None])
    e[rows, a] = 0.0
    r = e.sum(axis=1)
    lse = m + np.log1p(r)
    lp = z - lse[:, None]
    lp[rows, a] = -np.log1p(r)
    p = np.exp(lp)
    p[rows, a] = 1.0 / (1.0 + r)
    return a, lp, p, r / (1.0 + r), lse


def entropy_terms(lp, p):
    """H per row and the terms p_j * lp_j (0 where p_j == 0)."""
    t = np.where(p > 0, p * np.where(np.isfinite(lp), lp, 0.0), 0.0)
    return -t.sum(axis=1), t


def log_softmax(x, temperature=1.0):
    return stats(transform(x, temperature=temperature)[0])[1]


def softmax(x):
    return stats(transform(x)[0])[2]


def entropy(x, temperature=1.0):
    _, lp, p, _, _ = stats(transform(x, temperature=temperature)[0])
    return entropy_terms(lp, p)[0]


def cross_entropy(x, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                  logit_scale=1.0, softcap=0.0, temperature=1.0, token_weight=None,
                  class_weight=None, reduction="mean", num_items=None, dft=False):
    """Returns dict: loss (float or [N]), grad [N, V], floor [N, V] (the
    |B_j| of the gradient, scaled like it), lse, entropy, argmax [N]."""
    z, dzdx = transform(x, logit_scale, softcap, temperature)
    n, v = z.shape
    t = np.asarray(target).astype(np.int64)
    valid = t != ignore_index
    ty = np.where(valid, t, 0)
    rows = np.arange(n)
    c = np.ones(v) if class_weight is None else f64(class_weight)
    w = np.ones(n) if token_weight is None else f64(token_weight)
    e, z_loss = f32(label_smoothing), f32(z_loss)
    a, lp, p, q, lse = stats(z)
    cy, csum = c[ty], c.sum()
    ce = -cy * (1 - e) * lp[rows, ty] - (e / v) * (lp * c).sum(axis=1)
    py = p[rows, ty] if dft else np.ones(n)
    loss = np.where(valid, w * (ce * py + z_loss * lse ** 2), 0.0)

    # d ce / dz_j = p_j A - B_j; at the argmax (A - B_a) - A q.
    big_a = cy * (1 - e) + e * csum / v
    b = (e / v) * np.broadcast_to(c, (n, v)).copy()
    b[rows, ty] += (1 - e) * cy
    g = p * big_a[:, None] - b
    a_minus_b = big_a - b[rows, a]
    g[rows, a] = a_minus_b - big_a * q
    floor = b.copy() if e > 0 else np.zeros((n, v))
    if e > 0:
        floor[rows, a] = np.abs(a_minus_b)
    g = g * py[:, None] + 2 * z_loss * lse[:, None] * p
    scale = np.where(valid, w, 0.0)
    if reduction == "none":
        out = loss
    else:
        total = loss.sum()
        denom = num_items if num_items is not None else (
            cy[valid].sum() if reduction == "mean" else 1.0)
        if num_items is None and reduction == "mean" and denom == 0:
            total, scale, denom = 0.0, np.zeros(n), 1.0
        out, scale = total / denom, scale / denom
    k = (scale * py)[:, None] * dzdx
    ent = entropy_terms(lp, p)[0]
    return dict(loss=out, grad=g * scale[:, None] * dzdx, floor=np.abs(floor * k),
                lse=np.where(valid, lse, 0.0), entropy=np.where(valid, ent, 0.0),
                argmax=np.where(valid, a, -1))


def log_probs_backward(x, index, dlogp=None, dentropy=None, temperature=1.0, mask=None,
                       logit_scale=1.0, softcap=0.0):
    """dlogits [N, V] of sum dlogp * logp + sum dentropy * H, and floor."""
    z, dzdx = transform(x, logit_scale, softcap, temperature)
    n, v = z.shape
    rows = np.arange(n)
    a, lp, p, q, _ = stats(z)
    grad, floor = np.zeros((n, v)), np.zeros((n, v))
    if dlogp is not None:
        idx = np.asarray(index).reshape(n, -1)
        gk = f64(dlogp).reshape(n, -1)
        b = np.zeros((n, v))
        np.add.at(b, (np.repeat(rows, idx.shape[1]), idx.ravel()), gk.ravel())
        big_g = gk.sum(axis=1)
        gr = b - p * big_g[:, None]
        gr[rows, a] = (b[rows, a] - big_g) + big_g * q
        fl = np.abs(b)
        fl[rows, a] = np.abs(big_g - b[rows, a])
        grad, floor = grad + gr, floor + fl
    if dentropy is not None:
        h, terms = entropy_terms(lp, p)
        d = f64(dentropy).reshape(n)
        lpf = np.where(np.isfinite(lp), lp, 0.0)
        gh = -p * (lpf + h[:, None])
        others = terms.copy()
        others[rows, a] = 0.0
        gh[rows, a] = -p[rows, a] * (lpf[rows, a] * q - others.sum(axis=1))
        mag = p * (np.abs(lpf) + h[:, None])
        mag_others = mag.sum(axis=1) - mag[rows, a]
        mag[rows, a] = np.maximum(mag[rows, a], mag_others)
        grad, floor = grad + d[:, None] * gh, floor + np.abs(d)[:, None] * mag
    if mask is not None:
        keep = np.asarray(mask).reshape(n).astype(bool)[:, None]
        grad, floor = np.where(keep, grad, 0.0), np.where(keep, floor, 0.0)
    return grad * dzdx, floor * np.abs(dzdx)


def softmax_backward(y, dy, log=False):
    """dx and floor, with 1 - y_a (softmax) or 1 - exp(y_a) (log) taken as
    the others' sum, as lmloss.h specifies."""
    y, dy = np.atleast_2d(f64(y)), np.atleast_2d(f64(dy))
    n = y.shape[0]
    rows = np.arange(n)
    a = np.argmax(y, axis=1)
    if log:
        e = np.exp(y)
        s = dy.sum(axis=1)
        dx = dy - e * s[:, None]
        q = e.sum(axis=1) - e[rows, a]
        dx[rows, a] = -(s - dy[rows, a]) + q * s
        return dx, np.abs(dy) + e * np.abs(dy).sum(axis=1)[:, None]
    s = (dy * y).sum(axis=1)
    dx = y * (dy - s[:, None])
    q = y.sum(axis=1) - y[rows, a]
    sa = s - dy[rows, a] * y[rows, a]
    dx[rows, a] = y[rows, a] * (dy[rows, a] * q - sa)
    return dx, y * (np.abs(dy) + np.abs(dy * y).sum(axis=1)[:, None])
