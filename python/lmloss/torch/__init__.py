"""lmloss.torch: the lmloss losses on torch tensors (CPU and CUDA), with autograd.

Importing it needs torch; ``import lmloss`` alone does not. Every function
takes the keywords of its NumPy namesake in lmloss (weight= is the
per-class weight, as in torch; per-token weights are token_weight=), and
the names users arrive with: F.cross_entropy's weight= and probability
targets, softmax(x, dim), TRL's selective_log_softmax and
entropy_from_logits, Liger-Kernel's and cut-cross-entropy's softcap=None,
ignore_index and shift=. It returns torch tensors on the
input's device, and is differentiable: the backward calls the C backward
functions, or, for a loss reduced to a scalar whose gradient the forward
formed (cross_entropy, the fused heads), scales that gradient by the
upstream on the device. Tensors are passed to the C library by data_ptr() (row strides
for non-contiguous rows with a contiguous last axis, no copies); CUDA calls
run on torch.cuda.current_stream() and never synchronize the host, except
the fused head's one read of its supervised-row count. Workspaces come from
the caching allocator. Logits may be float32, bfloat16 or float16 (float64
is computed in float32); accumulation is the C library's fp32. A CUDA tensor
with a library built without CUDA raises lmloss.Error (LMLOSS_ERR_UNSUPPORTED).

The divergences of a student's logits from a teacher's (generalized_jsd,
kl_div, tvd: _divergence.py) take TRL's generalized_jsd_loss arguments
and F.kl_div's reductions ("batchmean" by default) rather than lmloss's
reduction names, and are CPU-only for now (the C library's CUDA backend
has no divergence yet: LMLOSS_ERR_UNSUPPORTED). linear_generalized_jsd,
linear_kl_div and linear_tvd (_linear_divergence.py) take them through two
fused heads, a student's and a teacher's, as linear_cross_entropy does.

grpo_loss (_grpo.py) is TRL's GRPOTrainer loss on per-token log-probs,
differentiable w.r.t. them and the entropies, with every GRPOConfig option;
grpo_loss_on_logits the same from the logits, in one pass on CUDA where
the options allow;
dpo_loss and kto_loss (_preference.py) DPOTrainer's and KTOTrainer's on
sequence log-prob sums; linear_dpo_loss (_linear_preference.py) DPOTrainer's
from the hidden states through the fused head, a group of whole pairs at a
time (three GEMMs).

The ops are registered with torch.library (namespace ``lmloss``: see
_ops.py, _linear_ops.py and _div_ops.py) with fake impls from symbolic
shapes, so torch.compile(fullgraph=True) traces them without graph
breaks, and a new batch size under dynamic shapes does not recompile.
Calls made outside any tracing skip torch.library's dispatch (its host
cost per call; _dispatch.py): the same op bodies and autograd formulas
run from a torch.autograd.Function.
"""

from ._divergence import generalized_jsd, kl_div, tvd
from ._grpo import grpo_loss, grpo_loss_on_logits
from ._preference import dpo_loss, kto_loss
from ._functional import (cross_entropy, entropy, entropy_from_logits, linear_cross_entropy,
                          linear_log_probs, linear_plan, log_probs, log_softmax,
                          selective_log_softmax, softmax)
from ._linear_divergence import linear_generalized_jsd, linear_kl_div, linear_tvd
from ._linear_preference import linear_dpo_loss
from ._modules import (CrossEntropyLoss, LinearCrossEntropyLoss, LinearGeneralizedJSD,
                       LinearLogProbs)

__all__ = ["CrossEntropyLoss", "LinearCrossEntropyLoss", "LinearGeneralizedJSD", "LinearLogProbs",
           "cross_entropy", "dpo_loss", "entropy", "entropy_from_logits", "generalized_jsd",
           "grpo_loss", "grpo_loss_on_logits", "kto_loss",
           "kl_div",
           "linear_cross_entropy", "linear_dpo_loss", "linear_generalized_jsd", "linear_kl_div",
           "linear_log_probs",
           "linear_plan", "linear_tvd", "log_probs", "log_softmax", "selective_log_softmax", "softmax", "tvd"]
