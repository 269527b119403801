"""compose.yaml read as docker compose renders it, and its rollstream services."""

from __future__ import annotations

from pathlib import Path
import re
from typing import Any

import yaml



ROOT = Path(__file__).resolve().parents[1]


COMPOSE = ROOT / "compose.yaml"


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env or {})


def rollstream_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services that run the rollstream image (built from the root Dockerfile)."""
    return {name: s for name, s in compose["services"].items()
            if "build" in s and "dockerfile" not in s["build"]}


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose's ``${NAME}`` / ``${NAME:-default}`` substitution, from ``env`` else the default."""
    if isinstance(node, str):
        return _VARIABLE.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), node)
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    return node


ENV_FILE = ROOT / "deploy" / "kafka3.env"


NODES = ("kafka", "kafka-2", "kafka-3")


def env_file() -> dict[str, str]:
    pairs = [line.split("=", 1) for line in ENV_FILE.read_text().splitlines() if line and not line.startswith("#")]
    return {key.strip(): value.strip() for key, value in pairs}


def kafka3() -> dict:
    return load_compose(env_file())
