"""One configuration schema for every tier: YAML file, then environment, then ``--set``.

Unknown keys are errors (with the path of the offending key), never silently ignored.
Environment: ``KAFKA_BOOTSTRAP_SERVERS``, ``REDIS_URL``, and any ``ROLLSTREAM__SECTION__KEY``
(double underscores separate the path, e.g. ``ROLLSTREAM__ROLLOUT__MAX_CONCURRENT_ROLLOUTS=8``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml


class ConfigError(ValueError):
    """A configuration that cannot be loaded or does not validate."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class KafkaConfig(_Section):
    bootstrap_servers: str = "127.0.0.1:9092"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: str | None = None
    client_id_prefix: str = "rollstream"
    partitions: int = 4  # partitions for topics this project creates
    replication_factor: int = 1
    max_message_bytes: int = 16 * 1024 * 1024
    transaction_timeout_ms: int = 60_000
    request_timeout_ms: int = 40_000
    # Request batching (aiokafka's meaning). Larger batches did not lower the broker's CPU on
    # the benchmark machine (bench/README.md), so the defaults favour latency.
    linger_ms: int = 5  # producers wait this long to fill a batch before sending
    fetch_min_bytes: int = 1  # the broker holds a fetch until this much data is ready...
    fetch_max_wait_ms: int = 500  # ...or this long has passed


class RedisConfig(_Section):
    url: str = "redis://127.0.0.1:6379/0"
    username: str | None = None
    password: str | None = None


class ExperimentConfig(_Section):
    experiment_name: str = "default"
    trial_name: str = "trial0"


class StalenessConfig(_Section):
    max_head_offpolicyness: int = 0  # eta: versions a token may lag behind the trainer
    batch_size: int = 8  # prompts (groups) per trainer step
    enabled: bool = True


class ProducerConfig(_Section):
    dataset: str = ""
    dataset_format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    split: str = "train"
    shuffle: bool = False
    seed: int = 0
    epochs: int = 1
    group_size: int = 4
    is_eval: bool = False
    workflow: str | None = None
    max_prompts: int | None = None
    producer_id: str = "producer-0"
    admission_poll_seconds: float = 0.5
    max_batch_prompts: int = 64  # prompts per Kafka transaction at most
    batch_linger_ms: int = 50  # commit a partial batch once its first prompt waited this long
    progress_every: int = 100  # log progress every this many published prompts


class WorkflowSpec(_Section):
    path: str  # import string of a RolloutWorkflow class, instance or agent
    kwargs: dict[str, Any] = {}


class RolloutConfig(_Section):
    engine: Literal["hf", "sglang", "custom"] = "hf"
    # engine "custom": import string of a callable taking this RolloutConfig and returning an
    # InferenceEngine (not started), e.g. "my_pkg.engines:make_engine"; configuration only
    engine_factory: str = ""
    model_path: str = ""
    tokenizer_path: str | None = None
    sglang_urls: list[str] = []
    device: str = "cpu"
    seed: int | None = None
    max_concurrent_rollouts: int = 8
    workflows: dict[str, WorkflowSpec] = {}
    default_workflow: str = "rlvr"
    gconfig: dict[str, Any] = {}
    worker_id: str = ""
    dump_to_file: bool = False
    fileroot: str = "runs/dumps"
    shutdown_grace_seconds: float = 30.0  # on stop: wait this long for in-flight samples
    commit_interval_seconds: float = 1.0  # how often finished prompts' offsets are committed


class RewardConfig(_Section):
    # "" = no reward function: every episode must carry rewards its workflow set
    reward_fn: str = "reward_workers.rewards:exact_match_reward"
    # re-score episodes whose workflow set rewards (default: keep them and pass them through)
    rescore: bool = False
    allowed_reward_fns: list[str] = []  # extra import strings besides reward_fn
    tokenizer_path: str = ""
    timeout_seconds: float = 15.0
    max_retries: int = 3
    max_workers: int = 2
    on_timeout: Literal["zero", "reject"] = "zero"
    max_batch: int = 64
    worker_id: str = ""  # default "<hostname>-<pid>"; set a stable one (see reward_workers.service)
    poll_timeout_ms: int = 200
    session_timeout_ms: int = 10_000  # consumer group session: how fast a dead worker is noticed
    max_consecutive_failures: int = 10  # failed transactions in a row before the worker gives up


class GroupingConfig(_Section):
    groups_per_batch: int = 1
    pad_value: float = 0.0
    drop_equal_rewards: bool = False
    drop_stale: bool = False
    group_timeout_seconds: float = 600.0
    commit_interval_ms: int = 100
    dedupe_window_seconds: float = 3600.0
    instance_id: str = "grouping-0"  # keep stable per instance: part of the transactional id
    session_timeout_ms: int = 10_000  # consumer group session: how soon a dead instance's partitions move


class TrainerConfig(_Section):
    batch_size: int = 8  # groups per step
    group_id: str = "trainer"
    checkpoint_dir: str = "runs/checkpoints"
    # The example GRPO trainer (examples/grpo_trainer.py, `rollstream train`):
    model_path: str = ""  # the weights of version 0 (the rollout workers' rollout.model_path)
    device: str = "cpu"
    learning_rate: float = 1e-6
    clip: float = 0.2  # PPO ratio clip
    ppo_epochs: int = 1  # optimizer steps per batch
    max_grad_norm: float = 1.0
    max_steps: int = 0  # 0: train until stopped
    keep_checkpoints: int = 4  # older ckpt/v{n} directories are deleted


class MetricsConfig(_Section):
    port: int | None = None


class RollstreamConfig(_Section):
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    redis: RedisConfig = msgspec.field(default_factory=RedisConfig)
    experiment: ExperimentConfig = msgspec.field(default_factory=ExperimentConfig)
    staleness: StalenessConfig = msgspec.field(default_factory=StalenessConfig)
    producer: ProducerConfig = msgspec.field(default_factory=ProducerConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    grouping: GroupingConfig = msgspec.field(default_factory=GroupingConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    log_level: str = "INFO"


SECRET_FIELDS = ("sasl_password", "ssl_password", "password")
ENV_PREFIX = "ROLLSTREAM__"


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"empty config key in override {dotted!r}")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _parse_scalar(text: str) -> Any:
    """YAML scalar semantics for env and ``--set`` values: ``8`` is an int, ``true`` a bool."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _env_overrides(environ: Mapping[str, str]) -> list[tuple[str, Any]]:
    overrides: list[tuple[str, Any]] = []
    if environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        overrides.append(("kafka.bootstrap_servers", environ["KAFKA_BOOTSTRAP_SERVERS"]))
    if environ.get("REDIS_URL"):
        overrides.append(("redis.url", environ["REDIS_URL"]))
    for name, value in sorted(environ.items()):
        if name.startswith(ENV_PREFIX):
            path = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            overrides.append((path, _parse_scalar(value)))
    return overrides


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return loaded


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> RollstreamConfig:
    """Load and validate: file < environment < ``overrides`` (``key.path=value`` strings)."""
    tree: dict[str, Any] = _read_yaml(Path(path)) if path else {}
    for key, value in _env_overrides(os.environ if environ is None else environ):
        _set_path(tree, key, value)
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        _set_path(tree, key.strip(), _parse_scalar(value))
    return config_from_dict(tree)


def config_from_dict(tree: dict[str, Any]) -> RollstreamConfig:
    try:
        config = msgspec.convert(tree, RollstreamConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None
    _check_ranges(config)
    return config


def raise_first_problem(problems: list[tuple[bool, str]]) -> None:
    """Raise ``ConfigError`` for the first ``(is_bad, message)`` pair whose ``is_bad`` holds."""
    for bad, message in problems:
        if bad:
            raise ConfigError(f"invalid configuration: {message}")


def _check_ranges(config: RollstreamConfig) -> None:
    checks = [
        (config.producer.group_size >= 1, "producer.group_size must be >= 1"),
        (config.producer.epochs >= 1, "producer.epochs must be >= 1"),
        (config.rollout.max_concurrent_rollouts >= 1, "rollout.max_concurrent_rollouts must be >= 1"),
        (config.staleness.batch_size >= 1, "staleness.batch_size must be >= 1"),
        (config.staleness.max_head_offpolicyness >= 0, "staleness.max_head_offpolicyness must be >= 0"),
        (config.grouping.groups_per_batch >= 1, "grouping.groups_per_batch must be >= 1"),
        (config.kafka.partitions >= 1, "kafka.partitions must be >= 1"),
        (config.kafka.linger_ms >= 0, "kafka.linger_ms must be >= 0"),
        (config.kafka.fetch_min_bytes >= 1, "kafka.fetch_min_bytes must be >= 1"),
        (config.kafka.fetch_max_wait_ms >= 0, "kafka.fetch_max_wait_ms must be >= 0"),
        (config.reward.max_retries >= 0, "reward.max_retries must be >= 0"),
    ]
    raise_first_problem([(not ok, message) for ok, message in checks])


def redacted(config: RollstreamConfig) -> dict[str, Any]:
    """The configuration as a dict with every secret replaced by ``'***'`` (for logs)."""
    tree = msgspec.to_builtins(config)
    _redact(tree)
    return tree


def secret_values(config: RollstreamConfig) -> list[str]:
    """Every non-empty secret in ``config`` (passwords, and credentials inside URLs)."""
    found: list[str] = []
    for section in (config.kafka, config.redis):
        for name in SECRET_FIELDS:
            value = getattr(section, name, None)
            if value:
                found.append(value)
    password = _url_password(config.redis.url)
    if password:
        found.append(password)
    return found


def _url_password(url: str) -> str | None:
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).password
    except ValueError:
        return None


def _redact(node: Any) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in SECRET_FIELDS and value:
                node[key] = "***"
            elif key == "url" and isinstance(value, str) and _url_password(value):
                node[key] = value.replace(_url_password(value) or "", "***")
            else:
                _redact(value)
