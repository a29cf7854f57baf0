"""lmloss in Hugging Face transformers (opt-in, undone by the paired call).

enable() / disable(): LOSS_MAPPING["ForCausalLM"] becomes for_causal_lm_loss
(the cross-entropy of lmloss.torch on the logits as they come, no fp32
upcast copy) and back. Models read LOSS_MAPPING on each forward, so this
affects every causal LM that uses the default loss.

patch_causal_lm(model) / unpatch(model): the model's forward, when given
labels (or shift_labels), runs the backbone and computes the loss from the
last hidden states and the LM head with lmloss.torch.linear_cross_entropy,
never building the [B, T, V] logits. It respects logits_to_keep (the loss
covers the kept positions), final_logit_softcapping (Gemma-style softcap
c * tanh(x / c)), logit_scale / logits_scaling, tied embeddings (the head
weight is whatever get_output_embeddings() holds, so a tied weight gets
both gradients), ignore_index and num_items_in_batch. A head weight with a
main_grad attribute (the fp32 gradient buffer Megatron- and NeMo-style
frameworks keep beside it) gets its gradient added there, through
linear_cross_entropy's main_grad= (eagerly; under torch.compile it takes
autograd's path). The returned logits
are None in training mode; in eval mode they are computed (for metrics).
Without labels, and for TRL's fused_lm_head=True calls, the original
forward runs unchanged.
"""

import dataclasses
import functools
import inspect
import types
from typing import Any, Optional

import torch
from transformers.loss import loss_utils
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..torch import cross_entropy, linear_cross_entropy

_saved = {}


def _shift(labels, ignore_index, shift_labels):
    if shift_labels is not None:
        return shift_labels
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _reduction(num_items_in_batch):
    return "mean" if num_items_in_batch is None else "sum"


def for_causal_lm_loss(logits: torch.Tensor, labels: Optional[torch.Tensor], vocab_size: int,
                       num_items_in_batch: Optional[Any] = None, ignore_index: int = -100,
                       shift_labels: Optional[torch.Tensor] = None,
                       **kwargs: Any) -> torch.Tensor:
    """transformers.loss.loss_utils.ForCausalLMLoss, computed by lmloss: labels
    shifted left (unless shift_labels is given), mean over non-ignored
    tokens, or sum / num_items_in_batch (a tensor stays on the device)."""
    target = _shift(labels, ignore_index, shift_labels).reshape(-1).to(logits.device)
    return cross_entropy(logits.reshape(-1, vocab_size), target, ignore_index=ignore_index,
                         reduction=_reduction(num_items_in_batch),
                         num_items=num_items_in_batch)


def enable() -> None:
    """Route LOSS_MAPPING["ForCausalLM"] to for_causal_lm_loss."""
    _saved.setdefault("ForCausalLM", loss_utils.LOSS_MAPPING["ForCausalLM"])
    loss_utils.LOSS_MAPPING["ForCausalLM"] = for_causal_lm_loss


def disable() -> None:
    """Restore the LOSS_MAPPING entry enable() replaced."""
    if "ForCausalLM" in _saved:
        loss_utils.LOSS_MAPPING["ForCausalLM"] = _saved.pop("ForCausalLM")


def _head_transform(config):
    """(logit_scale, softcap) of the model's logits, from its config."""
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies
    if scale is None and getattr(config, "logits_scaling", None):  # Granite divides
        scale = 1.0 / config.logits_scaling
    return float(scale or 1.0), float(getattr(config, "final_logit_softcapping", None) or 0.0)


def _keep(t, logits_to_keep):
    if isinstance(logits_to_keep, int):
        return t if logits_to_keep == 0 else t[:, -logits_to_keep:]
    return t[:, logits_to_keep]


_LOSS_KWARGS = ("labels", "shift_labels", "num_items_in_batch", "ignore_index",
                "logits_to_keep", "return_dict")


def patch_causal_lm(model: torch.nn.Module, *,
                    memory_budget: Optional[int] = None) -> torch.nn.Module:
    """Make model's training loss come from the fused head (see the module
    docstring); returns model. Patching twice is a no-op."""
    if "_lmloss_original_forward" in model.__dict__:
        return model
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    if getattr(config, "output_router_logits", False):
        raise NotImplementedError("lmloss: models with router aux losses are not patched")
    scale, softcap = _head_transform(config)
    original = model.forward
    sig = inspect.signature(type(model).forward)
    var_kw = next((n for n, p in sig.parameters.items() if p.kind == p.VAR_KEYWORD), None)
    out_fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}

    @functools.wraps(type(model).forward)
    def forward(self, *args, **kwargs):
        if kwargs.get("fused_lm_head"):
            return original(*args, **kwargs)
        bound = sig.bind(self, *args, **kwargs).arguments
        call = {k: v for k, v in bound.items() if k not in ("self", var_kw)}
        call.update(bound.get(var_kw, {}))
        opt = {k: call.pop(k, None) for k in _LOSS_KWARGS}
        if opt["labels"] is None and opt["shift_labels"] is None:
            return original(*args, **kwargs)
        ignore_index = -100 if opt["ignore_index"] is None else opt["ignore_index"]
        keep = opt["logits_to_keep"] or 0
        out = self.base_model(**call)
        hidden = _keep(out.last_hidden_state, keep)
        target = _shift(opt["labels"], ignore_index, opt["shift_labels"])
        if target.shape[1] != hidden.shape[1]:
            target = _keep(target, keep)
        head = self.get_output_embeddings()
        items = opt["num_items_in_batch"]
        main_grad = None if torch.compiler.is_compiling() else \
            getattr(head.weight, "main_grad", None)
        loss = linear_cross_entropy(hidden, head.weight, target.to(hidden.device),
                                    bias=getattr(head, "bias", None), ignore_index=ignore_index,
                                    logit_scale=scale, softcap=softcap,
                                    reduction=_reduction(items), num_items=items,
                                    memory_budget=memory_budget, main_grad=main_grad)
        logits = None
        if not self.training:
            logits = head(hidden) * scale
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
        rest = {k: v for k, v in out.items() if k in out_fields and k != "logits"}
        result = CausalLMOutputWithPast(loss=loss, logits=logits, **rest)
        return result.to_tuple() if opt["return_dict"] is False else result

    model.__dict__["_lmloss_original_forward"] = model.__dict__.get("forward")
    model.forward = types.MethodType(forward, model)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo patch_causal_lm(model); returns model."""
    if "_lmloss_original_forward" not in model.__dict__:
        return model
    previous = model.__dict__.pop("_lmloss_original_forward")
    if previous is None:
        del model.forward
    else:
        model.forward = previous
    return model
