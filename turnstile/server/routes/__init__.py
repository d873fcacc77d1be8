"""HTTP routes, one module per surface."""
