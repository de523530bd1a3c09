"""The decision model for speculative decoding on offloaded MoE models (pure numpy, never torch).

Draft trees, expert bitsets, the one cycle cost model, acceptance estimates, expert caches,
expert predictors and tree policies (autoregressive, chain, top-N, SpecFit exact search).
See DESIGN.md for the map; every other package imports from here, never the other way.
"""
