"""SimPy discrete-event replay of dense traces across bandwidths, caches and policies (`python -m sim.sweep`)."""
