"""Test doubles for services that need hardware or networks the CI machine lacks."""

from tests.fakes.sglang_server import FakeSGLangServer, free_port

__all__ = ["FakeSGLangServer", "free_port"]
