"""lmloss: losses over the LLM vocabulary axis, exact under softmax collapse.

A ctypes binding of liblmloss (include/lmloss.h) for NumPy arrays. Every
function takes logits [..., V] (leading axes are flattened into rows, one C
call), keyword-only options, and `backend` ("auto", "cpu" or "ref": the
float64 reference) and `num_threads` (0 = OpenMP's default). Errors raise
lmloss.Error (a ValueError) with .status, the C status name.

Dtypes: float32 passes through; float64 is computed in float32; bfloat16 is
an ml_dtypes.bfloat16 array or a uint16 array of bf16 bit patterns; float16
is native. Float outputs that have the logits' shape keep the input dtype
for bf16/fp16 (float32 otherwise); per-row results are float32.

The fused linear head (linear_cross_entropy, linear_log_probs and its
backward) takes hidden states [..., H] and the head weight [V, H] (+ bias)
instead of logits and never materializes the [N, V] logits; linear_plan
says its schedule and memory for given shapes. divergence
takes a student's and a teacher's logits [..., V] (KL either way, TRL's
generalized JSD, TVD) and differentiates the student; linear_divergence
the same through two fused heads. linear_dpo_loss is DPOTrainer's loss
from the hidden states of chosen and rejected completions, fused with the
head.
"""

__version__ = "0.1.0"

from . import _lib
from ._ce import CrossEntropyResult, cross_entropy
from ._divergence import DivergenceResult, divergence
from ._grpo import GRPOResult, grpo_loss
from ._lib import Error
from ._lib import path as library_path
from ._linear import (LinearCrossEntropyResult, LinearDivergenceResult, LinearDPOResult,
                      LinearPlan, linear_cross_entropy, linear_divergence, linear_dpo_loss,
                      linear_log_probs, linear_log_probs_backward, linear_plan)
from ._logprob import entropy, log_probs, log_probs_backward, selective_log_softmax
from ._preference import DPOResult, KTOResult, dpo_loss, kto_loss
from ._softmax import log_softmax, softmax, softmax_backward

# The size/version handshake with the library (_lib.check_abi): ImportError
# on a mismatch; True when the library could report its struct sizes.
ABI_CHECKED = _lib.check_abi(__version__)


def has_cuda() -> bool:
    """True when the loaded library has the CUDA backend built in."""
    return bool(_lib.has_cuda())


def cpu_isa() -> str:
    """The CPU kernels' instruction set: "avx512", "avx2" or "portable"."""
    return _lib.cpu_isa().decode()


__all__ = ["CrossEntropyResult", "DivergenceResult", "DPOResult", "Error", "GRPOResult",
           "KTOResult", "LinearCrossEntropyResult", "LinearDivergenceResult", "LinearDPOResult",
           "LinearPlan", "cpu_isa", "cross_entropy", "divergence", "dpo_loss", "entropy",
           "grpo_loss", "has_cuda", "kto_loss", "library_path", "linear_cross_entropy",
           "linear_divergence", "linear_dpo_loss", "linear_log_probs", "linear_log_probs_backward",
           "linear_plan", "log_probs", "log_probs_backward", "log_softmax", "selective_log_softmax",
           "softmax", "softmax_backward", "__version__"]
