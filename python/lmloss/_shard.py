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
softmax_backward_partials = _proto("lmloss_softmax_backward_partials", _Ctx, _T, _T, ctypes.c_int,
                                   _S, _T, _T, _T)
softmax_backward_finish = _proto("lmloss_softmax_backward_finish", _Ctx, _T, _T, ctypes.c_int, _S,
                                 _T, _T, _T, _T)
merge = _proto("lmloss_row_state_merge", _Ctx, _T, _T, _Tr, _T)

# The fused head's cross-entropy over a shard of the head's rows.
_HEAD = (_P(_lib.Head), _T, _T, _T, _CEO, _P(_lib.HeadOptions), _S)
_WS = (ctypes.c_void_p, ctypes.c_size_t)
EXCHANGE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, _T)  # lmloss_exchange_fn
EXCHANGE_FAILED = 10  # what an exchange that raised returns (LMLOSS_ERR_DEVICE_FAILURE)
linear_ce_sharded = _proto("lmloss_linear_cross_entropy_sharded", _Ctx, *_HEAD, EXCHANGE_FN,
                           ctypes.c_void_p, _T, _P(_lib.CEOutputs), _P(_lib.HeadGrads), *_WS)
linear_ce_backward_finish = _proto("lmloss_linear_cross_entropy_backward_finish", _Ctx, *_HEAD,
                                   _T, _T, _P(_lib.HeadGrads), *_WS)

# ---------------------------------------------------------------- divergences

_DI, _DO = _P(_lib.DivInputs), _P(_lib.DivOptions)
DIV_STATE_COLS = 12  # LMLOSS_DIV_STATE_COLS (layout version 1)
DIV_STATE_EXCHANGE_COLS = 8  # LMLOSS_DIV_STATE_EXCHANGE_COLS: ms, rs, as, mt, rt, at, d, xt_as
DIV_COL_WS_Y, DIV_COL_XS_A, DIV_COL_XT_AT = 8, 9, 10
DIV_PARTIAL_COLS = 8  # LMLOSS_DIV_PARTIAL_COLS (F64): div, rev, mix, pos, neg, eq, ent, 0
_DIV_PARTIALS = {0: (0,), 1: (0, 1), 2: (0, 2), 3: (0, 3, 4, 5)}  # by lmloss_divergence_kind
DIV_PARTIAL_ENT = 6


def div_exchange_columns(opt):
    """The state columns a divergence's finish reads, all its exchange must
    send (4 bytes each a row): the leading eight; ws_y with a hard term;
    each side's raw logit at its argmax with that side's softcap. The
    receiver fills the others: 0, and ws_y NaN."""
    return (tuple(range(DIV_STATE_EXCHANGE_COLS))
            + ((DIV_COL_WS_Y,) if opt.hard_weight > 0 else ())
            + ((DIV_COL_XS_A,) if opt.student.softcap > 0 else ())
            + ((DIV_COL_XT_AT,) if opt.teacher.softcap > 0 else ()))


def div_kind(opt):
    """opt's kind as the C calls resolve it: a JSD with beta 0 or 1 is the
    KL or reverse KL."""
    kind = opt.kind
    if kind == _lib.DIV_KINDS["jsd"] and opt.beta in (0.0, 1.0):
        kind = _lib.DIV_KINDS["kl"] if opt.beta == 0.0 else _lib.DIV_KINDS["reverse_kl"]
    return kind


def div_partial_columns(opt, entropy=False):
    """The partials' columns opt's kind reads, and the entropy's when the
    finish is to output it."""
    return _DIV_PARTIALS[div_kind(opt)] + ((DIV_PARTIAL_ENT,) if entropy else ())


div_state = _proto("lmloss_divergence_state", _Ctx, _DI, _DO, _S, _T)
div_state_merge = _proto("lmloss_divergence_state_merge", _Ctx, _T, _T, _DO, _T)
div_partials = _proto("lmloss_divergence_partials", _Ctx, _DI, _DO, _S, _T, _T)
div_partials_grad = _proto("lmloss_divergence_partials_grad", _Ctx, _DI, _DO, _S, _T, _T, _T,
                           ctypes.c_void_p, ctypes.c_size_t)
div_finish_grad = _proto("lmloss_divergence_finish_grad", _Ctx, _DI, _DO, _S, _T, _T, _T,
                         ctypes.c_void_p, ctypes.c_size_t)
div_finish = _proto("lmloss_divergence_finish", _Ctx, _DI, _DO, _S, _T, _T, _P(_lib.DivOutputs),
                    ctypes.c_void_p, ctypes.c_size_t)
div_backward_finish = _proto("lmloss_divergence_backward_finish", _Ctx, _DI, _DO, _S, _T, _T, _T,
                             _T, ctypes.c_void_p, ctypes.c_size_t)
