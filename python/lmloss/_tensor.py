"""NumPy arrays (and host arrays of other libraries) as lmloss_tensor views,
through the one DLPack bridge (_dlpack.py).

Contract of the conversions (the public functions document them too):
- any host array with __dlpack__ (a torch CPU tensor, a JAX array) is read
  as a NumPy view of its memory, without a copy; device arrays are refused
  (LMLOSS_ERR_BAD_DEVICE: lmloss.torch takes CUDA tensors).
- logits-like inputs: float32 passes through; float64 is converted to
  float32 (fp64 inputs are computed in fp32); ml_dtypes.bfloat16 and uint16
  (bf16 bit patterns) are BF16; float16 is F16. int32/int64/bool reach the
  C library under their own codes, which it rejects for logits; any other
  dtype is LMLOSS_ERR_BAD_DTYPE here.
- a [..., V] array is flattened to N rows; a view whose rows are evenly
  spaced with a contiguous last axis (e.g. logits[:, :V] of a wider array)
  is passed via row_stride without a copy, anything else is copied.
- indices: int64 and int32 pass as they are, other integers become int64;
  a uint64 value above 2^63 - 1 is refused (LMLOSS_ERR_INDEX_OUT_OF_RANGE),
  never wrapped.
- float32 vectors (weights, upstream gradients): any real number type is
  converted; strings, objects and complex numbers are refused
  (LMLOSS_ERR_BAD_DTYPE).
- masks: bool or uint8, one byte per row, nonzero = keep.
- byte order: a non-native (e.g. big-endian ">f4") array is converted to
  the native order first; the C library reads native numbers only.
"""

import numpy as np

from . import _dlpack, _lib

try:  # optional: NumPy's bfloat16
    import ml_dtypes
    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bf16 is then uint16 bit patterns only
    _BF16 = None


def native(a):
    """a in the machine's byte order (a converted copy when it is not)."""
    if a.dtype.isnative:
        return a
    return a.astype(a.dtype.newbyteorder("="))


def shape_error(msg):
    return _lib.Error("LMLOSS_ERR_BAD_SHAPE", msg)


def as_array(x):
    """x as a NumPy array: an ndarray as it is; a host array of another
    library (anything with __dlpack__: a torch CPU tensor, a JAX array) as
    a NumPy view of it through DLPack (bfloat16 as ml_dtypes.bfloat16, or
    uint16 bit patterns without ml_dtypes); anything else np.asarray."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__") and not isinstance(x, np.generic):
        a, bf16 = _dlpack.as_numpy(x)
        return a.view(_BF16) if bf16 and _BF16 is not None else a
    return np.asarray(x)


def view(a, vector=False, name="array"):
    """(array, lmloss_tensor) of a NumPy array through the DLPack bridge:
    rows of a [..., C] with a contiguous last axis (vector: every element a
    row of one), a view of a when its rows are evenly spaced, else of a
    contiguous copy. The returned array must outlive the C call."""
    for attempt in (a, None):
        if attempt is None:  # a fresh, aligned, writable, contiguous copy
            a = np.array(a, order="C", copy=True)
        b = a.view(np.uint16) if _BF16 is not None and a.dtype == _BF16 else a
        try:
            arr = _dlpack.from_dlpack(b)
        except (BufferError, TypeError, ValueError) as e:  # e.g. NumPy 1.x and read-only
            if attempt is None:
                raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "%s: dtype %s not supported (%s)"
                                 % (name, a.dtype, e))
            continue
        t = _dlpack.view(arr, vector, name)
        if t is not None:
            return a, t
    raise AssertionError("a contiguous array is always a view")  # pragma: no cover


def absent():
    return _lib.Tensor()


class Rows:
    """A [..., V] input as N rows: .lead (shape without V), .n, .v, .arr
    (the 2-D array the C call reads; keep it alive) and .t (the tensor)."""

    def __init__(self, x, name):
        x = native(as_array(x))
        if x.ndim < 1:
            raise shape_error("%s must have at least one axis, got a scalar" % name)
        if x.dtype == np.float64:
            x = x.astype(np.float32)
        self.dtype = x.dtype
        self.lead, self.v = x.shape[:-1], x.shape[-1]
        self.n = int(np.prod(self.lead, dtype=np.int64))
        self.arr, self.t = view(x, name=name)

    def out_dtype(self):
        """float32 for fp32/fp64 input, else the input's dtype (bf16, fp16)."""
        return np.float32 if self.dtype == np.float32 else self.dtype

    def empty(self, dtype):
        """A new contiguous [N, V] array and its tensor."""
        return view(np.empty((self.n, self.v), dtype=dtype))


def vector(v, n, lead, name, kind):
    """A per-row (or per-class) vector of length n, shaped `lead`, as a
    tensor [n, 1]. kind: "f32" converts to float32, "index" keeps
    int64/int32, "mask" accepts bool/uint8. Returns (array, tensor)."""
    v = as_array(v)
    if v.shape != tuple(lead):
        raise shape_error("%s has shape %s, expected %s" % (name, v.shape, tuple(lead)))
    return view(_convert(v, kind, name), vector=True, name=name)


def optional_vector(v, n, lead, name, kind, keep):
    """vector(), or the absent tensor for v = None; the array goes to keep."""
    if v is None:
        return absent()
    a, t = vector(v, n, lead, name, kind)
    keep.append(a)
    return t


def matrix(m, n, k, name, kind):
    """An [n, k] input (index or dlogp), as (array, tensor)."""
    return view(_convert(as_array(m), kind, name).reshape(n, k), name=name)


_I64_MAX = np.iinfo(np.int64).max


def _convert(v, kind, name="input"):
    v = native(v)
    if kind == "f32":
        if v.dtype.kind not in "biuf":
            raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "%s must hold real numbers (converted to "
                             "float32), got dtype %s" % (name, v.dtype))
        return v.astype(np.float32, copy=False)
    if kind == "index" and v.dtype.kind in "iu" and v.dtype not in (np.int64, np.int32):
        if v.dtype == np.uint64 and v.size and v.max() > _I64_MAX:
            raise _lib.Error("LMLOSS_ERR_INDEX_OUT_OF_RANGE", "%s holds %d, which does not fit "
                             "int64" % (name, v.max()))
        return v.astype(np.int64)
    return v


def out_vector(n, dtype=np.float32):
    """A new [n] output array and its [n, 1] tensor."""
    return view(np.empty(n, dtype=dtype), vector=True)


def out_matrix(n, k, dtype=np.float32):
    """A new [n, k] output array and its tensor."""
    return view(np.empty((n, k), dtype=dtype))


def index_shape(rows, index):
    """K and the result shape for an index of shape lead or lead + (K,)."""
    shape = as_array(index).shape
    if shape == rows.lead:
        return 1, rows.lead
    if len(shape) == len(rows.lead) + 1 and shape[:-1] == rows.lead:
        return shape[-1], shape
    raise shape_error("index has shape %s; expected %s or %s + (K,)" % (shape, rows.lead,
                                                                        rows.lead))
