"""Builders of ``scored`` messages for the grouping and batch tests (no tests here)."""

from __future__ import annotations




