"""What the existing topics of a trial must look like, and what is wrong with them.

Pure logic over described topics (:class:`TopicState`, read by ``rollstream.kafka.admin``);
:func:`check_layout` returns :class:`Findings`:

- ``errors`` break the pipeline and stop a starting tier: ``episodes``, ``scored`` and the
  grouping changelog with different partition counts (the samples of a group meet in one
  partition of each, and changelog partition p records ``scored`` partition p); a compacted
  topic (grouping changelog, producer cursor) that is not compacted, so its records expire
  with retention; a data topic that is compacted, so records sharing a task id would be
  removed; ``min.insync.replicas`` above the replication factor, so no write can succeed.
- ``warnings`` weaken something without breaking it: other data topics with another
  partition count, replication or ``min.insync.replicas`` below what the configuration asks,
  unclean leader election, ``max.message.bytes`` below ``kafka.max_message_bytes``.

Every message names the topic, what differs, and how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollstream.config import KafkaConfig
from rollstream.kafka.topics import TopicNames

CHECKED_CONFIGS = ("cleanup.policy", "max.message.bytes", "min.insync.replicas", "unclean.leader.election.enable")
DURABLE_REPLICATION = 3  # the replication a production cluster should give every topic


@dataclass(frozen=True)
class TopicState:
    """One existing topic: its partition count, its smallest replica count, its configs."""

    name: str
    partitions: int
    replication: int
    configs: dict[str, str] = field(default_factory=dict)


@dataclass
class Findings:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class TopicLayoutError(RuntimeError):
    """The trial's topics break the pipeline (see :func:`check_layout`); the message says what
    differs and how to fix it."""


def min_insync_replicas(config: KafkaConfig) -> int:
    """``kafka.min_insync_replicas``, else one less than the replication factor (at least 1):
    2 for replication 3, so an ``acks=all`` write is on two brokers before it is acknowledged
    and one broker may be down without stopping writes."""
    if config.min_insync_replicas is not None:
        return config.min_insync_replicas
    return max(1, config.replication_factor - 1)


def copartitioned(names: TopicNames) -> list[str]:
    """Topics that must have the same partition count, whatever else differs."""
    return [names.episodes, names.scored, names.grouping_changelog]


def growable(names: TopicNames) -> list[str]:
    """Topics grown together by ``rollstream topics create`` on a drained trial (every data
    topic but ``prompts``, and the changelog). Not the producer cursor (keyed by producer id
    and read whole), nor ``prompts``, which grows on its own while the pipeline runs
    (:func:`prompts_growth`): nothing downstream depends on where a prompt record lies."""
    return [name for name in names.data_topics() if name != names.prompts] + [names.grouping_changelog]


def prompts_growth(config: KafkaConfig, names: TopicNames, topics: dict[str, TopicState]) -> int | None:
    """The partition count from which ``prompts`` grows to ``kafka.prompt_partitions`` (None:
    nothing to grow). Raises :class:`TopicLayoutError` when it has more already."""
    state = topics.get(names.prompts)
    wanted = config.partitions_of("prompts")
    if state is None or state.partitions == wanted:
        return None
    if state.partitions > wanted:
        raise TopicLayoutError(
            f"{names.prompts} has {state.partitions} partitions, more than kafka.prompt_partitions={wanted}; "
            f"partitions can only grow. Set kafka.prompt_partitions to {state.partitions} or more"
        )
    return state.partitions


def check_layout(config: KafkaConfig, names: TopicNames, topics: dict[str, TopicState], brokers: int) -> Findings:
    """Every problem of ``topics`` (name -> state; missing topics are skipped) for ``config``
    on a cluster of ``brokers`` brokers."""
    found = Findings()
    _check_copartitioning(names, topics, found)
    if not found.errors:  # the same difference is not worth a second line
        _check_partition_counts(config, names, topics, found)
    compacted = set(names.compacted_topics())
    for name, state in sorted(topics.items()):
        _check_cleanup(state, name in compacted, found)
        _check_durability(config, state, found)
        _check_size(config, state, found)
    _check_cluster_durability(config, brokers, found)
    return found


def _partition_counts(group: list[str], topics: dict[str, TopicState]) -> dict[str, int]:
    return {name: topics[name].partitions for name in group if name in topics}


def _grow_together(counts: dict[str, int]) -> str:
    """The command that grows topics whose partition ``counts`` differ to one count; '' when they agree."""
    if len(set(counts.values())) <= 1:
        return ""
    return f"rollstream topics create --set kafka.partitions={max(counts.values())}"


def _check_copartitioning(names: TopicNames, topics: dict[str, TopicState], found: Findings) -> None:
    counts = _partition_counts(copartitioned(names), topics)
    if grow := _grow_together(counts):
        listed = ", ".join(f"{name} has {n}" for name, n in counts.items())
        found.errors.append(
            f"topics that must be co-partitioned differ in partition count ({listed}): the samples of "
            f"a group would not meet in one grouping consumer. Fix: grow them all to the same count "
            f"with `{grow}` (partitions can only grow), or start a new trial (experiment.trial_name)"
        )


def _check_partition_counts(config: KafkaConfig, names: TopicNames, topics: dict[str, TopicState],
                            found: Findings) -> None:
    counts = _partition_counts(growable(names), topics)
    if grow := _grow_together(counts):
        listed = ", ".join(f"{name.rsplit('.', 1)[-1]} {n}" for name, n in counts.items())
        found.warnings.append(f"data topics differ in partition count ({listed}); `{grow}` grows them together")
    short = {name: n for name, n in counts.items() if n < config.partitions}
    if short:
        found.warnings.append(
            f"{len(short)} topic(s) have fewer partitions than kafka.partitions={config.partitions} "
            f"({', '.join(f'{k} {v}' for k, v in short.items())}); tiers use what the topics have. "
            "`rollstream topics create` grows them (drain the trial first)"
        )
    prompts = topics.get(names.prompts)
    if prompts is not None and prompts.partitions < config.partitions_of("prompts"):
        found.warnings.append(
            f"{names.prompts} has {prompts.partitions} partitions, fewer than {config.partitions_of('prompts')} "
            "(kafka.prompt_partitions): at most that many rollout workers get prompts. `rollstream topics "
            "create` grows it, also while the pipeline runs"
        )


def _check_cleanup(state: TopicState, compacted: bool, found: Findings) -> None:
    policy = {p.strip() for p in state.configs.get("cleanup.policy", "delete").split(",")}
    if compacted == ("compact" in policy):
        return
    if compacted:
        why, fix = "must be compacted: its records (latest state per key) would expire with retention", "compact"
    else:
        why = "must not be compacted: compaction keeps one record per key, and the samples of a group share their key"
        fix = "delete"
    found.errors.append(
        f"{state.name} has cleanup.policy={','.join(sorted(policy))} but {why}. Fix: kafka-configs.sh --alter "
        f"--entity-type topics --entity-name {state.name} --add-config cleanup.policy={fix}"
    )


def _check_durability(config: KafkaConfig, state: TopicState, found: Findings) -> None:
    min_isr = _int(state.configs.get("min.insync.replicas"))
    if min_isr is not None and min_isr > state.replication:
        found.errors.append(
            f"{state.name} has min.insync.replicas={min_isr} but only {state.replication} replica(s): "
            "every acks=all write is refused. Fix: kafka-configs.sh --alter --entity-type topics "
            f"--entity-name {state.name} --add-config min.insync.replicas={state.replication}"
        )
    if state.replication < config.replication_factor:
        found.warnings.append(
            f"{state.name} has replication {state.replication}, below kafka.replication_factor="
            f"{config.replication_factor}: a broker's loss makes its partitions unavailable or loses "
            "them. Raise it with kafka-reassign-partitions.sh"
        )
    if min_isr is not None and state.replication > 1 and min_isr < 2:
        found.warnings.append(
            f"{state.name} has min.insync.replicas={min_isr} with {state.replication} replicas: an "
            "acks=all write is acknowledged once one broker has it, and lost with that broker. "
            f"Fix: --add-config min.insync.replicas={max(2, state.replication - 1)}"
        )
    if state.configs.get("unclean.leader.election.enable", "false").lower() == "true":
        found.warnings.append(
            f"{state.name} has unclean.leader.election.enable=true: a replica that missed "
            "acknowledged writes may become leader, and those writes are lost"
        )


def _check_size(config: KafkaConfig, state: TopicState, found: Findings) -> None:
    limit = _int(state.configs.get("max.message.bytes"))
    if limit is not None and limit < config.max_message_bytes:
        found.warnings.append(
            f"{state.name} accepts record batches up to max.message.bytes={limit}, below "
            f"kafka.max_message_bytes={config.max_message_bytes}: larger records are refused by the "
            f"broker. Fix: --add-config max.message.bytes={config.max_message_bytes}, or lower "
            "kafka.max_message_bytes"
        )


def _check_cluster_durability(config: KafkaConfig, brokers: int, found: Findings) -> None:
    wanted = min(brokers, DURABLE_REPLICATION)
    if config.replication_factor < wanted:
        found.warnings.append(
            f"kafka.replication_factor={config.replication_factor} on a cluster of {brokers} brokers: "
            f"topics this project creates survive no broker loss; set it to {wanted}"
        )
    if config.replication_factor > 1 and min_insync_replicas(config) < 2:
        found.warnings.append(
            f"kafka.min_insync_replicas={min_insync_replicas(config)}: an acks=all write is acknowledged "
            "by one broker; set it to 2"
        )


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def plan_growth(partitions: int, names: TopicNames, topics: dict[str, TopicState]) -> dict[str, int]:
    """Which existing topics ``rollstream topics create`` grows to ``partitions`` (name -> from).

    Every data topic and the changelog are grown together, so co-partitioned topics stay equal.
    Raises :class:`TopicLayoutError` when one has more partitions already: Kafka cannot remove
    partitions, and growing the others would only make the counts differ.
    """
    counts = _partition_counts(growable(names), topics)
    larger = {name: n for name, n in counts.items() if n > partitions}
    if larger:
        most = max(larger.values())
        listed = ", ".join(f"{name} has {n}" for name, n in larger.items())
        raise TopicLayoutError(
            f"kafka.partitions={partitions} is below what the topics have ({listed}); partitions can "
            f"only grow. Set kafka.partitions to {most} or more (every data topic grows with it), or "
            "start a new trial (experiment.trial_name) for fewer partitions"
        )
    return {name: n for name, n in counts.items() if n < partitions}
