"""benchmarks/attention_layout.py's previous MLA layout is the same attention as the reference's."""

import jax.numpy as jnp
import numpy as np

from pallas_kernels import reference
from tests.benchmarks import load_benchmark


def test_the_transposed_layout_computes_the_references_attention():
  attention_layout = load_benchmark("attention_layout")
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  batch, q_len = 2, 5
  window = (jnp.asarray([1, 0]), jnp.asarray([3, 9]), jnp.asarray(rng.random((batch, q_len, q_len)) < 0.6),
            jnp.asarray(rng.random((batch, q_len)) < 0.8))
  mla_args = (normal(batch, q_len, 4, 16), normal(batch, q_len, 4, 8), normal(2, 20, 16), normal(2, 20, 8), *window)
  np.testing.assert_allclose(np.asarray(attention_layout.transposed_mla(*mla_args, scale=0.3)),
                             np.asarray(reference.mla_tree_attention(*mla_args, scale=0.3)), atol=1e-6, rtol=0)
