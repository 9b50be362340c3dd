"""The kernels have no derivative rules: differentiating through one names it instead of failing in
jax's internals (``Differentiation rule for 'mpmd_map' not implemented``)."""

import jax


def forward_only(name: str, fn, *args):
  """``fn(*args)``; any JVP or gradient of it with respect to ``args`` raises a NotImplementedError
  that names the kernel ``name`` and the plain-jnp path to differentiate instead.

  ``args`` are the inputs a caller may differentiate (queries, weights, activations); ``fn`` may
  close over the rest (integer metadata, static options).
  """

  @jax.custom_jvp
  def call(*inputs):
    return fn(*inputs)

  @call.defjvp
  def _no_derivative(primals, tangents):
    del primals, tangents
    raise NotImplementedError(
        f"{name} is a forward-only Pallas kernel (no gradient or JVP): differentiate the plain-jnp "
        "path instead (the model's attention_impl='xla' / moe_impl='xla')")

  return call(*args)
