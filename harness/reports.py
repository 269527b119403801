"""What a test reports: the ``show_report`` fixture's type (tests/conftest.py), which prints a
test's report text in the session's summary whether the test passed or not."""

from __future__ import annotations

from collections.abc import Callable


ShowReport = Callable[[str], None]
