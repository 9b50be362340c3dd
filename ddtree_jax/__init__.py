"""DDTree speculative decoding for Kimi K2.6 in JAX.

Submodules are imported explicitly (``from ddtree_jax import tree``); this package imports nothing
eagerly so that ``models`` and ``pallas_kernels`` can depend on ``ddtree_jax.tree`` without cycles.
"""

__version__ = "0.1.0"
