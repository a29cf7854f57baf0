"""Bad input raises lmloss.Error with the C status name and message."""

import numpy as np
import pytest

import lmloss

X = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
Y = np.array([1, 2, 3, 4])


def status_of(fn, *args, **kw):
    with pytest.raises(lmloss.Error) as e:
        fn(*args, **kw)
    assert isinstance(e.value, ValueError) and e.value.status in str(e.value)
    assert len(e.value.message) > 0
    return e.value.status


CASES = [
    ("target out of range", lmloss.cross_entropy, (X, [1, 2, 3, 10]), {}, "INDEX_OUT_OF_RANGE"),
    ("negative target", lmloss.cross_entropy, (X, [1, -1, 3, 4]), {}, "INDEX_OUT_OF_RANGE"),
    ("index out of range", lmloss.log_probs, (X, [0, 1, 2, 11]), {}, "INDEX_OUT_OF_RANGE"),
    ("K > V", lmloss.log_probs, (X, np.zeros((4, 11), np.int64)), {}, "BAD_SHAPE"),
    ("temperature 0", lmloss.cross_entropy, (X, Y), dict(temperature=0.0), "BAD_OPTION"),
    ("temperature nan", lmloss.log_probs, (X, Y), dict(temperature=float("nan")), "BAD_OPTION"),
    ("entropy temperature", lmloss.entropy, (X,), dict(temperature=-1.0), "BAD_OPTION"),
    ("softcap < 0", lmloss.cross_entropy, (X, Y), dict(softcap=-1.0), "BAD_OPTION"),
    ("logit_scale 0", lmloss.cross_entropy, (X, Y), dict(logit_scale=0.0), "BAD_OPTION"),
    ("label_smoothing", lmloss.cross_entropy, (X, Y), dict(label_smoothing=1.5), "BAD_OPTION"),
    ("z_loss", lmloss.cross_entropy, (X, Y), dict(z_loss=-1.0), "BAD_OPTION"),
    ("num_items 0", lmloss.cross_entropy, (X, Y), dict(num_items=0), "BAD_OPTION"),
    ("num_items none", lmloss.cross_entropy, (X, Y), dict(num_items=3, reduction="none"),
     "BAD_OPTION"),
    ("reduction", lmloss.cross_entropy, (X, Y), dict(reduction="avg"), "BAD_OPTION"),
    ("backend", lmloss.softmax, (X,), dict(backend="gpu"), "BAD_OPTION"),
    ("num_threads", lmloss.softmax, (X,), dict(num_threads=-1), "BAD_OPTION"),
    ("int logits", lmloss.cross_entropy, (X.astype(np.int32), Y), {}, "BAD_DTYPE"),
    ("int8 logits", lmloss.softmax, (X.astype(np.int8),), {}, "BAD_DTYPE"),
    ("float target", lmloss.cross_entropy, (X, Y.astype(np.float32)), {}, "BAD_DTYPE"),
    ("float index", lmloss.log_probs, (X, Y.astype(np.float64)), {}, "BAD_DTYPE"),
    ("int mask", lmloss.log_probs, (X, Y), dict(mask=np.ones(4, np.int32)), "BAD_DTYPE"),
    ("target shape", lmloss.cross_entropy, (X, Y[:3]), {}, "BAD_SHAPE"),
    ("weight shape", lmloss.cross_entropy, (X, Y), dict(weight=np.ones(4)), "BAD_SHAPE"),
    ("token_weight shape", lmloss.cross_entropy, (X, Y), dict(token_weight=np.ones(3)),
     "BAD_SHAPE"),
    ("class_weight shape", lmloss.cross_entropy, (X, Y), dict(class_weight=np.ones(9)),
     "BAD_SHAPE"),
    ("empty vocab", lmloss.softmax, (np.zeros((2, 0), np.float32),), {}, "BAD_SHAPE"),
    ("scalar logits", lmloss.softmax, (np.float32(1),), {}, "BAD_SHAPE"),
    ("dy shape", lmloss.softmax_backward, (X, X[:, :5]), {}, "BAD_SHAPE"),
    ("dlogp shape", lmloss.log_probs_backward, (X, Y, np.ones(3)), {}, "BAD_SHAPE"),
    ("no upstream", lmloss.log_probs_backward, (X, Y, None), {}, "NULL_POINTER"),
    ("uint64 target over int64", lmloss.cross_entropy,
     (X, np.array([1, 2, 3, 2 ** 64 - 100], np.uint64)), {}, "INDEX_OUT_OF_RANGE"),
    ("uint64 index over int64", lmloss.log_probs,
     (X, np.array([1, 2, 3, 2 ** 63], np.uint64)), {}, "INDEX_OUT_OF_RANGE"),
    ("ignore_index 2^63", lmloss.cross_entropy, (X, Y), dict(ignore_index=2 ** 63),
     "BAD_OPTION"),
    ("ignore_index float", lmloss.cross_entropy, (X, Y), dict(ignore_index=1.5), "BAD_OPTION"),
    ("num_threads 2^32", lmloss.softmax, (X,), dict(num_threads=2 ** 32 + 1), "BAD_OPTION"),
    ("string weight", lmloss.cross_entropy, (X, Y), dict(token_weight=["a", "b", "c", "d"]),
     "BAD_DTYPE"),
    ("object class weight", lmloss.cross_entropy, (X, Y), dict(weight=[None] * 10),
     "BAD_DTYPE"),
    ("complex dlogp", lmloss.log_probs_backward, (X, Y, np.ones(4, np.complex64)), {},
     "BAD_DTYPE"),
    ("string option", lmloss.cross_entropy, (X, Y), dict(label_smoothing="0.1x"), "BAD_OPTION"),
    ("string temperature", lmloss.log_probs, (X, Y), dict(temperature="hot"), "BAD_OPTION"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_status(case):
    _, fn, args, kw, status = case
    assert status_of(fn, *args, **kw) == "LMLOSS_ERR_" + status


def test_message_from_c():
    with pytest.raises(lmloss.Error) as e:
        lmloss.cross_entropy(X, [1, 2, 3, 10])
    assert "target" in str(e.value) and "10" in str(e.value)


def test_non_native_byte_order_is_converted():
    """Big-endian (non-native) arrays are converted, never read as native
    numbers: issue 35's cross_entropy(x.astype(">f4"), y) gave 1.0986
    instead of 0.4076, and softmax negative values."""
    import ml_dtypes
    swapped = ">" if np.little_endian else "<"
    one = np.array([[1.0, 2.0, 3.0]], swapped + "f4")
    assert abs(lmloss.cross_entropy(one, [2]) - 0.4076) < 1e-4
    x = np.array([[2.0, 0.5, -1.0], [0.1, 0.2, 3.0]], np.float32)
    y = np.array([0, 2])
    want = lmloss.cross_entropy(x, y)
    for dt in ("f4", "f8", "f2"):
        got = lmloss.cross_entropy(x.astype(swapped + dt), y.astype(swapped + "i8"))
        assert abs(got - want) <= (1e-3 if dt == "f2" else 1e-6), dt
        p = lmloss.softmax(x.astype(swapped + dt))
        assert (p >= 0).all() and np.allclose(p.astype(np.float64).sum(1), 1, atol=1e-3)
    bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    got = lmloss.softmax(bits.astype(swapped + "u2"))
    assert got.dtype == np.uint16 and np.array_equal(got, lmloss.softmax(bits))
    for fn, args in ((lmloss.log_probs, (x.astype(swapped + "f4"), y.astype(swapped + "i4"))),
                     (lmloss.entropy, (x.astype(swapped + "f4"),))):
        assert np.array_equal(fn(*args), fn(x, *([y] if len(args) > 1 else [])))
    tw = np.array([0.5, 2.0], swapped + "f4")
    assert (lmloss.cross_entropy(x, y, token_weight=tw)
            == lmloss.cross_entropy(x, y, token_weight=tw.astype(np.float32)))
    mask = np.array([True, False])
    assert np.array_equal(lmloss.log_probs(x, y, mask=mask), lmloss.log_probs(x, y, mask=mask))


def test_wide_integers_are_refused_not_wrapped():
    """A uint64 target above int64 (2^64 - 100 wrapped to -100: an ignored
    row) and ignore_index=2**63 are refused."""
    y = np.array([1, 2, 3, 2 ** 64 - 100], np.uint64)
    with pytest.raises(lmloss.Error, match="int64"):
        lmloss.cross_entropy(X, y, reduction="none")
    assert np.array_equal(lmloss.cross_entropy(X, Y.astype(np.uint64), reduction="none"),
                          lmloss.cross_entropy(X, Y, reduction="none"))
    with pytest.raises(lmloss.Error, match="int64"):
        lmloss.cross_entropy(X, Y, ignore_index=2 ** 63)
    assert lmloss.cross_entropy(X, Y, ignore_index=np.int64(-(2 ** 63))) > 0
