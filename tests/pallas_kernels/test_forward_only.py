"""The kernels are forward only: differentiating through one raises an error naming it (jax's own
would be "Differentiation rule for 'mpmd_map' not implemented"). The forward values through the
wrapper are what every other kernel test checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from pallas_kernels import tree_attention as ta
from pallas_kernels.forward_only import forward_only


def test_forward_only_keeps_the_value_and_refuses_jvp_grad_and_jit_grad():
  fn = lambda x, w: jnp.tanh(x @ w)
  x, w = jnp.arange(6.0).reshape(2, 3) / 7, jnp.ones((3, 2))
  np.testing.assert_array_equal(forward_only("k", fn, x, w), fn(x, w))
  np.testing.assert_array_equal(jax.jit(lambda x: forward_only("k", fn, x, w))(x), fn(x, w))
  np.testing.assert_array_equal(jax.vmap(lambda r: forward_only("k", fn, r, w))(x), fn(x, w))
  for differentiate in (lambda f: jax.grad(lambda x: f(x).sum())(x), lambda f: jax.jvp(f, (x,), (x,)),
                        lambda f: jax.jit(jax.grad(lambda x: f(x).sum()))(x)):
    with pytest.raises(NotImplementedError, match="k is a forward-only Pallas kernel .* attention_impl='xla'"):
      differentiate(lambda x: forward_only("k", fn, x, w))


def _window():
  return (jnp.zeros((1,), jnp.int32), jnp.full((1,), 5, jnp.int32), jnp.tril(jnp.ones((1, 3, 3), bool)),
          jnp.ones((1, 3), bool))


@pytest.mark.parametrize("name", ["mla_tree_attention", "mha_tree_attention", "moe_experts", "moe_experts_per_row"])
def test_each_kernel_names_itself_when_differentiated(name):
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  if name == "mla_tree_attention":
    c_kv, k_pe, q_rope = normal(2, 100, 64), normal(2, 100, 32), normal(1, 3, 2, 32)
    call = lambda q: ta.mla_tree_attention(q, q_rope, c_kv, k_pe, *_window(), scale=0.1, interpret=True)
    q = normal(1, 3, 2, 64)
  elif name == "mha_tree_attention":
    k, v = normal(2, 100, 1, 64), normal(2, 100, 1, 64)
    call = lambda q: ta.mha_tree_attention(q, k, v, *_window(), scale=0.1, interpret=True)
    q = normal(1, 3, 2, 64)
  else:
    experts = moe.Bf16Experts(*(normal(*s).astype(jnp.bfloat16) * 0.1 for s in ((4, 64, 32), (4, 64, 32), (4, 32, 64))))
    q = normal(2, 64).astype(jnp.bfloat16)
    if name == "moe_experts":
      call = lambda x: moe.moe_experts(x, jnp.asarray([1, 0, 1, 0], jnp.int32), experts, interpret=True)
    else:
      call = lambda x: moe.moe_experts_per_row(x, jnp.asarray([[0], [2]], jnp.int32), experts, interpret=True)
  with pytest.raises(NotImplementedError, match=f"{name} is a forward-only Pallas kernel"):
    jax.grad(lambda x: call(x).astype(jnp.float32).sum())(q)
