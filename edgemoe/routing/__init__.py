"""Routing: who decides which experts a token uses, and what is read ahead.

    gates       a block's routing by its own code from logits; RouterTap (prerouted modes)
    prerouter   the heads that predict the next layer's routing a token ahead
    predictors  next-router baseline, heads (advisory), prerouted
    state       routing state of a sequence, kept beside its KV cache
    modes       the routing modes: what each needs and allows, its predictor
    driver      runs a mode's predictor: the model calls it at each MoE layer

The model side decides; the store is only told "prefetch these experts for layer l".
"""
