"""The one array bridge (lmloss/_dlpack.py): NumPy arrays, torch tensors and
any object with __dlpack__ / __dlpack_device__ as lmloss_tensor views; the
ctypes mirrors' size/version handshake with the library (_lib.check_abi)."""

import ctypes
import gc
import weakref

import ml_dtypes
import numpy as np
import pytest

import lmloss
from lmloss import _dlpack, _lib


class StandIn:
    """An array of another library, as lmloss sees it: nothing but the DLPack
    protocol, over a NumPy array's memory. versioned=False plays a producer
    from before DLPack 1.0 (no max_version keyword); device overrides what
    __dlpack_device__ reports."""

    def __init__(self, a, versioned=True, device=None):
        self._a, self._versioned, self._device = a, versioned, device

    def __dlpack_device__(self):
        return self._device or self._a.__dlpack_device__()

    def __dlpack__(self, **kw):
        if not self._versioned and "max_version" in kw:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        kw.pop("stream", None)
        return self._a.__dlpack__(**kw)


def fields(t):
    return (t.data, t.dtype, t.device, t.rows, t.cols, t.row_stride)


def test_rows_of():
    r = _dlpack.rows_of
    assert r((4, 10), (10, 1), False) == (4, 10, 10)
    assert r((4, 7), (10, 1), False) == (4, 7, 10)  # x[:, :7] of a [4, 10]: no copy
    assert r((2, 3, 7), (30, 10, 1), False) == (6, 7, 10)  # leading axes collapse
    assert r((2, 3, 7), (40, 10, 1), False) is None  # they do not
    assert r((4, 7), (1, 4), False) is None  # a transposed array
    assert r((4, 7), (14, 2), False) is None  # a strided last axis
    assert r((4, 7), (0, 1), False) is None  # broadcast rows overlap
    assert r((1, 7), (99, 1), False) == (1, 7, 7) and r((0, 7), (0, 3), False) == (0, 7, 7)
    assert r((5,), (3,), True) == (5, 1, 3) and r((5,), (0,), True) is None
    assert r((2, 3), (3, 1), True) == (6, 1, 1) and r((2, 3), (1, 2), True) is None
    assert r((3, 1), (8, 1), False) == (3, 1, 8) and r((7,), (1,), False) == (1, 7, 7)


def test_numpy_arrays_go_through_dlpack():
    x = np.arange(40, dtype=np.float32).reshape(4, 10)
    a = _dlpack.from_dlpack(x)
    assert (a.code, a.bits, a.lanes, a.device_type) == (_dlpack.K_DL_FLOAT, 32, 1,
                                                        _dlpack.K_DL_CPU)
    t = _dlpack.view(_dlpack.from_dlpack(x[:, :7]))
    assert fields(t) == (x.ctypes.data, _lib.F32, _lib.CPU_DEVICE, 4, 7, 10)
    ro = np.broadcast_to(x[0], (3, 10))  # read-only, and rows that overlap: copied
    assert _dlpack.from_dlpack(ro).read_only
    assert np.array_equal(lmloss.softmax(ro), lmloss.softmax(np.ascontiguousarray(ro)))
    buf = np.zeros(41, np.uint8)[1:].view(np.float32).reshape(2, 5)  # misaligned: copied
    buf[:] = x[:2, :5]
    assert not buf.flags.aligned
    assert np.array_equal(lmloss.softmax(buf), lmloss.softmax(x[:2, :5]))
    codes = {np.float32: _lib.F32, np.float16: _lib.F16, np.float64: _lib.F64,
             np.int32: _lib.I32, np.int64: _lib.I64, np.bool_: _lib.BOOL, np.uint8: _lib.BOOL,
             np.uint16: _lib.BF16}
    for dt, code in codes.items():
        assert _dlpack.from_dlpack(np.zeros(3, dt)).lmloss_dtype() == code
    with pytest.raises(lmloss.Error) as e:
        _dlpack.from_dlpack(np.zeros(3, np.int8)).lmloss_dtype("x")
    assert e.value.status == "LMLOSS_ERR_BAD_DTYPE"


@pytest.mark.parametrize("versioned", [True, False])
def test_stand_in_producer(versioned):
    """Any __dlpack__ producer works in the NumPy API, without a copy where
    its rows are evenly spaced, and gives what the NumPy array gives."""
    rng = np.random.default_rng(0)
    wide = rng.standard_normal((6, 40)).astype(np.float32)
    y = rng.integers(0, 31, 6)
    for x in (wide, wide[:, :31], wide[::2, 1:30], wide[:, ::2]):
        yy = y[:x.shape[0]] % x.shape[1]
        s = StandIn(x, versioned)
        assert lmloss.cross_entropy(s, StandIn(yy, versioned)) == lmloss.cross_entropy(x, yy)
        assert np.array_equal(lmloss.log_softmax(s), lmloss.log_softmax(x))
        lp, ent = lmloss.log_probs(s, StandIn(yy), entropy=True)
        assert np.array_equal(lp, lmloss.log_probs(x, yy)) and ent.shape == yy.shape
    loss, dx = lmloss.cross_entropy(StandIn(wide), y, grad=True,
                                    token_weight=StandIn(np.ones(6, np.float64)))
    assert np.array_equal(dx, lmloss.cross_entropy(wide, y, grad=True)[1])


def test_stand_in_bad_device_and_dtype():
    x = np.zeros((2, 5), np.float32)
    with pytest.raises(lmloss.Error, match="lmloss.torch") as e:
        lmloss.softmax(StandIn(x, device=(_dlpack.K_DL_CUDA, 0)))
    assert e.value.status == "LMLOSS_ERR_BAD_DEVICE"
    with pytest.raises(lmloss.Error) as e:
        lmloss.softmax(StandIn(x, device=(10, 0)))  # ROCm
    assert e.value.status == "LMLOSS_ERR_BAD_DEVICE"
    with pytest.raises(lmloss.Error) as e:
        lmloss.softmax(StandIn(x.astype(np.int8)))
    assert e.value.status == "LMLOSS_ERR_BAD_DTYPE"


def test_capsule_keeps_memory_alive_then_frees_it():
    """The capsule is read, never consumed: it holds the producer's memory
    while lmloss reads it and frees it (the producer's deleter) after."""
    x = np.random.default_rng(1).standard_normal((3, 9)).astype(np.float32)
    ref = weakref.ref(x)
    s = StandIn(x)
    want = lmloss.softmax(x.copy())
    del x
    got = lmloss.softmax(s)
    assert np.array_equal(got, want)
    arr, _ = _dlpack.as_numpy(s)
    del s
    gc.collect()
    assert ref() is not None  # arr's base holds the capsule, which holds x
    assert np.array_equal(lmloss.softmax(arr), want)
    del arr
    gc.collect()
    assert ref() is None


def test_bf16_through_dlpack():
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 33).bfloat16()
    bits = x.view(torch.int16).numpy().view(np.uint16)
    got = lmloss.softmax(x)  # a torch CPU tensor in the NumPy API
    assert got.dtype == ml_dtypes.bfloat16
    assert np.array_equal(got.view(np.uint16), lmloss.softmax(bits))
    a = _dlpack.from_torch(x)
    assert (a.code, a.bits) == (_dlpack.K_DL_BFLOAT, 16) and a.lmloss_dtype() == _lib.BF16


def test_torch_fast_path_equals_dlpack():
    """lmloss.torch reads a tensor's fields directly (the capsule costs more
    host time a call): the view is field for field torch's DLPack export."""
    torch = pytest.importorskip("torch")
    base = torch.arange(240, dtype=torch.float32).reshape(12, 20)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32,
              torch.int64, torch.bool, torch.uint8]
    for dt in dtypes:
        b = base.to(dt)
        for t, vector in ((b, False), (b[:, :7], False), (b[2:9, 3:11], False), (b[:, 3], True),
                          (b[::3], False), (b.t(), False), (b[:, ::2], False),
                          (b.reshape(-1)[:5], True), (b[:1, :0], False)):
            fast = _dlpack.torch_view(t, vector)
            slow = _dlpack.view(_dlpack.from_torch(t), vector)
            assert (fast is None) == (slow is None), (dt, t.shape, t.stride())
            if fast is not None:
                assert fields(fast) == fields(slow), (dt, t.shape, t.stride())
    with pytest.raises(lmloss.Error) as e:
        _dlpack.torch_view(base.to(torch.int16))
    assert e.value.status == "LMLOSS_ERR_BAD_DTYPE"
    with pytest.raises(lmloss.Error, match="meta") as e:
        _dlpack.torch_view(base.to("meta"))
    assert e.value.status == "LMLOSS_ERR_BAD_DEVICE"


def test_struct_size_handshake():
    """_lib.check_abi: the mirrors against lmloss_struct_size (where the
    library has it) and the library's version against the package's."""
    sizes = {n.encode(): ctypes.sizeof(c) for n, c in _lib.STRUCTS.items()}
    assert _lib.struct_mismatches(sizes.get) == []
    wrong = dict(sizes)
    wrong[b"lmloss_ce_options"] = 48
    assert _lib.struct_mismatches(wrong.get) == [("lmloss_ce_options", 56, 48)]
    assert ("lmloss_head", 120, 0) in _lib.struct_mismatches(lambda n: sizes.get(n, 0) if
                                                             n != b"lmloss_head" else 0)

    class Stub:
        pass

    stub = Stub()
    stub.lmloss_struct_size = lambda name: wrong.get(name, 0)
    with pytest.raises(ImportError, match="lmloss_ce_options is 56 bytes here, 48 there"):
        _lib.check_abi(lmloss.__version__, stub)
    stub.lmloss_struct_size = lambda name: sizes.get(name, 0)
    assert _lib.check_abi(lmloss.__version__, stub) is True
    assert _lib.check_abi(lmloss.__version__, Stub()) is False  # a library without it
    with pytest.raises(ImportError, match="ABIs"):
        _lib.check_abi("0.99.0")
    assert lmloss.ABI_CHECKED == hasattr(_lib.lib, "lmloss_struct_size")
