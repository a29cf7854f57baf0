"""torch tensors as lmloss_tensor views, contexts and workspaces.

Contract: a tensor becomes an lmloss_tensor through the one array bridge
(lmloss/_dlpack.py, which NumPy's API shares): passed by its data pointer
(no copy) when its last axis is contiguous and its rows are evenly spaced
(row_stride >= cols), as a logits[:, :V] slice is; otherwise it is copied
with .contiguous(). CUDA
tensors are passed with device LMLOSS_CUDA and the context carries
torch.cuda.current_stream(device).cuda_stream, so a call is queued on the
caller's stream and never synchronizes the host. Workspaces come from the
caching allocator (torch.empty(..., dtype=torch.uint8)). A CUDA tensor
meeting a library built without CUDA raises lmloss.Error
(LMLOSS_ERR_UNSUPPORTED) before any call.
"""

import ctypes

import torch

from .. import _dlpack, _lib

CUDA_DEVICE = _dlpack.CUDA_DEVICE
BACKENDS = {"auto": 0, "ref": 1, "cpu": 2, "cuda": 3}


# lmloss_cross_entropy_backward (the NumPy binding has no use for it).
_P = ctypes.POINTER
ce_backward = _lib.lib.lmloss_cross_entropy_backward
ce_backward.restype = ctypes.c_int
ce_backward.argtypes = [_P(_lib.Context), _P(_lib.CEInputs), _P(_lib.CEOptions), _P(_lib.Tensor),
                        _P(_lib.Tensor), ctypes.c_void_p, ctypes.c_size_t]


def backend_code(backend):
    if backend not in BACKENDS:
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION",
                         "backend must be one of %s, got %r" % (sorted(BACKENDS), backend))
    return BACKENDS[backend]


def view(t, keep):
    """lmloss_tensor of a 2-D tensor, or of a 1-D tensor as [N, 1]; an absent
    (zeroed) one for None, as the module docstring says. Tensors the C call
    reads are appended to keep. This runs a few times in every call:
    _dlpack.torch_view reads the tensor's fields without a capsule."""
    if t is None:
        return _lib.Tensor()
    vector = t.dim() == 1
    v = _dlpack.torch_view(t, vector)
    if v is None:
        t = t.contiguous()
        v = _dlpack.torch_view(t, vector)
    keep.append(t)
    return v


def ptr(t):
    """A pointer to lmloss_tensor view of t, or None (NULL) for None."""
    return None if t is None else ctypes.byref(t)


def check_device(t):
    """Raise a clear lmloss.Error for a CUDA tensor when the library has no CUDA backend."""
    if t.is_cuda and not _lib.has_cuda():
        raise _lib.Error("LMLOSS_ERR_UNSUPPORTED",
                         "a CUDA tensor was passed but %s was built without CUDA "
                         "(lmloss.has_cuda() is False); rebuild with -DLMLOSS_CUDA=ON or move the "
                         "tensors to the CPU" % _lib.path)
    if t.device.type not in ("cpu", "cuda"):
        raise _lib.Error("LMLOSS_ERR_BAD_DEVICE", "tensors must be on cpu or cuda, got %s"
                         % t.device)


class context:
    """with context(t, backend, num_threads) as ctx: the lmloss_context for
    tensor t's device: the current CUDA stream of that device (with it made
    current, where it is not) for CUDA tensors. A class, not a generator:
    its cost is host time in every call."""

    __slots__ = ("t", "ctx", "switch")

    def __init__(self, t, backend, num_threads):
        check_device(t)
        self.t, self.ctx, self.switch = t, _lib.context_default(), None
        self.ctx.backend = int(backend)
        self.ctx.num_threads = int(num_threads)

    def __enter__(self):
        t = self.t
        if t.is_cuda:
            if t.device.index != torch.cuda.current_device():
                self.switch = torch.cuda.device(t.device)
                self.switch.__enter__()
            self.ctx.stream = torch.cuda.current_stream(t.device).cuda_stream
        return self.ctx

    def __exit__(self, *exc):
        if self.switch is not None:
            self.switch.__exit__(*exc)


def scale_(t, dloss, backend, num_threads):
    """t *= dloss (a scalar tensor) in place: a gradient a forward formed at
    an upstream of 1, scaled by the upstream that reached its backward.
    lmloss_scale on the stream, which returns at once for an upstream of 1
    (torch's multiply by a 0-d device tensor is a pass over t every time);
    the REF backend, which has no lmloss_scale, multiplies with torch."""
    if backend == BACKENDS["ref"]:
        return t.mul_(dloss.to(t.dtype))
    keep = []
    with context(t, backend, num_threads) as c:
        _lib.check(_lib.scale(c, view(t, keep), view(dloss.reshape(1).to(torch.float32), keep)))
    return t


def workspace(nbytes, device):
    """(tensor, 256-byte aligned address, bytes) from the caching allocator."""
    buf = torch.empty(int(nbytes) + 256, dtype=torch.uint8, device=device)
    addr = buf.data_ptr()
    return buf, addr + (-addr % 256), int(nbytes)


def transform(logit_scale, softcap, temperature):
    return _lib.make_transform(logit_scale, softcap, temperature)
