"""Draft trees flattened for one verify forward, and the one owner of the tree mask convention.

Convention (used by the attention reference, the Pallas kernel and every policy):
  * node 0 is the root (the previous bonus token at position ``start``); node i sits at
    ``start + depth[i]``; parents come before children;
  * ``visibility[b, i, j]`` is True iff node j is node i or an ancestor of node i;
  * ``valid[b, i]`` marks real nodes. The effective window mask (``window_mask``) hides padded
    columns from real rows and lets a padded row see only itself, so no row is ever all-masked.
"""

import dataclasses

import jax
import jax.numpy as jnp


def window_mask(visibility, valid):
  """Effective attention mask over the tree window.

  Args:
    visibility: bool[B, Q, Q], True where row i may see window column j (ancestor-or-self).
    valid: bool[B, Q], real nodes.
  Returns:
    bool[B, Q, Q]: real rows see visible, valid columns; padded rows see only themselves.
  """
  q_len = visibility.shape[-1]
  eye = jnp.eye(q_len, dtype=bool)
  real = visibility & valid[:, None, :] & valid[:, :, None]
  return jnp.where(valid[:, :, None], real, eye[None])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
  """A batch of draft trees flattened to ``Q = budget + 1`` rows (all arrays ``[B, Q]`` unless noted).

  Attributes:
    tokens: int32, node tokens; node 0 is the root (the previous bonus token).
    parents: int32, parent node index; -1 for the root and for padded rows.
    depth: int32, 0 for the root; padded rows carry 0.
    positions: int32, ``start + depth`` (padded rows: ``start``, a valid position).
    visibility: bool[B, Q, Q], ancestor-or-self relation (padded rows: only themselves).
    valid: bool, real nodes. Token id 0 is a real token: padding is only ever read from here.
  """

  tokens: jax.Array
  parents: jax.Array
  depth: jax.Array
  positions: jax.Array
  visibility: jax.Array
  valid: jax.Array

  @property
  def batch_size(self) -> int:
    return self.tokens.shape[0]

  @property
  def q_len(self) -> int:
    return self.tokens.shape[1]
