"""Pallas GPU kernels and their jnp references (filled in by the kernels issue)."""
