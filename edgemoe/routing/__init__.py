"""Routing, backend-free: who decides which experts a token uses, and what is read ahead.

    modes         the routing modes: what each needs and allows; what a backend asks
    heads_config  the prerouter heads' folder and config, as both backends read them
    between       per-layer fallback written into a heads folder's config (a tool)

What runs a mode lives in its backend: edgemoe.mlx_backend (gates, prerouter, predictors,
conditional, state, driver) and edgemoe.cuda (prerouted). The model side decides; the
store is only told "prefetch these experts for layer l".
"""
