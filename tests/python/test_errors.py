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
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_status(case):
    _, fn, args, kw, status = case
    assert status_of(fn, *args, **kw) == "LMLOSS_ERR_" + status


def test_message_from_c():
    with pytest.raises(lmloss.Error) as e:
        lmloss.cross_entropy(X, [1, 2, 3, 10])
    assert "target" in str(e.value) and "10" in str(e.value)
