"""Race detection for every kernel a test runs in Mosaic GPU interpret mode.

The interpreter keeps one race-detection state per kernel launch (``get_races()`` returns only the
last one), so a call that runs several kernels (attention then merge; gate/up, fold, down) would
hide a race in all but the last. Every state created during a test is recorded here and checked
when the test ends (and by ``races_found`` at any point inside it).
"""

import pytest
from jax._src.pallas.mosaic_gpu.interpret import race_detection_state

RACE_STATES: list = []


def races_found() -> bool:
  """Whether any kernel run in interpret mode since the current test began reported a race."""
  return any(state.races_found for state in RACE_STATES)


@pytest.fixture(autouse=True)
def no_interpreter_races(monkeypatch):
  original = race_detection_state.GPURaceDetectionState.__init__

  def record(self, *args, **kwargs):
    original(self, *args, **kwargs)
    RACE_STATES.append(self)

  RACE_STATES.clear()
  monkeypatch.setattr(race_detection_state.GPURaceDetectionState, "__init__", record)
  yield
  found = races_found()
  RACE_STATES.clear()
  assert not found, "the GPU interpreter reported a data race in one of this test's kernels"
