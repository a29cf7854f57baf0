"""NumPy arrays as lmloss_tensor views.

Contract of the conversions (the public functions document them too):
- logits-like inputs: float32 passes through; float64 is converted to
  float32 (fp64 inputs are computed in fp32); ml_dtypes.bfloat16 and uint16
  (bf16 bit patterns) are BF16; float16 is F16. Any other dtype is handed to
  the C library under its own code, which rejects it (LMLOSS_ERR_BAD_DTYPE).
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

from . import _lib

_BY_NAME = {"float32": _lib.F32, "float64": _lib.F64, "float16": _lib.F16,
            "bfloat16": _lib.BF16, "uint16": _lib.BF16, "int32": _lib.I32, "int64": _lib.I64,
            "bool": _lib.BOOL}


def _code(dtype, name):
    code = _BY_NAME.get(np.dtype(dtype).name)
    if code is None:
        raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "%s: dtype %s not supported" % (name, dtype))
    return code


def native(a):
    """a in the machine's byte order (a converted copy when it is not)."""
    if a.dtype.isnative:
        return a
    return a.astype(a.dtype.newbyteorder("="))


def shape_error(msg):
    return _lib.Error("LMLOSS_ERR_BAD_SHAPE", msg)


def _rows(a, rows, cols):
    """a as a 2-D [rows, cols] array with a contiguous last axis and evenly
    spaced rows (a view when possible) and its row stride in elements."""
    a2 = a.reshape(rows, cols)
    item = a2.itemsize
    s0, s1 = a2.strides
    ok = a2.flags.aligned and a2.dtype.isnative and (s1 == item or cols <= 1)
    dense = max(cols, 1)
    if rows <= 1:
        return (a2, dense) if ok else (np.ascontiguousarray(a2), dense)
    if ok and s0 % item == 0 and s0 >= dense * item:
        return a2, s0 // item
    return np.ascontiguousarray(a2), dense


def tensor(a, code, rows, cols, stride):
    return _lib.Tensor(a.ctypes.data, code, _lib.CPU_DEVICE, rows, cols, stride)


def absent():
    return _lib.Tensor()


class Rows:
    """A [..., V] input as N rows: .lead (shape without V), .n, .v, .arr
    (the 2-D array the C call reads; keep it alive) and .t (the tensor)."""

    def __init__(self, x, name):
        x = native(np.asarray(x))
        if x.ndim < 1:
            raise shape_error("%s must have at least one axis, got a scalar" % name)
        if x.dtype == np.float64:
            x = x.astype(np.float32)
        self.dtype = x.dtype
        self.lead, self.v = x.shape[:-1], x.shape[-1]
        self.n = int(np.prod(self.lead, dtype=np.int64))
        self.arr, stride = _rows(x, self.n, self.v)
        self.t = tensor(self.arr, _code(x.dtype, name), self.n, self.v, stride)

    def out_dtype(self):
        """float32 for fp32/fp64 input, else the input's dtype (bf16, fp16)."""
        return np.float32 if self.dtype == np.float32 else self.dtype

    def empty(self, dtype):
        """A new contiguous [N, V] array and its tensor."""
        out = np.empty((self.n, self.v), dtype=dtype)
        return out, tensor(out, _code(dtype, "output"), self.n, self.v, self.v)


def vector(v, n, lead, name, kind):
    """A per-row (or per-class) vector of length n, shaped `lead`, as a
    tensor [n, 1]. kind: "f32" converts to float32, "index" keeps
    int64/int32, "mask" accepts bool/uint8. Returns (array, tensor)."""
    v = np.asarray(v)
    if v.shape != tuple(lead):
        raise shape_error("%s has shape %s, expected %s" % (name, v.shape, tuple(lead)))
    v = _convert(v, kind, name)
    code = _lib.BOOL if kind == "mask" and v.dtype == np.uint8 else _code(v.dtype, name)
    a, stride = _rows(v, n, 1)
    return a, tensor(a, code, n, 1, stride)


def optional_vector(v, n, lead, name, kind, keep):
    """vector(), or the absent tensor for v = None; the array goes to keep."""
    if v is None:
        return absent()
    a, t = vector(v, n, lead, name, kind)
    keep.append(a)
    return t


def matrix(m, n, k, name, kind):
    """An [n, k] input (index or dlogp), as (array, tensor)."""
    m = _convert(np.asarray(m), kind, name)
    a, stride = _rows(m, n, k)
    return a, tensor(a, _code(m.dtype, name), n, k, stride)


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
    out = np.empty(n, dtype=dtype)
    return out, tensor(out, _code(dtype, "output"), n, 1, 1)


def index_shape(rows, index):
    """K and the result shape for an index of shape lead or lead + (K,)."""
    shape = np.shape(index)
    if shape == rows.lead:
        return 1, rows.lead
    if len(shape) == len(rows.lead) + 1 and shape[:-1] == rows.lead:
        return shape[-1], shape
    raise shape_error("index has shape %s; expected %s or %s + (K,)" % (shape, rows.lead,
                                                                        rows.lead))
