"""One configuration schema for every tier: YAML file, then environment, then ``--set``.

Unknown keys are errors (with the path of the offending key), never silently ignored.
Environment: ``KAFKA_BOOTSTRAP_SERVERS``, ``REDIS_URL``, and any ``ROLLSTREAM__SECTION__KEY``
(double underscores separate the path, e.g. ``ROLLSTREAM__ROLLOUT__MAX_CONCURRENT_ROLLOUTS=8``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
import yaml

from rollstream.file_names import is_plain_name


class ConfigError(ValueError):
    """A configuration that cannot be loaded or does not validate."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# The rules of the settings live in their types: msgspec checks them when a configuration is
# loaded and names the key in its error ("Expected `int` >= 1 - at `$.reward.max_batch`").
Positive = Annotated[float, msgspec.Meta(gt=0)]
Seconds = Positive  # a duration that must be positive
Wait = Annotated[float, msgspec.Meta(ge=0)]  # a duration that may be zero
Count = Annotated[int, msgspec.Meta(ge=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
Millis = AtLeastOne  # a positive duration in milliseconds
SessionMillis = Annotated[int, msgspec.Meta(ge=1000)]  # a consumer group session timeout
Name = Annotated[str, msgspec.Meta(min_length=1)]
Role = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._-]+$")]  # a topic role: rs.<experiment>.<trial>.<role>
MAX_GROUP_SIZE = 1024  # = rollstream.wire.messages.MAX_GROUP_SIZE (the decoders refuse more)
MAX_PRODUCER_ID_BYTES = 128  # leaves room for ":{epoch}:{index}" in a 200-byte file name


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
    partitions: AtLeastOne = 4  # partitions for topics this project creates
    # partitions of the prompts topic (None: ``partitions``): the most rollout workers that get
    # work. It is not co-partitioned with anything, so `rollstream topics create` grows it
    # while the pipeline runs (docs/DEPLOYMENT.md, "Scaling rollout workers").
    prompt_partitions: AtLeastOne | None = None
    replication_factor: AtLeastOne = 1  # 3 on a production cluster (docs/DEPLOYMENT.md)
    # min.insync.replicas of the topics this project creates; None: replication_factor - 1
    # (at least 1), i.e. 2 for replication 3
    min_insync_replicas: AtLeastOne | None = None
    max_message_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 16 * 1024 * 1024
    transaction_timeout_ms: SessionMillis = 60_000
    request_timeout_ms: Millis = 40_000
    # How long a tier waits out a broker it cannot reach, at start (topics, every client's
    # start) and at run time (failed transactions in a row), with the one retry policy, each
    # try logged, before it exits. (A Redis outage is waited out without limit: exiting would
    # not bring Redis back.) docs/GUARANTEES.md, section 6.
    outage_patience_seconds: Seconds = 300.0
    # Request batching (aiokafka's meaning). Larger batches did not lower the broker's CPU on
    # the benchmark machine (bench/README.md), so the defaults favour latency.
    linger_ms: Count = 5  # producers wait this long to fill a batch before sending
    fetch_min_bytes: AtLeastOne = 1  # the broker holds a fetch until this much data is ready...
    fetch_max_wait_ms: Count = 500  # ...or this long has passed

    def partitions_of(self, role: str) -> int:
        """The partition count this project gives a new topic of ``role`` (a TopicNames role)."""
        return self.prompt_partitions or self.partitions if role == "prompts" else self.partitions

    def __post_init__(self) -> None:
        if self.min_insync_replicas is not None and self.min_insync_replicas > self.replication_factor:
            raise ValueError("kafka.min_insync_replicas must be between 1 and kafka.replication_factor")
        if self.security_protocol.startswith("SASL_") and (not self.sasl_mechanism or self.sasl_username is None):
            raise ValueError(
                f"kafka.security_protocol {self.security_protocol} needs kafka.sasl_mechanism and kafka.sasl_username"
            )


class RedisConfig(_Section):
    url: str = "redis://127.0.0.1:6379/0"
    username: str | None = None
    password: str | None = None


class ExperimentConfig(_Section):
    experiment_name: str = "default"
    trial_name: str = "trial0"


class StalenessConfig(_Section):
    max_head_offpolicyness: Count = 0  # eta: versions a token may lag behind the trainer
    # groups (prompts) per trainer step: the ONE setting of it, read by the trainer side
    # (rollstream.trainer) for its steps and by producers and grouping for the budget's unit
    groups_per_step: AtLeastOne = 8
    enabled: bool = True


class ProducerConfig(_Section):
    dataset: str = ""
    dataset_format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    split: str = "train"
    shuffle: bool = False
    seed: int = 0
    epochs: AtLeastOne = 1
    group_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_GROUP_SIZE)] = 4
    is_eval: bool = False
    workflow: str | None = None
    max_prompts: Count | None = None
    # the producer's transactional id and the start of every task id (task ids name dump files)
    producer_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PRODUCER_ID_BYTES)] = "producer-0"
    admission_poll_seconds: Seconds = 0.5
    max_batch_prompts: AtLeastOne = 64  # prompts per Kafka transaction at most
    batch_linger_ms: Count = 50  # commit a partial batch once its first prompt waited this long
    progress_every: AtLeastOne = 100  # log progress every this many published prompts

    def __post_init__(self) -> None:
        if not is_plain_name(self.producer_id) or len(self.producer_id.encode()) > MAX_PRODUCER_ID_BYTES:
            raise ValueError(
                f"producer.producer_id {self.producer_id!r} must be a plain file name of at most "
                f"{MAX_PRODUCER_ID_BYTES} bytes (no '/', '%' or control characters, not starting with '.'): "
                "it begins every task id, and task ids name the trajectory dump files"
            )


class WorkflowSpec(_Section):
    path: str  # import string of a RolloutWorkflow class, instance or agent
    kwargs: dict[str, Any] = {}


class ServerConfig(_Section):
    """How rollout workers talk to shared inference servers, SGLang or vLLM (``rollout.server.*``).

    Generation (every worker): timeouts, retries with capped exponential backoff, failover.
    Weight sync (one sync owner per server, elected by a lease in Redis): bounded pause and load.
    """

    request_timeout_seconds: Seconds = 3600.0  # one generate call (a long generation is one call)
    connect_timeout_seconds: Seconds = 10.0  # opening a connection to a server
    max_retries: Count = 3  # extra attempts of a generate call after a connection error, timeout or 5xx
    backoff_base_seconds: Seconds = 0.5  # first retry delay, doubled per attempt...
    backoff_max_seconds: Seconds = 10.0  # ...up to this
    failure_threshold: AtLeastOne = 2  # failures in a row that mark a server down...
    down_cooldown_seconds: Seconds = 30.0  # ...for this long (its requests fail over)
    # with every server down, a call waits this long for one to answer again (a restarting
    # server takes a minute or more) before its sample fails; 0: fail at once
    down_patience_seconds: Wait = 300.0
    health_timeout_seconds: Seconds = 300.0  # at start: wait this long for every server to be up
    health_probe_timeout_seconds: Seconds = 5.0  # one health probe or control call (version, continue)
    max_version_lag: Count = 0  # a server is used only at >= trainer version - this
    catch_up_timeout_seconds: Seconds = 600.0  # a request waits this long for a server at that version
    version_poll_seconds: Seconds = 0.5  # while requests wait, re-read servers' weight versions this often
    # The sync owner of each server:
    lease_ttl_seconds: Seconds = 10.0  # a dead sync owner's servers are taken over after this
    pause_timeout_seconds: Seconds = 60.0  # a pause answers once the requests it cut off are answered
    update_timeout_seconds: Seconds = 900.0  # loading a checkpoint from disk (a large one takes long)
    reconcile_seconds: Seconds = 5.0  # the sync owner re-checks its idle server (version, not left paused)


class ServerLaunchConfig(_Section):
    """How rollstream starts an inference server, vLLM or SGLang (``rollout.launch.*``): the dev
    server (``rollstream dev up --vllm``), the demo and the benches read it; compose's services
    take the same settings from environment variables (docs/DEPLOYMENT.md). The flags each
    becomes: ``rollstream.engines.server_launch``."""

    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when torch sees a GPU, else cpu
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    cuda_graphs: bool = True  # False: eager (vLLM --enforce-eager, SGLang --disable-cuda-graph)
    max_num_seqs: AtLeastOne = 8  # requests batched at once (vLLM --max-num-seqs, SGLang --max-running-requests)
    # of the GPU's memory, for weights and KV cache (vLLM --gpu-memory-utilization, SGLang
    # --mem-fraction-static); cuda only (a CPU server's KV cache: VLLM_CPU_KVCACHE_SPACE, GiB)
    memory_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.85
    tensor_parallel_size: AtLeastOne = 1  # GPUs one server spans (vLLM --tensor-parallel-size, SGLang --tp-size)
    max_model_len: Count = 256  # prompt + generation, in tokens; 0: the model's own (SGLang --context-length)
    # reuse the keys and values of prompt prefixes across requests; rollout.weight_update_mode
    # keep needs it off (vLLM --no-enable-prefix-caching, SGLang --disable-radix-cache)
    prefix_caching: bool = True


class AgentConfig(_Section):
    """The OpenAI-compatible endpoint agent workflows talk to (``rollout.agent.*``; see
    docs/WORKFLOWS.md, "Write an agent workflow"). Each agent episode gets its own session on it:
    a ``base_url`` and an ``api_key`` valid for that episode only."""

    host: str = "127.0.0.1"  # where the endpoint listens; localhost unless set otherwise
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # 0: a free port chosen at start
    public_host: str = ""  # the host in each session's base_url; "": host (or this machine's name when host is a wildcard)
    model_name: str = ""  # the model id /v1/models lists; "": the last part of rollout.model_path
    timeout_seconds: Seconds = 600.0  # an agent still running after this fails its sample
    turn_discount: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0  # reward x this per model turn before the last, as multi_turn


class RolloutConfig(_Section):
    # hf: a local transformers model; sglang / vllm: shared inference servers (server_urls);
    # custom: engine_factory
    engine: Literal["hf", "sglang", "vllm", "custom"] = "hf"
    # engine "custom": import string of a callable taking this RolloutConfig and returning an
    # InferenceEngine (not started), e.g. "my_pkg.engines:make_engine"; configuration only
    engine_factory: str = ""
    model_path: str = ""
    tokenizer_path: str | None = None
    # where "$processor" (a VLM's processor, for vision workflows) is loaded from: default the
    # tokenizer path, else the model path
    processor_path: str | None = None
    server_urls: list[str] = []  # engine sglang / vllm: the servers' base URLs (http://host:port)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)  # see ServerConfig
    launch: ServerLaunchConfig = msgspec.field(default_factory=ServerLaunchConfig)  # see ServerLaunchConfig
    device: str = "cpu"
    seed: int | None = None
    max_concurrent_rollouts: AtLeastOne = 8
    workflows: dict[str, WorkflowSpec] = {}
    default_workflow: str = "rlvr"
    gconfig: dict[str, Any] = {}
    worker_id: str = ""
    dump_to_file: bool = False
    fileroot: str = "runs/dumps"
    # on stop: after leaving the group, let in-flight prompts finish for this long (longer than
    # a generation, so that a graceful stop re-runs nothing); the rest run again elsewhere
    shutdown_grace_seconds: Wait = 300.0
    commit_interval_seconds: Seconds = 1.0  # how often finished prompts' offsets are committed
    # how soon a dead worker is noticed: the prompts consumer's session and the liveness of its
    # prompt claims; only then are its running prompts run again. At least the broker's
    # group.min.session.timeout.ms (6 s by default).
    failure_detection_seconds: Annotated[float, msgspec.Meta(ge=1, le=3600)] = 10.0
    agent: AgentConfig = msgspec.field(default_factory=AgentConfig)  # see AgentConfig
    # Engines sglang / vllm: what a weight update does to the requests running on a server.
    # abort: cut them (each is sent again with its tokens, prefilled with the new weights);
    # keep: freeze them with their keys and values, which the new weights then extend (each
    # token tagged with the weights of its step; a vLLM server must not cache prefixes)
    weight_update_mode: Literal["abort", "keep"] = "abort"
    # Engines sglang / vllm: how a version reaches the servers. checkpoint: each loads the
    # trainer's checkpoint; distributed: the trainer's rank 0 sends the tensors over a
    # torch.distributed process group (trainer.weight_sender; vLLM), and a server that missed a version
    # catches up from the newest checkpoint (written every trainer.checkpoint_every versions)
    weight_transfer: Literal["checkpoint", "distributed"] = "checkpoint"


class RewardConfig(_Section):
    # "" = no reward function: every episode must carry rewards its workflow set
    reward_fn: str = "rollstream.rewards:exact_match_reward"
    # re-score episodes whose workflow set rewards (default: keep them and pass them through)
    rescore: bool = False
    allowed_reward_fns: list[str] = []  # extra import strings besides reward_fn
    tokenizer_path: str = ""
    timeout_seconds: Seconds = 15.0
    max_retries: Count = 3
    max_workers: AtLeastOne = 2
    on_timeout: Literal["zero", "reject"] = "zero"
    max_batch: AtLeastOne = 64
    worker_id: str = ""  # names the worker in logs and client ids; default "<hostname>-<pid>"
    poll_timeout_ms: Millis = 200
    session_timeout_ms: SessionMillis = 10_000  # consumer group session: how fast a dead worker is noticed
    max_consecutive_failures: AtLeastOne = 10  # failed transactions in a row before the worker gives up


class GroupingConfig(_Section):
    # the topic role it groups: "scored", or the role a tier of your own between the reward
    # workers and the grouping writes (docs/ARCHITECTURE.md, "A tier of your own")
    reads: Role = "scored"
    pad_value: float = 0.0
    # Group filters (rollstream.consumers.grouping.filters): import strings of fn(group) -> bool, run
    # in order on every complete train group; the first False drops it as "filtered" and returns
    # its staleness slot. drop_equal_rewards puts the built-in distinct_rewards filter first.
    group_filters: list[Name] = msgspec.field(default_factory=list)
    drop_equal_rewards: bool = False
    drop_stale: bool = False
    group_timeout_seconds: Seconds = 600.0
    commit_interval_ms: Millis = 100
    dedupe_window_seconds: Wait = 3600.0
    instance_id: Name = "grouping-0"  # names the instance in logs and client ids
    session_timeout_ms: SessionMillis = 10_000  # consumer group session: how soon a dead instance's partitions move
    max_consecutive_failures: AtLeastOne = 10  # failed transactions in a row before the instance gives up


class WeightSenderConfig(_Section):
    """The trainer's side of ``rollout.weight_transfer: distributed`` (``trainer.weight_sender.*``)."""

    host: str = "127.0.0.1"  # the address inference servers reach the trainer's rank 0 at
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # its rendezvous port; 0: a free one
    backend: Literal["gloo", "nccl"] = "gloo"  # gloo on CPU, nccl between GPUs
    # a publish waits this long for the servers (rollout.server_urls) to take the version; one
    # that did not catches up from a checkpoint and takes the next version
    timeout_seconds: Seconds = 60.0
    bucket_mb: AtLeastOne = 64  # tensors travel in buffers of at most this many MiB


class TrainerConfig(_Section):
    """The trainer side (``rollstream.trainer``, docs/TRAINER.md) and the example GRPO trainer."""

    group_id: str = "trainer"  # (groups per step: staleness.groups_per_step)
    checkpoint_dir: str = "runs/checkpoints"
    # Kafka membership of the trainer's consumer (rank 0's). It polls on a background thread
    # during a step, so steps of any length keep it in its group.
    poll_timeout_ms: AtLeastOne = 500  # one fetch waits at most this long
    session_timeout_ms: AtLeastOne = 10_000  # a dead trainer's partitions move after this
    heartbeat_interval_ms: AtLeastOne = 3_000
    max_poll_interval_ms: AtLeastOne = 300_000  # Kafka's limit between two polls
    prefetch_steps: AtLeastOne = 1  # steps read ahead while one trains; fetching pauses beyond
    remember_steps: AtLeastOne = 64  # task ids of this many steps are never handed out again
    # A train group more than staleness.max_head_offpolicyness versions behind the version a step
    # trains (the newest one published when the step is handed out) is dropped as "stale",
    # counted and its staleness slot returned, never trained (false, or staleness.enabled false:
    # trained however stale)
    drop_stale: bool = True
    commit_retries: AtLeastOne = 10  # tries of a step's commit (e.g. across a rebalance)
    ledger_path: str = ""  # the committed steps, one JSON line each; "": <checkpoint_dir>/ledger.jsonl
    # torchrun: a rank that sends no heartbeat for this long (dead, stopped, its host gone) ends
    # the job, every rank with a line naming it, its step and phase, so that torchrun restarts it
    rank_timeout_seconds: Seconds = 15.0
    # torchrun: the longest a rank waits in rollstream's collectives for ranks that are alive
    # (a rank's step or rank 0's checkpoint may take long; a dead or stalled rank ends the job
    # after rank_timeout_seconds instead)
    collective_timeout_seconds: Seconds = 3600.0
    # `rollstream train` and the demo: how often torchrun starts a failed job again (0: never);
    # the job resumes after its last committed step each time
    max_restarts: Count = 3
    # A VLM's directory (or any with its image processor): the trainer side rebuilds the vision
    # inputs of batches with images with it ("" = none: TrainingStep.vision stays None)
    processor_path: str = ""
    # The example GRPO trainer (examples/grpo_trainer.py, `rollstream train`):
    model_path: str = ""  # the weights of version 0 (the rollout workers' rollout.model_path)
    device: str = "cpu"
    learning_rate: Positive = 1e-6
    clip: Positive = 0.2  # PPO ratio clip
    ppo_epochs: AtLeastOne = 1  # optimizer updates (PPO epochs) per trainer step
    max_grad_norm: float = 1.0
    max_steps: Count = 0  # 0: train until stopped
    keep_checkpoints: AtLeastOne = 4  # older v{n} directories and their Redis entries are deleted
    # rollout.weight_transfer distributed: a checkpoint every this many versions (recovery, and
    # servers that missed a version); with checkpoint transfers every version has one
    checkpoint_every: AtLeastOne = 1
    weight_sender: WeightSenderConfig = msgspec.field(default_factory=WeightSenderConfig)


class DumpConfig(_Section):
    """Trajectory dumps (docs/DEBUGGING.md). Where: ``rollout.fileroot``. Who writes them: the
    ``dump`` tier, or the rollout workers when ``rollout.dump_to_file`` is true (the dump tier
    then refuses to start, so no sample is written twice)."""

    # "reference": AReaL's nine fields (plus "row" on lines of multi-row
    # episodes); "extended": also row, stop_reason, group_size, trainer_version, weight_path
    fields: Literal["reference", "extended"] = "reference"


class MetricsConfig(_Section):
    port: int | None = None  # serves /metrics, /livez and /readyz (rollstream/runtime/health.py)
    liveness_timeout_seconds: Seconds = 60.0  # /livez fails once the event loop is stuck this long


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
    dump: DumpConfig = msgspec.field(default_factory=DumpConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    log_level: str = "INFO"
    # "text": one readable line per event; "json": one JSON object per line (rollstream/runtime/logs.py)
    log_format: Literal["text", "json"] = "text"
    # A tier ends at most this long after SIGTERM, even when a client hangs (a rollout worker:
    # plus rollout.shutdown_grace_seconds for its prompts in flight); past it the process exits
    # with code 124, what it was doing in the log
    shutdown_timeout_seconds: Seconds = 30.0


SECRET_FIELDS = ("sasl_password", "ssl_password", "password")
ENV_PREFIX = "ROLLSTREAM__"
CACHE_DIR_ENV = "ROLLSTREAM_CACHE_DIR"


def cache_dir() -> Path:
    """Where rollstream keeps what it downloads or builds once (the broker's jars, the tiny
    models): ``$ROLLSTREAM_CACHE_DIR``, else ``~/.cache/rollstream`` (not created here)."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "rollstream").expanduser()


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


# Keys that are gone, and where what they set lives now: named in the error a user gets.
MOVED_KEYS = {
    ("staleness", "batch_size"): "groups per trainer step are staleness.groups_per_step",
    ("trainer", "batch_size"): "groups per trainer step are staleness.groups_per_step (one setting for the "
                               "trainer's steps and the staleness budget)",
    ("grouping", "groups_per_batch"): "every batches record holds one group; groups per trainer step are "
                                      "staleness.groups_per_step",
    ("rollout", "sglang_urls"): "the servers of engine sglang or vllm are rollout.server_urls",
    ("rollout", "sglang"): "the settings of the inference servers (SGLang or vLLM) are rollout.server",
}


def config_from_dict(tree: dict[str, Any]) -> RollstreamConfig:
    """Validate ``tree`` against the schema; ``ConfigError`` names the offending key."""
    for (section, key), where in MOVED_KEYS.items():
        if isinstance(tree.get(section), dict) and key in tree[section]:
            raise ConfigError(f"invalid configuration: {section}.{key} is no longer a setting: {where}")
    try:
        return msgspec.convert(tree, RollstreamConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None


def require(value: object, key: str, why: str) -> None:
    """``ConfigError`` unless ``value`` is set: for a setting one tier cannot run without
    (a rule of that tier, not of the setting's type)."""
    if not value:
        raise ConfigError(f"invalid configuration: {key} {why}")


def redacted(config: RollstreamConfig) -> dict[str, Any]:
    """The configuration as a dict with every secret replaced by ``'***'`` (for logs)."""
    tree = msgspec.to_builtins(config)
    _redact(tree)
    return tree


def secret_values(config: RollstreamConfig) -> list[str]:
    """Every non-empty secret in ``config`` (passwords, and credentials inside URLs)."""
    found = [value for section in (config.kafka, config.redis) for name in SECRET_FIELDS
             if (value := getattr(section, name, None))]
    password = _url_password(config.redis.url)
    return found + [password] if password else found


def _url_password(url: str) -> str | None:
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
