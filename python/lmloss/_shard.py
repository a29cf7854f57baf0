"""The row contract over a sharded vocabulary (lmloss.h's experimental
section): ctypes signatures of the state, merge and finish functions, used
by lmloss.torch's vocab-parallel path."""

import ctypes

from . import _lib

_P = ctypes.POINTER
_T, _Ctx, _Tr = _P(_lib.Tensor), _P(_lib.Context), _P(_lib.Transform)
_CEI, _CEO = _P(_lib.CEInputs), _P(_lib.CEOptions)

STATE_COLS = 8  # LMLOSS_ROW_STATE_COLS
# The packed state's columns (lmloss.h, layout version 2).
COL_M, COL_R, COL_A, COL_WY, COL_T, COL_U, COL_C = range(7)


def exchange_columns(label, entropy, smoothing):
    """The columns a finish reads, all an exchange must send: m, r and a;
    w_y for a label; t for entropy; u and c for label smoothing (4 bytes
    each a row). The receiver fills the others: 0, and w_y NaN (no label)."""
    return ((COL_M, COL_R, COL_A) + ((COL_WY,) if label else ()) + ((COL_T,) if entropy else ())
            + ((COL_U, COL_C) if smoothing else ()))


class Shard(ctypes.Structure):
    """lmloss_shard: the shard's first column, the whole vocabulary's width
    and whether the state carries the entropy sum."""
    _fields_ = [("col0", ctypes.c_int64), ("vocab", ctypes.c_int64), ("entropy", ctypes.c_int)]


_lib.register_struct("lmloss_shard", Shard)


def _proto(name, *argtypes):
    fn = getattr(_lib.lib, name)
    fn.restype = ctypes.c_int
    fn.argtypes = list(argtypes)
    return fn


_S = _P(Shard)
ce_state = _proto("lmloss_cross_entropy_state", _Ctx, _CEI, _CEO, _S, _T)
ce_finish = _proto("lmloss_cross_entropy_finish", _Ctx, _CEI, _CEO, _S, _T,
                   _P(_lib.CEOutputs), ctypes.c_void_p, ctypes.c_size_t)
ce_backward_finish = _proto("lmloss_cross_entropy_backward_finish", _Ctx, _CEI, _CEO, _S, _T, _T,
                            _T, ctypes.c_void_p, ctypes.c_size_t)
lp_state = _proto("lmloss_log_probs_state", _Ctx, _T, _T, _T, _Tr, _S, _T)
lp_finish = _proto("lmloss_log_probs_finish", _Ctx, _T, _T, _T, _Tr, _S, _T, _T, _T)
lp_backward_finish = _proto("lmloss_log_probs_backward_finish", _Ctx, _T, _T, _T, _Tr, _S, _T,
                            _T, _T, _T)
softmax_finish = _proto("lmloss_softmax_finish", _Ctx, _T, _S, _T, ctypes.c_int, _T)
merge = _proto("lmloss_row_state_merge", _Ctx, _T, _T, _Tr, _T)
