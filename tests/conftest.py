"""Suite-wide set-up: the Mosaic GPU interpreter's callbacks take numpy arrays (see
``tests/interpret_speedup.py``; the interpret-mode files 928 -> 682 test-seconds, same results, checked by
``tests/test_interpret_speedup.py``)."""

from tests import interpret_speedup

interpret_speedup.install()
