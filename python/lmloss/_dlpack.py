"""The one array bridge: any array as an lmloss_tensor view, through DLPack.

NumPy arrays, torch tensors, JAX and CuPy arrays, and anything else that
has ``__dlpack__`` and ``__dlpack_device__`` (the Python array API's DLPack
protocol, https://dmlc.github.io/dlpack/latest/python_spec.html) become an
:class:`Array`: data pointer, DLPack dtype and device, shape and strides in
elements, and the object that keeps the memory alive. :func:`view` turns
one into an lmloss_tensor of rows x cols, or says that it needs a copy
first. Both lmloss's NumPy API (_tensor.py) and lmloss.torch (_bridge.py)
convert through here; each only makes the copies and new arrays in its own
library.

DLPack in brief: ``obj.__dlpack_device__()`` -> (device type, id);
``obj.__dlpack__(max_version=(1, 0), stream=...)`` -> a PyCapsule named
"dltensor_versioned" (DLManagedTensorVersioned, DLPack >= 1.0) or
"dltensor" (DLManagedTensor, older producers) whose DLTensor holds data,
device, ndim, dtype (code, bits, lanes), shape, strides (in elements; NULL
for a compact row-major tensor) and byte_offset. The capsule is read and
kept, never consumed (not renamed "used_dltensor"), so its own destructor
calls the producer's deleter when the last view goes: the memory lives as
long as the capsule, which the callers keep beside the C call.

Dtypes (code, bits): float 32/16/64 -> F32/F16/F64, bfloat 16 -> BF16,
int 32/64 -> I32/I64, bool 8 -> BOOL, uint 8 -> BOOL (a mask byte), uint 16
-> BF16 (lmloss's bf16 bit patterns); lanes must be 1. Any other dtype
gives LMLOSS_ERR_BAD_DTYPE. Devices: CPU and CUDA-pinned host memory are
LMLOSS_CPU, CUDA and CUDA-managed memory LMLOSS_CUDA; others give
LMLOSS_ERR_BAD_DEVICE. Byte order: DLPack's numbers are native by
definition (NumPy refuses to export a non-native array; _tensor.py
converts one first).

torch tensors: their fields are read from the tensor (data_ptr, dtype,
shape, stride), which are exactly what ``torch.utils.dlpack.to_dlpack``
exports (a test holds the two equal for every dtype and layout), because
the capsule costs about 5 us a tensor more and an op call converts four to
seven tensors; a torch dtype outside the table goes through DLPack.
"""

import ctypes
import struct
import sys

from . import _lib

# DLDeviceType and DLDataTypeCode (dlpack.h)
K_DL_CPU, K_DL_CUDA, K_DL_CUDA_HOST, K_DL_CUDA_MANAGED = 1, 2, 3, 13
K_DL_INT, K_DL_UINT, K_DL_FLOAT, K_DL_BFLOAT, K_DL_BOOL = 0, 1, 2, 4, 6
DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
                9: "vpi", 10: "rocm", 11: "rocm_host", 12: "ext_dev", 13: "cuda_managed",
                14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia"}

DTYPES = {(K_DL_FLOAT, 32): _lib.F32, (K_DL_BFLOAT, 16): _lib.BF16, (K_DL_FLOAT, 16): _lib.F16,
          (K_DL_FLOAT, 64): _lib.F64, (K_DL_INT, 32): _lib.I32, (K_DL_INT, 64): _lib.I64,
          (K_DL_BOOL, 8): _lib.BOOL, (K_DL_UINT, 8): _lib.BOOL, (K_DL_UINT, 16): _lib.BF16}
CUDA_DEVICE = 1  # LMLOSS_CUDA
DEVICES = {K_DL_CPU: _lib.CPU_DEVICE, K_DL_CUDA_HOST: _lib.CPU_DEVICE, K_DL_CUDA: CUDA_DEVICE,
           K_DL_CUDA_MANAGED: CUDA_DEVICE}
ITEMSIZE = {_lib.F32: 4, _lib.BF16: 2, _lib.F16: 2, _lib.F64: 8, _lib.I32: 4, _lib.I64: 8,
            _lib.BOOL: 1}

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]
_string_at = ctypes.string_at
# DLTensor: data, device {type, id}, ndim, dtype {code, bits, lanes}, shape,
# strides, byte_offset (native alignment: 48 bytes on LP64)
_DLTENSOR = struct.Struct("@PiiiBBHPPQ")
# DLManagedTensorVersioned's head: version {major, minor}, manager_ctx,
# deleter, flags; its DLTensor follows.
_VERSIONED = struct.Struct("@IIPPQ")
READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY


class Array:
    """An array as DLPack describes it: data (address of element 0), code,
    bits, lanes (DLDataType), device_type, device_id, shape and strides (in
    elements) as tuples, read_only, and owner (what keeps the memory alive:
    the capsule or the torch tensor)."""

    __slots__ = ("data", "code", "bits", "lanes", "device_type", "device_id", "shape",
                 "strides", "read_only", "owner")

    def __init__(self, data, code, bits, lanes, device_type, device_id, shape, strides,
                 read_only, owner):
        self.data, self.code, self.bits, self.lanes = data, code, bits, lanes
        self.device_type, self.device_id = device_type, device_id
        self.shape, self.strides, self.read_only, self.owner = shape, strides, read_only, owner

    def lmloss_dtype(self, name="array"):
        """The lmloss dtype code, or Error(LMLOSS_ERR_BAD_DTYPE)."""
        code = DTYPES.get((self.code, self.bits)) if self.lanes == 1 else None
        if code is None:
            raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "%s: DLPack dtype (code %d, %d bits, %d "
                             "lanes) is not one lmloss takes" % (name, self.code, self.bits,
                                                                 self.lanes))
        return code

    def lmloss_device(self, name="array"):
        """LMLOSS_CPU or LMLOSS_CUDA, or Error(LMLOSS_ERR_BAD_DEVICE)."""
        dev = DEVICES.get(self.device_type)
        if dev is None:
            raise _lib.Error("LMLOSS_ERR_BAD_DEVICE", "%s is on DLPack device %s, not the CPU "
                             "or CUDA" % (name, DEVICE_NAMES.get(self.device_type,
                                                                 self.device_type)))
        return dev


def _compact_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def parse_capsule(capsule):
    """An Array of a DLPack capsule ("dltensor_versioned" or "dltensor"),
    holding the capsule (not consumed: its destructor frees the tensor)."""
    name = _get_name(capsule)
    if name == b"dltensor_versioned":
        p = _get_pointer(capsule, name)
        major, _minor, _ctx, _deleter, flags = _VERSIONED.unpack(_string_at(p, _VERSIONED.size))
        if major != 1:
            raise _lib.Error("LMLOSS_ERR_UNSUPPORTED", "DLPack major version %d: lmloss reads "
                             "version 1" % major)
        p += _VERSIONED.size
    elif name == b"dltensor":
        p, flags = _get_pointer(capsule, name), 0
    else:
        raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "not a fresh DLPack capsule: %r" % (name,))
    data, dev, dev_id, nd, code, bits, lanes, shp, strp, off = \
        _DLTENSOR.unpack(_string_at(p, _DLTENSOR.size))
    fmt = "@%dq" % nd
    shape = struct.unpack(fmt, _string_at(shp, 8 * nd)) if nd else ()
    strides = struct.unpack(fmt, _string_at(strp, 8 * nd)) if strp and nd else \
        _compact_strides(shape)
    return Array((data or 0) + off, code, bits, lanes, dev, dev_id, shape, strides,
                 bool(flags & READ_ONLY), capsule)


def from_dlpack(obj, stream=None):
    """An Array of any object with __dlpack__ / __dlpack_device__. stream:
    for a CUDA producer, the consumer's stream (DLPack's stream argument:
    the producer orders its work before it); None otherwise."""
    dev = obj.__dlpack_device__()
    kw = {"stream": stream} if stream is not None and int(dev[0]) in (K_DL_CUDA,
                                                                       K_DL_CUDA_MANAGED) else {}
    try:
        capsule = obj.__dlpack__(max_version=(1, 0), **kw)
    except TypeError:  # a producer from before DLPack 1.0's max_version
        capsule = obj.__dlpack__(**kw)
    return parse_capsule(capsule)


def from_torch(t):
    """An Array of a torch tensor through torch's own DLPack export (the
    reference torch_view's fast path is held equal to)."""
    if t.device.type == "meta":
        raise _lib.Error("LMLOSS_ERR_BAD_DEVICE", "a meta tensor has no data: lmloss needs "
                         "tensors on the CPU or CUDA")
    import torch.utils.dlpack
    return parse_capsule(torch.utils.dlpack.to_dlpack(t.detach()))


def from_any(obj, stream=None):
    """An Array of a torch tensor (from_torch) or any DLPack producer."""
    if _is_torch(obj):
        return from_torch(obj)
    if not hasattr(obj, "__dlpack__"):
        raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "%s has no __dlpack__: not an array lmloss "
                         "can read" % type(obj).__name__)
    return from_dlpack(obj, stream)


def _is_torch(obj):
    torch = sys.modules.get("torch")  # never imported here: no torch, no torch tensor
    return torch is not None and isinstance(obj, torch.Tensor)


def rows_of(shape, strides, vector):
    """(rows, cols, row_stride) of an array of this shape and these strides
    (in elements) read as rows: [..., C] with a contiguous last axis
    (vector=False), or every element a row of one (vector=True); the
    leading axes must collapse into one evenly spaced axis with row_stride
    >= cols. None when they do not: copy first."""
    nd = len(shape)
    if vector:
        if nd == 1:  # the common cases first: one call converts several tensors
            rows, stride, cols = shape[0], strides[0], 1
            if rows <= 1:
                return rows, 1, 1
            return (rows, 1, stride) if stride >= 1 else None
        lead, lstr, cols = shape, strides, 1
    else:
        if nd == 2:
            rows, cols = shape
            s0, s1 = strides
            dense = cols if cols > 1 else 1
            if cols > 1 and s1 != 1 and rows:
                return None
            if rows <= 1 or cols == 0:
                return rows, cols, dense
            return (rows, cols, s0) if s0 >= dense else None
        if not nd:
            return None
        lead, lstr, cols = shape[:-1], strides[:-1], shape[-1]
        if cols > 1 and strides[-1] != 1 and 0 not in shape:
            return None
    dense = max(cols, 1)
    if 0 in shape:  # nothing to read: any layout is dense
        rows = 1
        for n in lead:
            rows *= n
        return rows, cols, dense
    rows, stride, inner = 1, None, None
    for n, s in zip(reversed(lead), reversed(lstr)):
        rows *= n
        if n == 1:
            continue
        if stride is None:
            stride = s
        elif s != inner:
            return None
        inner = s * n
    if rows <= 1 or stride is None:
        return rows, cols, dense
    if stride < dense:  # the C library's row_stride >= cols (no overlap, no broadcast)
        return None
    return rows, cols, stride


def tensor(data, code, device, shape, strides, vector=False):
    """The lmloss_tensor of an array with an lmloss dtype code and device
    (Array.lmloss_dtype/lmloss_device), shape and strides in elements, read
    as rows (rows_of); None when it needs a contiguous copy first (rows
    that do not collapse, an element misaligned)."""
    if data % ITEMSIZE[code]:
        return None
    rcs = rows_of(shape, strides, vector)
    if rcs is None:
        return None
    return _lib.Tensor(data, code, device, *rcs)


def view(a, vector=False, name="array"):
    """tensor() of an Array; raises Error for a dtype or device lmloss does
    not take."""
    return tensor(a.data, a.lmloss_dtype(name), a.lmloss_device(name), a.shape, a.strides,
                  vector)


_TORCH = None  # {torch dtype: lmloss dtype code}, through DLPack's codes


def _torch_codes():
    global _TORCH
    import torch
    dl = {torch.float32: (K_DL_FLOAT, 32), torch.bfloat16: (K_DL_BFLOAT, 16),
          torch.float16: (K_DL_FLOAT, 16), torch.float64: (K_DL_FLOAT, 64),
          torch.int32: (K_DL_INT, 32), torch.int64: (K_DL_INT, 64),
          torch.bool: (K_DL_BOOL, 8), torch.uint8: (K_DL_UINT, 8)}
    _TORCH = {t: DTYPES[k] for t, k in dl.items()}
    return _TORCH


def torch_view(t, vector=False):
    """view() of a torch tensor, from the fields torch's DLPack export holds,
    read from the tensor (module docstring); a dtype outside the table, or a
    device other than the CPU and CUDA, through DLPack itself."""
    code = (_TORCH or _torch_codes()).get(t.dtype)
    if not (t.is_cuda or t.is_cpu):
        raise _lib.Error("LMLOSS_ERR_BAD_DEVICE", "tensors must be on the CPU or CUDA, got %s%s"
                         % (t.device, " (a meta tensor has no data)" if t.is_meta else ""))
    if code is None:
        return view(from_torch(t), vector, "tensor")
    return tensor(t.data_ptr(), code, CUDA_DEVICE if t.is_cuda else _lib.CPU_DEVICE,
                  t.shape, t.stride(), vector)


_TYPESTR = {(K_DL_FLOAT, 16): "f2", (K_DL_FLOAT, 32): "f4", (K_DL_FLOAT, 64): "f8",
            (K_DL_INT, 8): "i1", (K_DL_INT, 16): "i2", (K_DL_INT, 32): "i4",
            (K_DL_INT, 64): "i8", (K_DL_UINT, 8): "u1", (K_DL_UINT, 16): "u2",
            (K_DL_UINT, 32): "u4", (K_DL_UINT, 64): "u8", (K_DL_BOOL, 8): "b1",
            (K_DL_BFLOAT, 16): "u2"}


class _Interface:
    """A host Array exposed as __array_interface__, so that NumPy makes a view
    whose base is this object, which holds the capsule."""

    def __init__(self, a, typestr):
        item = a.bits // 8
        self.owner = a.owner
        self.__array_interface__ = {
            "version": 3, "shape": a.shape, "typestr": "=" + typestr,
            "data": (a.data, a.read_only),
            "strides": tuple(s * item for s in a.strides) if a.shape else None}


def as_numpy(obj):
    """A NumPy view of a host DLPack producer (a torch CPU tensor, a JAX CPU
    array, ...), without a copy: (array, is_bf16). bfloat16 comes back as
    uint16 bit patterns (NumPy has no bf16 of its own)."""
    import numpy as np

    def host_only(device_type):
        if device_type not in (K_DL_CPU, K_DL_CUDA_HOST):
            raise _lib.Error("LMLOSS_ERR_BAD_DEVICE", "lmloss's NumPy API reads host memory; "
                             "this array is on %s (use lmloss.torch for device tensors)"
                             % DEVICE_NAMES.get(device_type, device_type))

    if not _is_torch(obj):  # asked before the export, as DLPack's consumers do
        host_only(int(obj.__dlpack_device__()[0]))
    a = from_any(obj)
    host_only(a.device_type)
    typestr = _TYPESTR.get((a.code, a.bits)) if a.lanes == 1 else None
    if typestr is None:
        raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "DLPack dtype (code %d, %d bits, %d lanes) is "
                         "not one lmloss takes" % (a.code, a.bits, a.lanes))
    return np.asarray(_Interface(a, typestr)), a.code == K_DL_BFLOAT
