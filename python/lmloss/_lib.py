"""Loading liblmloss.so and mirroring include/lmloss.h with ctypes.

The library is looked up, in order, at:
  1. the path in the environment variable LMLOSS_LIBRARY (when set, only
     there);
  2. the package directory (``pip install .`` puts it in ``lmloss/lib/``);
  3. the build tree ``<repo>/build/`` (for ``PYTHONPATH=python``).

The structs below mirror the C structs field by field (enums are C ints);
ctypes applies the same natural alignment as the C compiler. check_abi,
called by the package when it loads, holds them to the library's sizes
(lmloss_struct_size, where the library has it) and the library's version
to the package's.
"""

import ctypes
import operator
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_NAME = "liblmloss.so"


def _candidates():
    env = os.environ.get("LMLOSS_LIBRARY")
    if env:  # an explicit choice: the only candidate
        yield env
        return
    yield os.path.join(_HERE, _NAME)
    yield os.path.join(_HERE, "lib", _NAME)
    yield os.path.join(os.path.dirname(os.path.dirname(_HERE)), "build", _NAME)


def _load():
    tried = []
    for path in _candidates():
        if os.path.isfile(path):
            return ctypes.CDLL(path), path
        tried.append(path)
    raise ImportError("lmloss: cannot find %s; looked at: %s (set LMLOSS_LIBRARY to its path)"
                      % (_NAME, ", ".join(tried)))


lib, path = _load()

# Enum values, pinned by lmloss.h.
F32, BF16, F16, F64, I32, I64, BOOL = range(7)
CPU_DEVICE = 0
BACKENDS = {"auto": 0, "ref": 1, "cpu": 2}
REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}
REDUCE_SUM_OVER_ITEMS = 3
DIV_KINDS = {"kl": 0, "reverse_kl": 1, "jsd": 2, "tvd": 3}  # lmloss_divergence_kind
# lmloss_grpo_loss_type and lmloss_grpo_level; LMLOSS_GRPO_METRICS floats of metrics
GRPO_LOSS_TYPES = {"grpo": 0, "bnpo": 1, "dr_grpo": 2, "dapo": 3, "cispo": 4, "sapo": 5,
                   "luspo": 6, "vespo": 7}
GRPO_LEVELS = {"token": 0, "sequence": 1}
GRPO_IS_MODES = {None: 0, "token_truncate": 1, "token_mask": 2, "sequence_truncate": 3,
                 "sequence_mask": 4}  # vllm_importance_sampling_mode
GRPO_METRICS = 16
# lmloss_pref_type (index = C code), lmloss_pref_fdiv; LMLOSS_PREF_METRICS floats of metrics
PREF_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
              "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
              "cpo_sigmoid", "simpo", "cpo_ipo", "orpo")
PREF_FDIVS = {"reverse_kl": 0, "forward_kl": 1, "js_divergence": 2, "alpha_divergence": 3,
              "alphapo": 4}
PREF_METRICS = 8
KTO_TYPES = {"kto": 0, "apo_zero_unpaired": 1}  # lmloss_kto_type
KTO_METRICS = 8

_c_int64 = ctypes.c_int64


class Tensor(ctypes.Structure):
    """lmloss_tensor: a row-major [rows, cols] view with row_stride elements."""
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int), ("device", ctypes.c_int),
                ("rows", _c_int64), ("cols", _c_int64), ("row_stride", _c_int64)]


class Context(ctypes.Structure):
    _fields_ = [("backend", ctypes.c_int), ("stream", ctypes.c_void_p),
                ("num_threads", ctypes.c_int)]


class Transform(ctypes.Structure):
    _fields_ = [("logit_scale", ctypes.c_float), ("softcap", ctypes.c_float),
                ("temperature", ctypes.c_float)]


class CEOptions(ctypes.Structure):
    _fields_ = [("ignore_index", _c_int64), ("label_smoothing", ctypes.c_float),
                ("z_loss", ctypes.c_float), ("transform", Transform),
                ("reduction", ctypes.c_int), ("num_items", ctypes.c_double),
                ("dft", ctypes.c_int), ("grad_output", ctypes.c_float),
                ("zero_ignored_rows", ctypes.c_int)]


class CEInputs(ctypes.Structure):
    _fields_ = [("logits", Tensor), ("target", Tensor), ("token_weight", Tensor),
                ("class_weight", Tensor)]


class CEOutputs(ctypes.Structure):
    _fields_ = [("loss", Tensor), ("lse", Tensor), ("entropy", Tensor), ("argmax", Tensor),
                ("dlogits", Tensor)]


class DivOptions(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("beta", ctypes.c_float), ("student", Transform),
                ("teacher", Transform), ("soft_weight", ctypes.c_float),
                ("hard_weight", ctypes.c_float), ("ignore_index", _c_int64),
                ("reduction", ctypes.c_int), ("num_items", ctypes.c_double),
                ("grad_output", ctypes.c_float)]


class DivInputs(ctypes.Structure):
    _fields_ = [("student", Tensor), ("teacher", Tensor), ("label", Tensor)]


class DivOutputs(ctypes.Structure):
    _fields_ = [("loss", Tensor), ("divergence", Tensor), ("ce", Tensor), ("dstudent", Tensor),
                ("entropy", Tensor)]


class GRPOOptions(ctypes.Structure):
    _fields_ = [("loss_type", ctypes.c_int), ("level", ctypes.c_int),
                ("epsilon_low", ctypes.c_double), ("epsilon_high", ctypes.c_double),
                ("delta", ctypes.c_double), ("beta", ctypes.c_double),
                ("bias_correction_kl", ctypes.c_int), ("sapo_temperature_pos", ctypes.c_double),
                ("sapo_temperature_neg", ctypes.c_double), ("vespo_k_pos", ctypes.c_double),
                ("vespo_lambda_pos", ctypes.c_double), ("vespo_k_neg", ctypes.c_double),
                ("vespo_lambda_neg", ctypes.c_double), ("off_policy_mask", ctypes.c_int),
                ("off_policy_threshold", ctypes.c_double), ("entropy_coef", ctypes.c_double),
                ("accumulation_steps", ctypes.c_double), ("max_completion_length", _c_int64),
                ("num_items", ctypes.c_double), ("is_mode", ctypes.c_int),
                ("is_min", ctypes.c_double), ("is_max", ctypes.c_double)]


class GRPOInputs(ctypes.Structure):
    _fields_ = [("logp", Tensor), ("mask", Tensor), ("advantages", Tensor), ("old_logp", Tensor),
                ("ref_logp", Tensor), ("sampling_logp", Tensor), ("is_ratio", Tensor),
                ("entropy", Tensor), ("entropy_threshold", Tensor), ("num_items", Tensor)]


class GRPOOutputs(ctypes.Structure):
    _fields_ = [("loss", Tensor), ("metrics", Tensor), ("dlogp", Tensor), ("dentropy", Tensor)]


class PrefOptions(ctypes.Structure):
    _fields_ = [("loss_weights", ctypes.c_double * 19), ("beta", ctypes.c_double),
                ("label_smoothing", ctypes.c_double), ("f_divergence", ctypes.c_int),
                ("f_alpha", ctypes.c_double), ("discopop_tau", ctypes.c_double),
                ("simpo_gamma", ctypes.c_double)]


class PrefInputs(ctypes.Structure):
    _fields_ = [("chosen", Tensor), ("rejected", Tensor), ("ref_chosen", Tensor),
                ("ref_rejected", Tensor), ("chosen_tokens", Tensor), ("rejected_tokens", Tensor),
                ("weight", Tensor)]


class PrefOutputs(ctypes.Structure):
    _fields_ = [("loss", Tensor), ("metrics", Tensor), ("dchosen", Tensor),
                ("drejected", Tensor), ("pair_loss", Tensor)]


class LinearPrefInputs(ctypes.Structure):
    _fields_ = [("pairs", _c_int64), ("ref_chosen", Tensor), ("ref_rejected", Tensor),
                ("weight", Tensor), ("average", ctypes.c_int)]


class LinearPrefOutputs(ctypes.Structure):
    _fields_ = [("loss", Tensor), ("metrics", Tensor), ("pair_loss", Tensor), ("chosen", Tensor),
                ("rejected", Tensor), ("logp", Tensor)]


class KTOOptions(ctypes.Structure):
    _fields_ = [("loss_type", ctypes.c_int), ("beta", ctypes.c_double),
                ("desirable_weight", ctypes.c_double), ("undesirable_weight", ctypes.c_double)]


class KTOInputs(ctypes.Structure):
    _fields_ = [("logps", Tensor), ("ref_logps", Tensor), ("label", Tensor), ("kl", Tensor)]


class KTOOutputs(ctypes.Structure):
    _fields_ = [("loss", Tensor), ("metrics", Tensor), ("dlogps", Tensor)]


class Head(ctypes.Structure):
    """lmloss_head: hidden [N, H], weight [V, H], optional bias [V]."""
    _fields_ = [("hidden", Tensor), ("weight", Tensor), ("bias", Tensor)]


class HeadOptions(ctypes.Structure):
    _fields_ = [("memory_budget", ctypes.c_size_t), ("fp32_accumulate", ctypes.c_int)]


class HeadPlan(ctypes.Structure):
    _fields_ = [("workspace_bytes", ctypes.c_size_t), ("chunk_rows", ctypes.c_int64),
                ("group_rows", ctypes.c_int64), ("store_bytes", ctypes.c_size_t),
                ("accumulator_bytes", ctypes.c_size_t), ("logits_gemms", ctypes.c_int),
                ("store_in_dweight", ctypes.c_int)]


class HeadGrads(ctypes.Structure):
    _fields_ = [("dhidden", Tensor), ("dweight", Tensor), ("dbias", Tensor),
                ("accumulate", ctypes.c_int)]


# The mirrored structs by their C names: checked against the library when it
# loads (check_abi). A module mirroring another struct adds it here.
STRUCTS = {"lmloss_tensor": Tensor, "lmloss_context": Context, "lmloss_transform": Transform,
           "lmloss_ce_options": CEOptions, "lmloss_ce_inputs": CEInputs,
           "lmloss_ce_outputs": CEOutputs, "lmloss_div_options": DivOptions,
           "lmloss_div_inputs": DivInputs, "lmloss_div_outputs": DivOutputs, "lmloss_head": Head,
           "lmloss_head_options": HeadOptions, "lmloss_head_grads": HeadGrads,
           "lmloss_grpo_options": GRPOOptions, "lmloss_grpo_inputs": GRPOInputs,
           "lmloss_grpo_outputs": GRPOOutputs, "lmloss_pref_options": PrefOptions,
           "lmloss_pref_inputs": PrefInputs, "lmloss_pref_outputs": PrefOutputs,
           "lmloss_kto_options": KTOOptions, "lmloss_kto_inputs": KTOInputs,
           "lmloss_kto_outputs": KTOOutputs, "lmloss_linear_pref_inputs": LinearPrefInputs,
           "lmloss_linear_pref_outputs": LinearPrefOutputs}

_P = ctypes.POINTER
_status = ctypes.c_int


def _proto(name, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


context_default = _proto("lmloss_context_default", Context)
transform_default = _proto("lmloss_transform_default", Transform)
ce_options_default = _proto("lmloss_ce_options_default", CEOptions)
ce_workspace_size = _proto("lmloss_cross_entropy_workspace_size", ctypes.c_size_t, _c_int64)
cross_entropy = _proto("lmloss_cross_entropy", _status, _P(Context), _P(CEInputs),
                       _P(CEOptions), _P(CEOutputs), ctypes.c_void_p, ctypes.c_size_t)
log_probs = _proto("lmloss_log_probs", _status, _P(Context), _P(Tensor), _P(Tensor), _P(Tensor),
                   _P(Transform), _P(Tensor), _P(Tensor), _P(Tensor))
log_probs_backward = _proto("lmloss_log_probs_backward", _status, _P(Context), _P(Tensor),
                            _P(Tensor), _P(Tensor), _P(Transform), _P(Tensor), _P(Tensor),
                            _P(Tensor), _P(Tensor))
ROW_STATS = 4  # LMLOSS_ROW_STATS: the floats a row's saved statistics take
STATS_MAX_V = 1 << 24  # they hold the argmax's column as a float
entropy = _proto("lmloss_entropy", _status, _P(Context), _P(Tensor), _P(Transform), _P(Tensor))
softmax = _proto("lmloss_softmax", _status, _P(Context), _P(Tensor), ctypes.c_int, _P(Tensor))
softmax_backward = _proto("lmloss_softmax_backward", _status, _P(Context), _P(Tensor),
                          _P(Tensor), ctypes.c_int, _P(Tensor))
div_options_default = _proto("lmloss_div_options_default", DivOptions)
divergence = _proto("lmloss_divergence", _status, _P(Context), _P(DivInputs), _P(DivOptions),
                    _P(DivOutputs), ctypes.c_void_p, ctypes.c_size_t)
divergence_backward = _proto("lmloss_divergence_backward", _status, _P(Context), _P(DivInputs),
                             _P(DivOptions), _P(Tensor), _P(Tensor), ctypes.c_void_p,
                             ctypes.c_size_t)
grpo_options_default = _proto("lmloss_grpo_options_default", GRPOOptions)
grpo_workspace_size = _proto("lmloss_grpo_workspace_size", ctypes.c_size_t, _c_int64)
grpo = _proto("lmloss_grpo", _status, _P(Context), _P(GRPOInputs), _P(GRPOOptions),
              _P(GRPOOutputs), ctypes.c_void_p, ctypes.c_size_t)
grpo_logits_workspace_size = _proto("lmloss_grpo_logits_workspace_size", ctypes.c_size_t,
                                    _c_int64, _c_int64)
grpo_logits = _proto("lmloss_grpo_logits", _status, _P(Context), _P(Tensor), _P(Tensor),
                     _P(Transform), _P(GRPOInputs), _P(GRPOOptions), _P(GRPOOutputs),
                     _P(Tensor), ctypes.c_void_p, ctypes.c_size_t)
grpo_backward = _proto("lmloss_grpo_backward", _status, _P(Context), _P(GRPOInputs),
                       _P(GRPOOptions), _P(Tensor), _P(Tensor), _P(Tensor), ctypes.c_void_p,
                       ctypes.c_size_t)
pref_options_default = _proto("lmloss_pref_options_default", PrefOptions)
pref_workspace_size = _proto("lmloss_preference_workspace_size", ctypes.c_size_t, _c_int64)
preference = _proto("lmloss_preference", _status, _P(Context), _P(PrefInputs), _P(PrefOptions),
                    _P(PrefOutputs), ctypes.c_void_p, ctypes.c_size_t)
kto_options_default = _proto("lmloss_kto_options_default", KTOOptions)
kto = _proto("lmloss_kto", _status, _P(Context), _P(KTOInputs), _P(KTOOptions), _P(KTOOutputs))
head_options_default = _proto("lmloss_head_options_default", HeadOptions)
linear_workspace_size = _proto("lmloss_linear_workspace_size", _status, _P(Head),
                               _P(HeadOptions), _P(HeadGrads), _c_int64, _P(ctypes.c_size_t))
linear_cross_entropy = _proto("lmloss_linear_cross_entropy", _status, _P(Context), _P(Head),
                              _P(Tensor), _P(Tensor), _P(Tensor), _P(CEOptions), _P(HeadOptions),
                              _P(CEOutputs), _P(HeadGrads), ctypes.c_void_p, ctypes.c_size_t)
linear_cross_entropy_backward = _proto("lmloss_linear_cross_entropy_backward", _status,
                                       _P(Context), _P(Head), _P(Tensor), _P(Tensor), _P(Tensor),
                                       _P(CEOptions), _P(HeadOptions), _P(Tensor), _P(HeadGrads),
                                       ctypes.c_void_p, ctypes.c_size_t)
linear_log_probs = _proto("lmloss_linear_log_probs", _status, _P(Context), _P(Head), _P(Tensor),
                          _P(Tensor), _P(Transform), _P(HeadOptions), _P(Tensor), _P(Tensor),
                          _P(Tensor), ctypes.c_void_p, ctypes.c_size_t)
linear_log_probs_backward = _proto("lmloss_linear_log_probs_backward", _status, _P(Context),
                                   _P(Head), _P(Tensor), _P(Tensor), _P(Transform),
                                   _P(HeadOptions), _P(Tensor), _P(Tensor), _P(Tensor),
                                   _P(HeadGrads), ctypes.c_void_p, ctypes.c_size_t)
linear_log_probs_keep_size = _proto("lmloss_linear_log_probs_keep_size", _status, _P(Head),
                                    _P(HeadOptions), _P(ctypes.c_size_t))
linear_log_probs_keep = _proto("lmloss_linear_log_probs_keep", _status, _P(Context), _P(Head),
                               _P(Tensor), _P(Tensor), _P(Transform), _P(HeadOptions),
                               _P(Tensor), _P(Tensor), ctypes.c_void_p, ctypes.c_size_t)
linear_log_probs_backward_kept = _proto("lmloss_linear_log_probs_backward_kept", _status,
                                        _P(Context), _P(Head), _P(Tensor), _P(Tensor),
                                        _P(Transform), _P(HeadOptions), _P(Tensor),
                                        _P(HeadGrads), ctypes.c_void_p, ctypes.c_size_t)
linear_preference_size = _proto("lmloss_linear_preference_size", _status, _P(Head),
                                _P(HeadOptions), _P(HeadGrads), _c_int64, _P(PrefOptions),
                                _P(ctypes.c_size_t))
linear_preference = _proto("lmloss_linear_preference", _status, _P(Context), _P(Head), _P(Tensor),
                           _P(Tensor), _P(Transform), _P(HeadOptions), _P(LinearPrefInputs),
                           _P(PrefOptions), _P(LinearPrefOutputs), _P(HeadGrads),
                           ctypes.c_void_p, ctypes.c_size_t)
linear_divergence_workspace_size = _proto("lmloss_linear_divergence_workspace_size", _status,
                                          _P(Head), _P(Head), _P(HeadOptions),
                                          _P(ctypes.c_size_t))
linear_divergence = _proto("lmloss_linear_divergence", _status, _P(Context), _P(Head), _P(Head),
                           _P(Tensor), _P(DivOptions), _P(HeadOptions), _P(DivOutputs),
                           _P(HeadGrads), ctypes.c_void_p, ctypes.c_size_t)
linear_divergence_backward = _proto("lmloss_linear_divergence_backward", _status, _P(Context),
                                    _P(Head), _P(Head), _P(Tensor), _P(DivOptions),
                                    _P(HeadOptions), _P(Tensor), _P(HeadGrads), ctypes.c_void_p,
                                    ctypes.c_size_t)
linear_scale_grads = _proto("lmloss_linear_scale_grads", _status, _P(Context), _P(Head),
                            _P(HeadGrads), _P(Tensor))
linear_plan = _proto("lmloss_linear_plan", _status, _P(Head), _P(HeadOptions), _P(HeadGrads),
                     ctypes.c_int64, _P(HeadPlan))
scale = _proto("lmloss_scale", _status, _P(Context), _P(Tensor), _P(Tensor))
status_string = _proto("lmloss_status_string", ctypes.c_char_p, ctypes.c_int)
last_error = _proto("lmloss_last_error", ctypes.c_char_p)
has_cuda = _proto("lmloss_has_cuda", ctypes.c_int)
cpu_isa = _proto("lmloss_cpu_isa", ctypes.c_char_p)


version = _proto("lmloss_version", ctypes.c_int)


def struct_size_fn(library=None):
    """The library's size_t lmloss_struct_size(const char *name) (sizeof the
    public struct of that name, 0 for a name it does not know), or None
    where the library predates it."""
    library = lib if library is None else library
    if not hasattr(library, "lmloss_struct_size"):
        return None
    fn = library.lmloss_struct_size
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_char_p]
    return fn


def struct_mismatches(size_of, structs=None):
    """[(C name, ctypes size, library size)] of the mirrors whose size differs
    from the library's (size_of: name bytes -> size; 0 = unknown there)."""
    bad = []
    for name, cls in (STRUCTS if structs is None else structs).items():
        got = int(size_of(name.encode()))
        if got != ctypes.sizeof(cls):
            bad.append((name, ctypes.sizeof(cls), got))
    return bad


def register_struct(name, cls):
    """Add a ctypes mirror of struct `name` to STRUCTS (a module that mirrors
    one more, e.g. lmloss_shard) and hold it to the library's size now
    (ImportError on a mismatch) where the library reports sizes."""
    STRUCTS[name] = cls
    fn = struct_size_fn()
    bad = struct_mismatches(fn, {name: cls}) if fn is not None else []
    if bad:
        raise ImportError("lmloss: the ctypes mirror of %s is %d bytes here, %d in %s"
                          % (bad[0] + (path,)))
    return cls


def check_abi(package_version, library=None):
    """The handshake when the library loads: its version (lmloss_version())
    is the package's MAJOR.MINOR, and, where it has lmloss_struct_size,
    every ctypes mirror of a struct in STRUCTS has the C struct's size.
    Raises ImportError naming the difference. Returns whether the sizes
    were checked."""
    major, minor = (int(p) for p in package_version.split(".")[:2])
    have = version()
    if (have // 10000, have // 100 % 100) != (major, minor):
        raise ImportError("lmloss: %s is version %d.%d.%d but this package is %s; their ABIs "
                          "differ (set LMLOSS_LIBRARY to a matching build)"
                          % (path, have // 10000, have // 100 % 100, have % 100,
                             package_version))
    fn = struct_size_fn(library)
    if fn is None:
        return False
    bad = struct_mismatches(fn)
    if bad:
        raise ImportError("lmloss: the ctypes mirrors of lmloss.h's structs differ from %s: %s"
                          % (path, ", ".join("%s is %d bytes here, %d there" % b for b in bad)))
    return True


class Error(ValueError):
    """A call into lmloss failed. ``status`` is the C status name (for
    example ``"LMLOSS_ERR_INDEX_OUT_OF_RANGE"``); str() adds the C message."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__("%s: %s" % (status, message))
        self.status = status
        self.message = message


def check(status):
    """Raise Error for a non-OK status, with lmloss_last_error()'s message.
    Must run on the calling thread right after the call (the message is
    thread-local; ctypes calls run on the calling thread)."""
    if status != 0:
        raise Error(status_string(status).decode(), last_error().decode())


def make_context(backend, num_threads):
    """lmloss_context for backend "auto", "cpu" or "ref" and num_threads."""
    if backend not in BACKENDS:
        raise Error("LMLOSS_ERR_BAD_OPTION",
                    "backend must be one of %s, got %r" % (sorted(BACKENDS), backend))
    ctx = context_default()
    ctx.backend = BACKENDS[backend]
    ctx.num_threads = int_option("num_threads", num_threads)
    return ctx


def int_option(name, value):
    """An option the C library takes as an int: as int64_option, within int's range."""
    v = int64_option(name, value)
    if not -(1 << 31) <= v < (1 << 31):
        raise Error("LMLOSS_ERR_BAD_OPTION", "%s = %d does not fit a C int" % (name, v))
    return v


_I64 = (-(1 << 63), (1 << 63) - 1)


def int64_option(name, value):
    """An integer option as a C int64: an int (not a float) within int64's
    range, else Error(LMLOSS_ERR_BAD_OPTION); never wrapped."""
    try:
        v = operator.index(value)
    except TypeError:
        raise Error("LMLOSS_ERR_BAD_OPTION", "%s must be an integer, got %r" % (name, value))
    if not _I64[0] <= v <= _I64[1]:
        raise Error("LMLOSS_ERR_BAD_OPTION", "%s = %d does not fit int64" % (name, v))
    return v


def float_option(name, value):
    """A real option as a Python float, else Error(LMLOSS_ERR_BAD_OPTION)
    (the C library checks its range)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise Error("LMLOSS_ERR_BAD_OPTION", "%s must be a real number, got %r" % (name, value))


def softcap_value(softcap):
    """The C softcap of a softcap keyword: None (Liger-Kernel's and
    cut-cross-entropy's "off") is 0."""
    return 0.0 if softcap is None else float_option("softcap", softcap)


def make_transform(logit_scale=1.0, softcap=None, temperature=1.0):
    """lmloss_transform; softcap None (or 0) is off."""
    tr = transform_default()
    tr.logit_scale = float_option("logit_scale", logit_scale)
    tr.softcap = softcap_value(softcap)
    tr.temperature = float_option("temperature", temperature)
    return tr
