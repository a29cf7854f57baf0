"""Opt-in drop-ins of lmloss into training libraries (each needs torch).

- lmloss.integrations.transformers: enable()/disable() put a
  ForCausalLMLoss-compatible loss into transformers' LOSS_MAPPING;
  patch_causal_lm(model)/unpatch(model) make a causal LM compute its
  training loss from the last hidden states through the fused head.
- lmloss.integrations.trl: selective_log_softmax / entropy_from_logits
  replacements and the fused head behind TRL's add_fused_lm_head;
  enable()/disable() patch trl.trainer.utils (or a given module).
"""
