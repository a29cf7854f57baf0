"""Vocab-parallel losses: the vocabulary split over the ranks of a
torch.distributed process group (Megatron's layout: rank r holds columns
[col0, col0 + V_r) of every row, hidden states replicated).

Each rank forms its shard's row states (lmloss.h's row contract), one
all-gather exchanges the columns its finish reads (16 bytes a row for CE,
log-probs and entropy, 12 for softmax; docs/design.md), every rank merges the parts in
rank order with lmloss_row_state_merge, so that every rank holds the same
bits and reports the same loss, and finishes its own columns. The
backward needs no collective of its own, except softmax's (12 bytes a
row, log-softmax's 16) and the fused head's dhidden, which is summed
over the ranks. The divergences (Divergence) exchange twice in the
forward: the two rows' states (32 bytes a row, more with a hard term or a
softcap), then the loss sweep's sums (8 to 32 bytes a row by kind, in
double); their backward needs no collective.
Never an all-reduce of a sum of exponentials: that is the collapse.

The functions here are eager autograd Functions (a process group cannot
ride through a torch.library schema); they call no host synchronization,
so a CUDA graph can capture them with NCCL.
"""

import torch
import torch.distributed as dist

from .. import _lib
from .. import _shard as S
from . import _bridge as B
from . import _div_ops as DO
from . import _linear_ops as LO
from . import _ops as O

F32 = torch.float32


class Shard:
    """Where this rank's columns lie: Megatron's even split unless the caller
    says otherwise (vocab_start: this rank's first column, vocab_size: the
    whole vocabulary), for uneven shards."""

    def __init__(self, group, cols, vocab_start=None, vocab_size=None):
        self.group = group
        self.world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if (vocab_start is None) != (vocab_size is None):
            raise _lib.Error("LMLOSS_ERR_BAD_OPTION",
                             "vocab_start and vocab_size go together (uneven shards)")
        self.col0 = rank * cols if vocab_start is None else int(vocab_start)
        self.vocab = self.world * cols if vocab_size is None else int(vocab_size)

    def struct(self, entropy=False):
        """The lmloss_shard of this rank (entropy: the state carries t)."""
        return S.Shard(self.col0, self.vocab, int(bool(entropy)))


def _state(x):
    return x.new_empty((x.shape[0], S.STATE_COLS), dtype=F32)


def exchange(state, cols, shard, tr, run):
    """The merged states of every rank's shard: an all-gather of the
    columns cols (_shard.exchange_columns), merged in rank order on every
    rank."""
    if shard.world == 1:
        return state
    n, cols = state.shape[0], list(cols)
    wire = state[:, cols].contiguous()
    parts = wire.new_empty((shard.world * n, len(cols)))
    dist.all_gather_into_tensor(parts, wire, group=shard.group)
    full = state.new_zeros((shard.world, n, S.STATE_COLS))
    full[:, :, S.COL_WY] = float("nan")
    full[:, :, cols] = parts.view(shard.world, n, len(cols))
    merged = full[0]
    keep = []
    with B.context(state, *run) as ctx:
        acc = B.view(merged, keep)
        for p in range(1, shard.world):
            _lib.check(S.merge(ctx, acc, B.view(full[p], keep), tr, acc))
    return merged


# ---------------------------------------------------------------- cross-entropy

def _ce_cols(opt, entropy):
    return S.exchange_columns(True, entropy, opt.label_smoothing > 0)


def ce_state_into(x, target, tw, cw, opt, shard, entropy, run, state):
    """This shard's CE states of x's rows into state [N, 8]."""
    keep = []
    with B.context(x, *run) as ctx:
        _lib.check(S.ce_state(ctx, O.ce_inputs(x, target, tw, cw, keep), opt,
                              shard.struct(entropy), B.view(state, keep)))


def ce_state(x, target, tw, cw, opt, shard, entropy, run):
    """This shard's CE states, exchanged and merged."""
    state = _state(x)
    ce_state_into(x, target, tw, cw, opt, shard, entropy, run, state)
    return exchange(state, _ce_cols(opt, entropy), shard, opt.transform, run)


def ce_finish(x, target, tw, cw, opt, shard, merged, extras, run, dlogits=None):
    """The CE outputs of whole rows from merged states (loss as opt reduces
    it; lse, entropy, argmax as extras asks), and this shard's gradient
    into dlogits when given."""
    n = x.shape[0]
    loss = x.new_empty((n,) if opt.reduction == _lib.REDUCTIONS["none"] else (), dtype=F32)
    lse, ent, amax = O._extras(x, n, extras)
    keep = []
    with B.context(x, *run) as ctx:
        out = O.ce_outputs(loss, lse, ent, amax, extras, keep)
        if dlogits is not None:
            out.dlogits = B.view(dlogits, keep)
        ws, addr, nbytes = B.workspace(_lib.ce_workspace_size(n), x.device)
        _lib.check(S.ce_finish(ctx, O.ce_inputs(x, target, tw, cw, keep), opt,
                               shard.struct(extras & O.EXTRA_ENTROPY), B.view(merged, keep), out,
                               addr, nbytes))
    return loss, lse, ent, amax


def ce_backward(x, target, tw, cw, opt, shard, merged, dloss, entropy, run):
    dlogits, keep = torch.empty_like(x, memory_format=torch.contiguous_format), []
    with B.context(x, *run) as ctx:
        ws, addr, nbytes = B.workspace(_lib.ce_workspace_size(x.shape[0]), x.device)
        _lib.check(S.ce_backward_finish(ctx, O.ce_inputs(x, target, tw, cw, keep), opt,
                                        shard.struct(entropy), B.view(merged, keep),
                                        B.view(dloss.reshape(-1).to(F32), keep),
                                        B.view(dlogits, keep), addr, nbytes))
    return dlogits


class CrossEntropy(torch.autograd.Function):
    """cross_entropy of a vocabulary shard [N, V_r]: the whole rows' loss
    (and extras) on every rank, the gradient over the shard's columns."""

    @staticmethod
    def forward(ctx, x, target, tw, cw, fopts, iopts, extras, shard):
        opt, run = O._ce_opt(fopts, iopts), O.run_args(iopts)
        entropy = bool(extras & O.EXTRA_ENTROPY)
        merged = ce_state(x, target, tw, cw, opt, shard, entropy, run)
        out = ce_finish(x, target, tw, cw, opt, shard, merged, extras, run)
        ctx.save_for_backward(x, target, tw, cw, merged)
        ctx.args = fopts, iopts, shard, entropy
        ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, dloss, *_):
        x, target, tw, cw, merged = ctx.saved_tensors
        fopts, iopts, shard, entropy = ctx.args
        dx = ce_backward(x, target, tw, cw, O._ce_opt(fopts, iopts), shard, merged, dloss,
                         entropy, O.run_args(iopts))
        return (dx,) + (None,) * 7


# ---------------------------------------------------------------- log-probs, entropy

def _lp_views(x, index, mask, keep):
    return (B.view(x, keep), B.ptr(B.view(index, keep)) if index is not None else None,
            B.ptr(B.view(mask, keep)) if mask is not None else None)


def _lp_cols(index, want_entropy):
    return S.exchange_columns(index is not None, want_entropy, False)


def lp_state_into(x, index, mask, tr, sh, state, run):
    keep = []
    with B.context(x, *run) as c:
        _lib.check(S.lp_state(c, *_lp_views(x, index, mask, keep), tr, sh, B.view(state, keep)))


def lp_finish_into(x, index, mask, tr, sh, merged, logp, ent, run):
    """logp [n, 1] (with index) and entropy [n] (ent not None) of whole rows."""
    keep = []
    with B.context(x, *run) as c:
        _lib.check(S.lp_finish(c, *_lp_views(x, index, mask, keep), tr, sh, B.view(merged, keep),
                               B.ptr(B.view(logp, keep)) if index is not None else None,
                               B.ptr(B.view(ent, keep)) if ent is not None else None))


def lp_backward(x, index, mask, tr, sh, merged, dlogp, dent, run):
    """This shard's dlogits from dlogp [n, 1] (with index) and dentropy [n]
    (None: not wanted)."""
    dx, keep = torch.empty_like(x, memory_format=torch.contiguous_format), []

    def opt(t):
        return None if t is None else B.ptr(B.view(t.to(F32).contiguous(), keep))

    with B.context(x, *run) as c:
        _lib.check(S.lp_backward_finish(c, *_lp_views(x, index, mask, keep), tr, sh,
                                        B.view(merged, keep),
                                        opt(dlogp if index is not None else None), opt(dent),
                                        B.view(dx, keep)))
    return dx


def _lp_outputs(x, n, index, want_entropy):
    return (x.new_empty((n, 1) if index is not None else (0,), dtype=F32),
            x.new_empty((n,) if want_entropy else (0,), dtype=F32))


class LogProbs(torch.autograd.Function):
    """log_probs (index [N, 1] or None) and entropy of a vocabulary shard:
    logp [N, 1] and entropy [N] of the whole rows on every rank."""

    @staticmethod
    def forward(ctx, x, index, mask, tr_args, want_entropy, shard, run):
        tr, sh, state = B.transform(*tr_args), shard.struct(want_entropy), _state(x)
        lp_state_into(x, index, mask, tr, sh, state, run)
        merged = exchange(state, _lp_cols(index, want_entropy), shard, tr, run)
        logp, ent = _lp_outputs(x, x.shape[0], index, want_entropy)
        lp_finish_into(x, index, mask, tr, sh, merged, logp, ent if want_entropy else None, run)
        ctx.save_for_backward(x, index, mask, merged)
        ctx.args = tr_args, want_entropy, shard, run
        return logp, ent

    @staticmethod
    def backward(ctx, dlogp, dent):
        x, index, mask, merged = ctx.saved_tensors
        tr_args, want_entropy, shard, run = ctx.args
        dx = lp_backward(x, index, mask, B.transform(*tr_args), shard.struct(want_entropy), merged,
                         dlogp, dent if want_entropy else None, run)
        return (dx,) + (None,) * 6


# ---------------------------------------------------------------- softmax, log-softmax

class Softmax(torch.autograd.Function):
    """softmax (log_softmax when log) of a vocabulary shard's columns [N, V_r]."""

    @staticmethod
    def forward(ctx, x, log, shard, run):
        tr, keep = _lib.transform_default(), []
        state = _state(x)
        with B.context(x, *run) as c:
            _lib.check(S.lp_state(c, B.view(x, keep), None, None, tr, shard.struct(),
                                  B.view(state, keep)))
        merged = exchange(state, S.exchange_columns(False, False, False), shard, tr, run)
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        with B.context(x, *run) as c:
            _lib.check(S.softmax_finish(c, B.view(x, keep), shard.struct(), B.view(merged, keep),
                                        int(log), B.view(y, keep)))
        ctx.save_for_backward(y, merged)
        ctx.args = log, shard, run
        return y

    @staticmethod
    def backward(ctx, dy):
        # lmloss.h's sharded softmax backward: dy at the merged state's
        # argmax from the rank holding it, summed over the ranks; the
        # partial sums of the other columns, summed; then dx, its argmax
        # entry from the state's R. Softmax's partials read dy_a (they
        # cancel only where dy does), so two all-reduces; log-softmax's
        # do not, so one carries both.
        y, merged = ctx.saved_tensors
        log, shard, run = ctx.args
        dy = dy.contiguous()
        a = merged[:, 2].round().long() - shard.col0
        rows = ((a >= 0) & (a < y.shape[1])).nonzero().squeeze(1)
        # log's partials and dy_a travel together (sums); softmax's alone
        sums = torch.empty((y.shape[0], 2 if log else 1), dtype=torch.float64, device=y.device)
        dy_a = torch.zeros(y.shape[0], dtype=F32, device=y.device)
        dy_a[rows] = dy[rows, a[rows]].to(F32)
        if not log:
            _all_reduce(dy_a, shard)
        partials = sums[:, :1]
        keep = []
        with B.context(y, *run) as c:
            _lib.check(S.softmax_backward_partials(c, B.view(y, keep), B.view(dy, keep), int(log),
                                                   shard.struct(), B.view(merged, keep),
                                                   B.view(dy_a, keep), B.view(partials, keep)))
        if log:
            sums[:, 1] = dy_a
        _all_reduce(sums, shard)
        if log:
            dy_a = sums[:, 1].to(F32)
        dx = torch.empty_like(y)
        with B.context(y, *run) as c:
            _lib.check(S.softmax_backward_finish(c, B.view(y, keep), B.view(dy, keep), int(log),
                                                 shard.struct(), B.view(merged, keep),
                                                 B.view(dy_a, keep), B.view(partials, keep),
                                                 B.view(dx, keep)))
        return dx, None, None, None


def _all_reduce(t, shard):
    if shard.world > 1:
        dist.all_reduce(t, group=shard.group)


# ---------------------------------------------------------------- divergences

def _gather(t, cols, shard):
    """Every rank's columns cols of t [n, c]: [world, n, len(cols)], by one
    all-gather (rank order, so every rank holds the same bits)."""
    n, cols = t.shape[0], list(cols)
    wire = t[:, cols].contiguous()
    if shard.world == 1:
        return wire.unsqueeze(0)
    parts = wire.new_empty((shard.world * n, len(cols)))
    dist.all_gather_into_tensor(parts, wire, group=shard.group)
    return parts.view(shard.world, n, len(cols))


def div_exchange(state, opt, shard, run):
    """The merged divergence states of every rank's shard: the columns a
    finish reads gathered (S.div_exchange_columns: 32 to 44 bytes a row),
    merged in rank order on every rank."""
    if shard.world == 1:
        return state
    cols = list(S.div_exchange_columns(opt))
    parts = _gather(state, cols, shard)
    full = state.new_zeros((shard.world, state.shape[0], S.DIV_STATE_COLS))
    full[:, :, S.DIV_COL_WS_Y] = float("nan")
    full[:, :, cols] = parts
    merged, keep = full[0], []
    with B.context(state, *run) as ctx:
        acc = B.view(merged, keep)
        for p in range(1, shard.world):
            _lib.check(S.div_state_merge(ctx, acc, B.view(full[p], keep), opt, acc))
    return merged


def div_partials_sum(partials, opt, shard, entropy=False):
    """The partials summed over the ranks: the columns opt's kind reads
    (and the entropy's, with entropy) gathered (8 to 40 bytes a row) and
    summed in rank order, so every rank holds the same bits (an
    all-reduce's order is its own). Every summand of the loss and of the
    entropy is >= 0: a plain sum, no collapse."""
    if shard.world == 1:
        return partials
    cols = list(S.div_partial_columns(opt, entropy))
    summed = torch.zeros_like(partials)
    summed[:, cols] = _gather(partials, cols, shard).sum(0)
    return summed


def _div_inputs(x, t, label, keep):
    return _lib.DivInputs(B.view(x, keep), B.view(t, keep), B.view(label, keep))


def div_state_into(x, t, label, opt, sh, state, run):
    """lmloss_divergence_state of the rows x, t (this rank's columns) into state."""
    keep = []
    with B.context(x, *run) as c:
        _lib.check(S.div_state(c, _div_inputs(x, t, label, keep), opt, sh, B.view(state, keep)))


def div_partials_into(x, t, label, opt, sh, merged, partials, run, dx=None):
    """lmloss_divergence_partials of the rows from their merged states; with
    dx, lmloss_divergence_partials_grad: the first half of the gradient at
    an upstream of 1 too, in the same sweep (div_grad_halves)."""
    keep = []
    with B.context(x, *run) as c:
        args = (c, _div_inputs(x, t, label, keep), opt, sh, B.view(merged, keep),
                B.view(partials, keep))
        if dx is None:
            _lib.check(S.div_partials(*args))
        else:
            ws, addr, nbytes = B.workspace(_lib.ce_workspace_size(x.shape[0]), x.device)
            _lib.check(S.div_partials_grad(*args, B.view(dx, keep), addr, nbytes))


def div_grad_halves(opt, dx):
    """Whether the gradient dx forms in two halves around the partials'
    exchange (lmloss_divergence_partials_grad, finish_grad): the forward
    KL's always (whole after the first), another kind's where dx is fp32
    (it keeps a quantity a column between them), so that the finish reads
    the student's row alone."""
    return dx is not None and (S.div_kind(opt) == _lib.DIV_KINDS["kl"] or dx.dtype == F32)


def div_finish_grad(x, t, label, opt, sh, merged, summed, dx, run):
    """lmloss_divergence_finish_grad: dx, as the partials left it, at an
    upstream of 1."""
    keep = []
    with B.context(x, *run) as c:
        ws, addr, nbytes = B.workspace(_lib.ce_workspace_size(x.shape[0]), x.device)
        _lib.check(S.div_finish_grad(c, _div_inputs(x, t, label, keep), opt, sh,
                                     B.view(merged, keep), B.view(summed, keep), B.view(dx, keep),
                                     addr, nbytes))


def div_finish_into(x, t, label, opt, sh, merged, summed, loss, dx, run, entropy=None):
    """lmloss_divergence_finish: the rows' loss into loss (1-D: a row's
    each, or their sum), with dx the student's gradient at an upstream of
    1, with entropy [N] the student's entropy of each row."""
    keep = []
    with B.context(x, *run) as c:
        out = _lib.DivOutputs(loss=B.view(loss, keep))
        if dx is not None:
            out.dstudent = B.view(dx, keep)
        if entropy is not None:
            out.entropy = B.view(entropy, keep)
        ws, addr, nbytes = B.workspace(_lib.ce_workspace_size(x.shape[0]), x.device)
        _lib.check(S.div_finish(c, _div_inputs(x, t, label, keep), opt, sh, B.view(merged, keep),
                                B.view(summed, keep), out, addr, nbytes))


def div_backward(x, t, label, opt, sh, merged, summed, dloss, run):
    """lmloss_divergence_backward_finish: the student's gradient from dloss."""
    keep = []
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    with B.context(x, *run) as c:
        ws, addr, nbytes = B.workspace(_lib.ce_workspace_size(x.shape[0]), x.device)
        _lib.check(S.div_backward_finish(
            c, _div_inputs(x, t, label, keep), opt, sh, B.view(merged, keep),
            B.view(summed, keep), B.view(dloss.reshape(-1).to(F32).contiguous(), keep),
            B.view(dx, keep), addr, nbytes))
    return dx


class Divergence(torch.autograd.Function):
    """lmloss_divergence of a vocabulary shard: student and teacher [N, V_r]
    this rank's columns, label [N] in the whole vocabulary; the whole rows'
    loss on every rank (per row, or summed), the gradient w.r.t. the
    student's columns here. Two exchanges in the forward (the states, then
    the partial sums); the backward needs none. With fused (a summed loss
    whose student needs a gradient) the forward forms the gradient at an
    upstream of 1, as the one-shot op does, and the backward scales it, in
    two halves where div_grad_halves says (the finish then reads the
    student's row alone, or, for the forward KL, neither row), else in the
    finish."""

    @staticmethod
    def forward(ctx, x, t, label, fopts, iopts, shard, fused):
        opt, run, sh = DO._div_opt(fopts, iopts), O.run_args(iopts), shard.struct()
        n = x.shape[0]
        state = x.new_empty((n, S.DIV_STATE_COLS), dtype=F32)
        div_state_into(x, t, label, opt, sh, state, run)
        merged = div_exchange(state, opt, shard, run)
        partials = x.new_empty((n, S.DIV_PARTIAL_COLS), dtype=torch.float64)
        dx = torch.empty_like(x, memory_format=torch.contiguous_format) if fused else None
        halves = div_grad_halves(opt, dx)
        div_partials_into(x, t, label, opt, sh, merged, partials, run, dx if halves else None)
        summed = div_partials_sum(partials, opt, shard)
        loss = O._loss(x, n, O._reduction_name(iopts))
        div_finish_into(x, t, label, opt, sh, merged, summed, loss.reshape(-1),
                        None if halves else dx, run)
        if halves:
            div_finish_grad(x, t, label, opt, sh, merged, summed, dx, run)
        ctx.save_for_backward(x, t, label, merged, summed)
        ctx.args, ctx.fwd_grad = (fopts, iopts, shard), dx
        return loss

    @staticmethod
    def backward(ctx, dloss):
        if ctx.fwd_grad is not None:  # used once: another backward recomputes
            dx, ctx.fwd_grad = B.scale_(ctx.fwd_grad, dloss, *O.run_args(ctx.args[1])), None
            return (dx,) + (None,) * 6
        x, t, label, merged, summed = ctx.saved_tensors
        fopts, iopts, shard = ctx.args
        dx = div_backward(x, t, label, DO._div_opt(fopts, iopts), shard.struct(), merged, summed,
                          dloss, O.run_args(iopts))
        return (dx,) + (None,) * 6


# ---------------------------------------------------------------- the fused head, W split by rows

DEFAULT_BUDGET = 256 << 20  # lmloss_head_options' default
DIV_HEADS_BUDGET = 400 << 20  # lmloss_linear_divergence's


def _none(opt):
    """opt with per-row losses: the fused head reduces them itself."""
    o = _lib.CEOptions.from_buffer_copy(opt)
    o.reduction, o.grad_output = _lib.REDUCTIONS["none"], 1.0
    return o


def _scale(opt, target, cw):
    """What the summed row losses are divided by for opt's reduction, as a
    device tensor (lmloss.h: mean is over the valid rows' class weights, 0
    when they sum to 0)."""
    if opt.reduction == _lib.REDUCE_SUM_OVER_ITEMS:
        return torch.tensor(1.0 / opt.num_items, device=target.device)
    if opt.reduction != _lib.REDUCTIONS["mean"]:
        return torch.ones((), device=target.device)
    valid = target != opt.ignore_index
    if cw is None:
        den = valid.sum().to(F32)
    else:
        den = (cw[target.clamp(0, cw.numel() - 1)] * valid).sum()
    return torch.where(den > 0, 1.0 / den.clamp(min=1e-30), torch.zeros_like(den))


class LinearCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits = hidden [N, H] weight_r [V_r, H]^T (+ bias_r):
    rank r's rows of a 16-bit head (an F32 one takes LinearCrossEntropyF32),
    hidden replicated, composed here on torch's GEMMs. The logits exist a chunk
    of rows at a time, within the memory budget. The states of every chunk
    are exchanged once; a second pass over the chunks finishes the loss
    and, for a scalar loss, the gradients (the logits are recomputed when
    they took more than one chunk: one GEMM more for one collective). The
    backward sums dhidden over the ranks."""

    @staticmethod
    def forward(ctx, h, w, b, target, tw, cw, fopts, iopts, shard, budget):
        opt, run = O._ce_opt(fopts, iopts), O.run_args(iopts)
        n, chunks = h.shape[0], _plan(h, w, budget)
        state, kept = h.new_empty((n, S.STATE_COLS), dtype=F32), None
        for i0, i1 in chunks:
            z = _logits(h[i0:i1], w, b)
            ce_state_into(z, target[i0:i1], _rows_of(tw, i0, i1), cw, opt, shard, False, run,
                          state[i0:i1])
            kept = z if len(chunks) == 1 else None
        merged = exchange(state, _ce_cols(opt, False), shard, opt.transform, run)
        scalar = opt.reduction != _lib.REDUCTIONS["none"]
        grads = scalar and any(ctx.needs_input_grad[:3])
        rows, acc = _second_pass(h, w, b, target, tw, cw, _none(opt), shard, merged, chunks,
                                 kept, run, None if grads else False)
        scale = _scale(opt, target, cw)
        loss = rows.sum() * scale if scalar else rows
        ctx.save_for_backward(h, w, b, target, tw, cw, merged, scale)
        ctx.args = fopts, iopts, shard, chunks, acc
        return loss

    @staticmethod
    def backward(ctx, dloss):
        h, w, b, target, tw, cw, merged, scale = ctx.saved_tensors
        fopts, iopts, shard, chunks, acc = ctx.args
        opt = O._ce_opt(fopts, iopts)
        if acc is None:  # per-row losses: the gradient needs dloss
            _, acc = _second_pass(h, w, b, target, tw, cw, _none(opt), shard, merged, chunks,
                                  None, O.run_args(iopts), dloss.reshape(-1).to(F32))
            g = torch.ones((), device=h.device)
        else:
            g = dloss.to(F32) * scale
        return _head_grads(acc, g, shard, h, w, b) + (None,) * 7


class LinearCrossEntropyF32(torch.autograd.Function):
    """LinearCrossEntropy of an F32 head through the library's own chunk
    loop and GEMMs (lmloss_linear_cross_entropy_sharded, which calls back
    for the exchange; torch's GEMMs are the slower ones on CPU ranks). The
    gradients come with the forward for a scalar loss; a per-row loss's
    backward runs lmloss_linear_cross_entropy_backward_finish with dloss."""

    @staticmethod
    def forward(ctx, h, w, b, target, tw, cw, fopts, iopts, shard, budget):
        opt, run = O._ce_opt(fopts, iopts), O.run_args(iopts)
        n, none = h.shape[0], opt.reduction == _lib.REDUCTIONS["none"]
        need = 0 if none else LO._need(ctx, b)
        grads, state = LO._grads(h, w, b, need), h.new_empty((n, S.STATE_COLS), dtype=F32)
        loss, keep, raised = h.new_empty((n,) if none else (), dtype=F32), [], []

        def merge(user, view):  # the C call's exchange: state's rows become the merged ones
            try:
                state.copy_(exchange(state, _ce_cols(opt, False), shard, opt.transform, run))
                return 0
            except BaseException as e:  # raised again once the C call has returned
                raised.append(e)
                return S.EXCHANGE_FAILED

        with B.context(h, *run) as c:
            args, gs, ws = _head_args((h, w, b, target, tw, cw), opt, shard, budget,
                                      grads if need else None, keep)
            out = _lib.CEOutputs(loss=B.view(loss.reshape(-1), keep))
            status = S.linear_ce_sharded(c, *args, S.EXCHANGE_FN(merge), None,
                                         B.view(state, keep), out, gs, *ws[1:])
        if raised:
            raise raised[0]
        _lib.check(status)
        ctx.save_for_backward(h, w, b, target, tw, cw, state)
        ctx.args = fopts, iopts, shard, budget, grads, need
        return loss

    @staticmethod
    def backward(ctx, dloss):
        h, w, b, target, tw, cw, merged = ctx.saved_tensors
        fopts, iopts, shard, budget, grads, need = ctx.args
        opt = O._ce_opt(fopts, iopts)
        if opt.reduction == _lib.REDUCTIONS["none"]:
            need, keep = LO._need(ctx, b), []
            grads = LO._grads(h, w, b, need)
            with B.context(h, *O.run_args(iopts)) as c:
                args, gs, ws = _head_args((h, w, b, target, tw, cw), opt, shard, budget, grads,
                                          keep)
                up = B.view(dloss.reshape(-1).to(F32).contiguous(), keep)
                _lib.check(S.linear_ce_backward_finish(c, *args, B.view(merged, keep), up, gs,
                                                       *ws[1:]))
        else:  # formed at an upstream of 1 (lmloss_scale returns at once for 1)
            run, ctx.args = O.run_args(iopts), None
            for g in grads:
                if g.numel():
                    B.scale_(g, dloss, *run)
        if need & LO.NEED_DH and shard.world > 1:
            dist.all_reduce(grads[0], group=shard.group)
        return LO._back(grads, need, 7)


def _head_args(head, opt, shard, budget, grads, keep):
    """A sharded head call's arguments from the head through the shard,
    its grads struct (None: no gradient) and its workspace (buffer,
    address, bytes); what the call reads is appended to keep."""
    h, w, b, target, tw, cw = head
    hd, hopt = LO._head(h, w, b, keep), LO._hopt(budget)
    gs = B.ptr(LO._grads_struct(grads, keep)) if grads is not None else None
    ws = LO._workspace(h.device, _lib.linear_workspace_size, hd, hopt, gs, 1)
    return ((hd, B.view(target, keep), B.ptr(B.view(tw, keep)), B.ptr(B.view(cw, keep)), opt,
             hopt, shard.struct()), gs, ws)


def _plan(h, w, budget):
    """Row chunks whose logits, their gradient and a float a column fit the budget."""
    n = h.shape[0]
    step = max(1, (budget or DEFAULT_BUDGET) // (w.shape[0] * (2 * h.element_size() + 4)))
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def _logits(h, w, b):
    return torch.addmm(b, h, w.t()) if b is not None else h @ w.t()


def _new_acc(h, w, b):
    """The fp32 sums of dhidden (each chunk writes its rows), dweight and
    dbias (the first chunk's, None before it): no pass to zero them, a
    tenth of a CPU rank's head."""
    return [torch.empty(h.shape, dtype=F32, device=h.device), None, None]


def _accumulate(acc, dz, h, w, b, i0, i1):
    """A chunk's logits gradient dz into the fp32 sums of dhidden, dweight, dbias."""
    acc[0][i0:i1] = (dz @ w).to(F32)
    dw = (dz.t() @ h[i0:i1]).to(F32)
    acc[1] = dw if acc[1] is None else acc[1].add_(dw)
    if b is not None:
        db = dz.sum(0, dtype=F32)
        acc[2] = db if acc[2] is None else acc[2].add_(db)


def _head_grads(acc, g, shard, h, w, b):
    """The gradients times g, dhidden summed over the ranks (hidden is
    replicated: each rank's part comes from its rows of the head)."""
    dh, dw, db = acc
    if dw is None:  # no rows
        dw = torch.zeros(w.shape, dtype=F32, device=w.device)
        db = None if b is None else torch.zeros(b.shape, dtype=F32, device=b.device)
    dh = dh * g
    if shard.world > 1:
        dist.all_reduce(dh, group=shard.group)
    return (dh.to(h.dtype), (dw * g).to(w.dtype), None if b is None else (db * g).to(b.dtype))


def _rows_of(t, i0, i1):
    return None if t is None else t[i0:i1]


def _second_pass(h, w, b, target, tw, cw, opt, shard, merged, chunks, kept, run, dloss):
    """The row losses and, unless dloss is False, the fp32 sums of dhidden,
    dweight and dbias of sum_i dloss_i loss_i (dloss None: all 1)."""
    rows = h.new_empty((h.shape[0],), dtype=F32)
    acc = None if dloss is False else _new_acc(h, w, b)
    for i0, i1 in chunks:
        z = kept if kept is not None else _logits(h[i0:i1], w, b)
        t, m, twc = target[i0:i1], merged[i0:i1], _rows_of(tw, i0, i1)
        dz = None
        if acc is not None and dloss is not None:
            dz = ce_backward(z, t, twc, cw, opt, shard, m, dloss[i0:i1], False, run)
        elif acc is not None:
            dz = torch.empty_like(z, memory_format=torch.contiguous_format)
        if dloss is None or dloss is False:
            rows[i0:i1] = ce_finish(z, t, twc, cw, opt, shard, m, 0, run, dz)[0]
        if dz is not None:
            _accumulate(acc, dz, h, w, b, i0, i1)
    return rows, acc


class LinearLogProbs(torch.autograd.Function):
    """log_probs (index [N, 1] or None) and entropy of logits = hidden
    weight_r^T (+ bias_r), rank r's rows of the head: the states of every
    chunk exchanged once, then the outputs; the backward recomputes the
    logits (unless they took one chunk, which is kept) and sums dhidden
    over the ranks."""

    @staticmethod
    def forward(ctx, h, w, b, index, mask, tr_args, want_entropy, shard, run, budget):
        tr, sh = B.transform(*tr_args), shard.struct(want_entropy)
        n, chunks = h.shape[0], _plan(h, w, budget)
        state, kept = h.new_empty((n, S.STATE_COLS), dtype=F32), None
        for i0, i1 in chunks:
            z = _logits(h[i0:i1], w, b)
            lp_state_into(z, _rows_of(index, i0, i1), _rows_of(mask, i0, i1), tr, sh,
                          state[i0:i1], run)
            kept = z if len(chunks) == 1 else None
        merged = exchange(state, _lp_cols(index, want_entropy), shard, tr, run)
        logp, ent = _lp_outputs(h, n, index, want_entropy)
        for i0, i1 in chunks:
            z = kept if kept is not None else _logits(h[i0:i1], w, b)
            lp_finish_into(z, _rows_of(index, i0, i1), _rows_of(mask, i0, i1), tr, sh,
                           merged[i0:i1], _rows_of(logp if index is not None else None, i0, i1),
                           ent[i0:i1] if want_entropy else None, run)
        ctx.save_for_backward(h, w, b, index, mask, merged)
        ctx.args = tr_args, want_entropy, shard, run, chunks, kept
        return logp, ent

    @staticmethod
    def backward(ctx, dlogp, dent):
        h, w, b, index, mask, merged = ctx.saved_tensors
        tr_args, want_entropy, shard, run, chunks, kept = ctx.args
        tr, sh, acc = B.transform(*tr_args), shard.struct(want_entropy), _new_acc(h, w, b)
        for i0, i1 in chunks:
            z = kept if kept is not None else _logits(h[i0:i1], w, b)
            dz = lp_backward(z, _rows_of(index, i0, i1), _rows_of(mask, i0, i1), tr, sh,
                             merged[i0:i1], _rows_of(dlogp, i0, i1),
                             dent[i0:i1] if want_entropy else None, run)
            _accumulate(acc, dz, h, w, b, i0, i1)
        return _head_grads(acc, 1.0, shard, h, w, b) + (None,) * 7


class LinearDivergence(torch.autograd.Function):
    """A divergence through two fused heads whose weights (and biases) are
    rank r's rows of the vocabulary, hidden replicated: the student's
    logits hs [N, Hs] ws_r^T (+ bs_r), the teacher's from its own head
    (not differentiated), a chunk of rows at a time within the budget.
    Three passes over the chunks, Divergence's two exchanges between them:
    the states; the partial sums; the finish and, for a summed loss, the
    student's gradients (the logits recomputed in each pass when they took
    more than one chunk; in one chunk the gradient forms in two halves, as
    Divergence's). The backward sums dhidden over the ranks. Returns
    the loss and, with want_entropy, the student's entropy of each row (not
    differentiable; else an empty tensor)."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, label, fopts, iopts, shard, budget, per_row,
                want_entropy):
        opt, run, sh = DO._div_opt(fopts, iopts), O.run_args(iopts), shard.struct()
        n = hs.shape[0]
        chunks = _plan(hs, ws, (budget or DIV_HEADS_BUDGET) // 2)  # both heads' logits
        kept = _pair_logits(hs, ws, bs, ht, wt, bt, 0, n) if len(chunks) == 1 else None
        state = hs.new_empty((n, S.DIV_STATE_COLS), dtype=F32)
        for i0, i1 in chunks:
            zs, zt = kept or _pair_logits(hs, ws, bs, ht, wt, bt, i0, i1)
            div_state_into(zs, zt, _rows_of(label, i0, i1), opt, sh, state[i0:i1], run)
        merged = div_exchange(state, opt, shard, run)
        partials = hs.new_empty((n, S.DIV_PARTIAL_COLS), dtype=torch.float64)
        grads = not per_row and any(ctx.needs_input_grad[:3])
        # one chunk (kept): the gradient in two halves, as Divergence's
        halves = grads and kept is not None and div_grad_halves(opt, kept[0])
        dz = torch.empty_like(kept[0]) if halves else None
        for i0, i1 in chunks:
            zs, zt = kept or _pair_logits(hs, ws, bs, ht, wt, bt, i0, i1)
            div_partials_into(zs, zt, _rows_of(label, i0, i1), opt, sh, merged[i0:i1],
                              partials[i0:i1], run, dz)
        summed = div_partials_sum(partials, opt, shard, want_entropy)
        acc = _new_acc(hs, ws, bs) if grads else None
        loss = hs.new_empty((n if per_row else len(chunks),), dtype=F32)
        entropy = hs.new_empty((n if want_entropy else 0,), dtype=F32)
        for k, (i0, i1) in enumerate(chunks):
            zs, zt = kept or _pair_logits(hs, ws, bs, ht, wt, bt, i0, i1)
            if not halves:
                dz = None if acc is None else torch.empty_like(zs)
            div_finish_into(zs, zt, _rows_of(label, i0, i1), opt, sh, merged[i0:i1],
                            summed[i0:i1], loss[i0:i1] if per_row else loss[k:k + 1],
                            None if halves else dz, run,
                            entropy[i0:i1] if want_entropy else None)
            if halves:
                div_finish_grad(zs, zt, _rows_of(label, i0, i1), opt, sh, merged[i0:i1],
                                summed[i0:i1], dz, run)
            if dz is not None:
                _accumulate(acc, dz, hs, ws, bs, i0, i1)
        ctx.save_for_backward(hs, ws, bs, ht, wt, bt, label, merged, summed)
        ctx.args = fopts, iopts, shard, chunks, kept, acc
        ctx.mark_non_differentiable(entropy)
        return loss if per_row else loss.sum(), entropy

    @staticmethod
    def backward(ctx, dloss, _dentropy):
        hs, ws, bs, ht, wt, bt, label, merged, summed = ctx.saved_tensors
        fopts, iopts, shard, chunks, kept, acc = ctx.args
        if acc is not None:  # formed in the forward at an upstream of 1
            return _head_grads(acc, dloss.to(F32), shard, hs, ws, bs) + (None,) * 10
        opt, run, sh = DO._div_opt(fopts, iopts), O.run_args(iopts), shard.struct()
        acc, dl = _new_acc(hs, ws, bs), dloss.reshape(-1).to(F32)
        for i0, i1 in chunks:
            zs, zt = kept or _pair_logits(hs, ws, bs, ht, wt, bt, i0, i1)
            dz = div_backward(zs, zt, _rows_of(label, i0, i1), opt, sh, merged[i0:i1],
                              summed[i0:i1], dl[i0:i1], run)
            _accumulate(acc, dz, hs, ws, bs, i0, i1)
        return _head_grads(acc, 1.0, shard, hs, ws, bs) + (None,) * 10


def _pair_logits(hs, ws, bs, ht, wt, bt, i0, i1):
    """Rows [i0, i1) of both heads' logits over this rank's columns."""
    return _logits(hs[i0:i1], ws, bs), _logits(ht[i0:i1], wt, bt)


# ---------------------------------------------------------------- the functions lmloss.torch calls

def _rows(x):
    from ._functional import _rows as rows
    return rows(x, "logits")


def cross_entropy(logits, target, *, process_group, vocab_start=None, vocab_size=None,
                  ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_scale=1.0,
                  softcap=None, temperature=1.0, token_weight=None, class_weight=None,
                  reduction="mean", num_items=None, dft=False, return_lse=False,
                  return_entropy=False, return_argmax=False, backend="auto", num_threads=0):
    """lmloss.torch.cross_entropy of this rank's vocabulary shard
    logits [..., V_r]: target [...] in the whole vocabulary, class_weight
    the whole vocabulary's [V]; the whole rows' loss on every rank."""
    from . import _functional as Fn
    red, items, divisor = Fn._reduction(reduction, num_items)
    x = _rows(logits)
    shard = Shard(process_group, x.shape[-1], vocab_start, vocab_size)
    extras = Fn._extras_flags(return_lse, return_entropy, return_argmax)
    fopts, iopts = O.ce_args(ignore_index, label_smoothing, z_loss, logit_scale,
                             float(softcap or 0.0), temperature, red, items, dft,
                             B.backend_code(backend), num_threads)
    out = CrossEntropy.apply(x, Fn._index(target).reshape(-1), Fn._f32(token_weight),
                             Fn._f32(class_weight), fopts, iopts, extras, shard)
    loss, pick = Fn._finish(*out, logits.shape[:-1], red, divisor, extras)
    return loss if pick is None else Fn.CrossEntropyResult(loss, None, *pick)


def _one_index(index, lead):
    if index.dim() != len(lead) and index.shape[-1] != 1:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "over a vocabulary shard, log_probs takes one "
                         "index a row, got index %s" % (tuple(index.shape),))


def log_probs(logits, index, *, process_group, vocab_start=None, vocab_size=None,
              temperature=1.0, mask=None, entropy=False, backend="auto", num_threads=0):
    """lmloss.torch.log_probs of a vocabulary shard: index [...] (one index
    a row, in the whole vocabulary), the whole rows' log-probs (and
    entropy) on every rank."""
    from . import _functional as Fn
    x = _rows(logits)
    lead = logits.shape[:-1]
    _one_index(index, lead)
    shard = Shard(process_group, x.shape[-1], vocab_start, vocab_size)
    logp, ent = LogProbs.apply(x, Fn._index(index).reshape(-1, 1), Fn._mask(mask),
                               (1.0, 0.0, float(temperature)), bool(entropy), shard,
                               (B.backend_code(backend), int(num_threads)))
    logp = logp.reshape(index.shape)
    return (logp, ent.reshape(lead)) if entropy else logp


def entropy(logits, *, process_group, vocab_start=None, vocab_size=None, temperature=1.0,
            backend="auto", num_threads=0):
    """lmloss.torch.entropy of a vocabulary shard: the whole rows' entropy."""
    x = _rows(logits)
    shard = Shard(process_group, x.shape[-1], vocab_start, vocab_size)
    _, ent = LogProbs.apply(x, None, None, (1.0, 0.0, float(temperature)), True, shard,
                            (B.backend_code(backend), int(num_threads)))
    return ent.reshape(logits.shape[:-1])


def softmax(logits, *, process_group, log=False, vocab_start=None, vocab_size=None,
            backend="auto", num_threads=0):
    """softmax (log_softmax when log) of a vocabulary shard's columns."""
    x = _rows(logits)
    shard = Shard(process_group, x.shape[-1], vocab_start, vocab_size)
    y = Softmax.apply(x, bool(log), shard, (B.backend_code(backend), int(num_threads)))
    return y.reshape(logits.shape)


def linear_cross_entropy(hidden, weight, target, *, process_group, bias=None, vocab_start=None,
                         vocab_size=None, memory_budget=None, ignore_index=-100,
                         label_smoothing=0.0, z_loss=0.0, logit_scale=1.0, softcap=None,
                         temperature=1.0, token_weight=None, class_weight=None, reduction="mean",
                         num_items=None, dft=False, backend="auto", num_threads=0):
    """lmloss.torch.linear_cross_entropy with the head's rows split over
    the ranks: weight [V_r, H] (and bias [V_r]) this rank's rows, hidden
    [..., H] the same on every rank; the whole rows' loss on every rank,
    and dhidden summed over the ranks (a replicated input's gradient)."""
    from . import _functional as Fn
    red, items, divisor = Fn._reduction(reduction, num_items)
    h, w, b = Fn._head(hidden, weight, bias)
    shard = Shard(process_group, w.shape[0], vocab_start, vocab_size)
    fopts, iopts = O.ce_args(ignore_index, label_smoothing, z_loss, logit_scale,
                             float(softcap or 0.0), temperature, red, items, dft,
                             B.backend_code(backend), num_threads)
    head = LinearCrossEntropyF32 if h.dtype == w.dtype == F32 else LinearCrossEntropy
    loss = head.apply(h, w, b, Fn._index(target).reshape(-1), Fn._f32(token_weight),
                      Fn._f32(class_weight), fopts, iopts, shard, Fn._budget(memory_budget))
    return Fn._finish(loss, None, None, None, hidden.shape[:-1], red, divisor, 0)[0]


def linear_log_probs(hidden, weight, index, *, process_group, bias=None, vocab_start=None,
                     vocab_size=None, temperature=1.0, logit_scale=1.0, softcap=None, mask=None,
                     entropy=False, memory_budget=None, backend="auto", num_threads=0):
    """lmloss.torch.linear_log_probs with the head's rows split over the
    ranks (as linear_cross_entropy): one index a row, in the whole
    vocabulary; the whole rows' log-probs (and entropy) on every rank."""
    from . import _functional as Fn
    h, w, b = Fn._head(hidden, weight, bias)
    lead = hidden.shape[:-1]
    _one_index(index, lead)
    shard = Shard(process_group, w.shape[0], vocab_start, vocab_size)
    logp, ent = LinearLogProbs.apply(h, w, b, Fn._index(index).reshape(-1, 1), Fn._mask(mask),
                                     (float(logit_scale), float(softcap or 0.0),
                                      float(temperature)), bool(entropy), shard,
                                     (B.backend_code(backend), int(num_threads)),
                                     Fn._budget(memory_budget))
    logp = logp.reshape(index.shape)
    return (logp, ent.reshape(lead)) if entropy else logp
