"""Suite-wide set-up: the Mosaic GPU interpreter's callbacks take numpy arrays (see
``tests/interpret_speedup.py``; about twice as fast, same results, checked by
``tests/test_interpret_speedup.py``)."""

from tests import interpret_speedup

interpret_speedup.install()
