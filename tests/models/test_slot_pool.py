"""``models.cache.SlotPool``'s host-side bookkeeping of committed lengths."""

import numpy as np

from models import cache as cache_lib


def test_commits_of_several_slots_at_once_or_of_none():
  pool = cache_lib.SlotPool(4, 64)
  a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
  pool.record_commit([a, c], [5, 7])
  pool.record_commit([], [])  # a step whose rows all left: nothing to record
  pool.record_commit([c, b, a], [1, 2, 3])
  assert [int(pool.lengths[s]) for s in (a, b, c)] == [8, 2, 8]
  pool.release(b)
  assert int(pool.lengths[b]) == 0 and pool.lengths.dtype == np.int64
