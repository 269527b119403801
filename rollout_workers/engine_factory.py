"""Build the worker's inference engine and tokenizer from ``rollout.*`` settings.

``rollout.engine: hf`` runs a local transformers model (``rollout.model_path``, ``device``,
``seed``); ``rollout.engine: sglang`` and ``vllm`` talk to shared servers of that kind
(``rollout.server_urls``, with the timeouts, retries and failover of ``rollout.server``) and
need a tokenizer path (``rollout.tokenizer_path``, else ``rollout.model_path``);
``rollout.engine: custom`` calls ``rollout.engine_factory`` (an import string, ``"pkg.mod:fn"``)
with the ``RolloutConfig`` and uses the ``InferenceEngine`` it returns. Bad settings raise
:class:`~rollstream.config.ConfigError` naming the setting.

:func:`build_follower` picks how the worker follows the trainer's version: an engine it owns
alone is paused, reloaded and resumed by a :class:`VersionFollower`; inference servers, which
workers share, are reloaded by one owner per server (``rollout_workers/weight_sync.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis

from rollstream.api.engine import InferenceEngine
from rollstream.config import ConfigError, RolloutConfig, require
from rollstream.engines.server_engine import ServerEngine
from rollstream.imports import import_callable
from rollstream.state.client import RedisKeys
from rollstream.rollout_workers.version_follower import VersionFollower, VersionSource

log = logging.getLogger(__name__)



def tokenizer_path(config: RolloutConfig) -> str:
    """``rollout.tokenizer_path``, else ``rollout.model_path``; ConfigError when both are empty."""
    path = config.tokenizer_path or config.model_path
    if not path:
        raise ConfigError(
            "invalid configuration: set rollout.tokenizer_path (or rollout.model_path) so the "
            "rollout worker can load a tokenizer"
        )
    return path


def load_tokenizer(config: RolloutConfig) -> Any:
    """The tokenizer the workflows use: ``AutoTokenizer.from_pretrained``, as transformers
    makes it (engines take what its methods return: ``rollstream.engines.request_check``)."""
    from transformers import AutoTokenizer

    path = tokenizer_path(config)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"invalid configuration: cannot load a tokenizer from {path!r}: {exc}") from exc


def build_engine(config: RolloutConfig) -> InferenceEngine:
    """A not yet started engine for ``config`` (call ``start()`` before generating)."""
    if config.weight_transfer == "distributed" and config.engine != "vllm":
        why = ("SGLang servers load checkpoints" if config.engine == "sglang"
               else f"rollout.engine {config.engine!r} loads checkpoints")
        raise ConfigError(f"invalid configuration: rollout.weight_transfer 'distributed' needs rollout.engine 'vllm' "
                          f"(the trainer sends the weights to vLLM servers); {why}: use rollout.weight_transfer: checkpoint")
    if config.engine == "hf":
        require(config.model_path, "rollout.model_path", "must be set when rollout.engine is 'hf'")
        from rollstream.engines.hf import HFEngine

        return HFEngine(config.model_path, device=config.device, seed=config.seed)
    if config.engine in ("sglang", "vllm"):
        require(config.server_urls, "rollout.server_urls",
                f"must list at least one server when rollout.engine is {config.engine!r}")
        return _server_engine_class(config.engine)(config.server_urls, tokenizer_path(config), config.server,
                                                   config.weight_update_mode)
    if config.engine == "custom":
        return _custom_engine(config)
    raise ConfigError(f"invalid configuration: unknown rollout.engine {config.engine!r}")


def _server_engine_class(kind: str) -> type[ServerEngine]:
    """Imported only when chosen: a worker loads the client of its own server kind only."""
    if kind == "sglang":
        from rollstream.engines.sglang import SGLangEngine

        return SGLangEngine
    from rollstream.engines.vllm import VLLMEngine

    return VLLMEngine


def _custom_engine(config: RolloutConfig) -> InferenceEngine:
    spec = config.engine_factory
    require(spec, "rollout.engine_factory", "must be set when rollout.engine is 'custom'")
    engine = import_callable(spec, "rollout.engine_factory")(config)
    if not isinstance(engine, InferenceEngine):
        raise ConfigError(
            f"invalid configuration: rollout.engine_factory {spec!r} returned a {type(engine).__name__}, "
            "not an InferenceEngine"
        )
    log.info("rollout.engine custom: %s from %s", type(engine).__name__, spec)
    return engine


def build_follower(
    config: RolloutConfig, engine: InferenceEngine, store: VersionSource, redis: aioredis.Redis,
    keys: RedisKeys, worker_id: str,
) -> VersionFollower:
    """The version follower for ``engine``: shared-server weight sync for a server engine (SGLang,
    vLLM), else local loads."""
    if not isinstance(engine, ServerEngine):
        return VersionFollower(engine, store)
    from rollstream.state.server_lease import ServerLeases, sync_owner_id
    from rollstream.rollout_workers.weight_sync import SharedServerFollower, WeightSync

    leases = ServerLeases(redis, keys, sync_owner_id(worker_id), engine.settings.lease_ttl_seconds)
    sync = WeightSync([s.url for s in engine.servers], engine.admin, leases, engine.settings,
                      config.weight_update_mode, store.latest_checkpoint)
    return SharedServerFollower(engine, store, sync)


async def load_current_version(engine: InferenceEngine, store: VersionSource) -> int:
    """Load the trainer's current weights into ``engine`` (which this worker owns alone) if Redis
    names any; returns the version. See :meth:`VersionFollower.catch_up`."""
    return await VersionFollower(engine, store).catch_up()
