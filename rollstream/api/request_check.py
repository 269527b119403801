"""Moved: the request checks are ``rollstream.engines.request_check``, the error they raise is
``rollstream.api.engine.InvalidRequestError``. This module stays only while
``rollstream/engines/hf.py`` still imports from here; delete it once hf.py imports from there."""

from __future__ import annotations

from rollstream.api.engine import InvalidRequestError
from rollstream.engines.request_check import accepted_request

__all__ = ["InvalidRequestError", "accepted_request"]
