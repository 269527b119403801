"""Every message that crosses a process boundary, one tagged union per topic.

Evolution rules (review checklist): a new field gets a default and goes at the end; never
reorder or retype a field; bump a kind's version for a change its old readers cannot ignore.
A reader refuses messages whose ``schema_version`` is newer than its own ``SCHEMA_VERSION``,
and those older than the oldest it reads of their kind (:data:`OLDEST_READABLE`). A kind
writes the version of its own last such change, so a bump for one kind does not make old
readers of the other topics (or of the compacted changelog and cursor topics, which a
rolled-back tier must still read) refuse messages they could read.

History:

- 1: every kind.
- 2: ``EmittedGroup`` carries its tensors in ``packed`` (one buffer, see
  ``rollstream.wire.packed``) instead of one ``WireTensor`` each in ``tensors``.
- 3: ``EmittedGroup`` has no ``tensors`` field; ``packed``, ``rejected`` and ``failed`` (per
  group: samples the workflow rejected / samples that failed) are required, one count per
  group. Readers refuse emitted groups of versions 1 and 2, and older readers refuse version
  3. Every other kind still writes 1.

Added later without a version bump: ``ScoredEpisode.reward_source`` with a default (old
readers ignore it, new readers of old messages get the default); the drop reasons
``all_failed`` and ``dead_lettered``, which a reader older than them refuses like any
undecodable record (upgrade readers before writers, docs/DEPLOYMENT.md). Also without a bump,
for vision (docs/ARCHITECTURE.md, "Images travel once"): ``Episode.row_images`` /
``Episode.images`` and ``EmittedGroup.images`` / ``EmittedGroup.row_images``, empty for
text. A reader older than them would drop a group's images, so upgrade trainers before the
grouping tier when a trial has images.

A kind's tag, not its Python name, is what the bytes carry: ``EmittedGroup`` is the kind
``batch``, the record of the ``batches`` topic (tests/unit/test_wire.py decodes bytes written
under that tag by every version-3 writer).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec

from rollstream.wire.packed import PackedTensors
from rollstream.wire.tensor_codec import WireTensor

MAX_GROUP_SIZE = 1024

# Invariants a decoder enforces from the types (msgspec names the field in its error) and
# from __post_init__ (which also runs when a message is built in code, so a tier cannot write
# what its readers would refuse).
TaskId = Annotated[str, msgspec.Meta(min_length=1)]
GroupSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_GROUP_SIZE)]
SampleIdx = Annotated[int, msgspec.Meta(ge=0, lt=MAX_GROUP_SIZE)]

SCHEMA_VERSION = 3  # the newest version this reader understands (any kind)
FIRST_SCHEMA_VERSION = 1  # the wire schema's first version (weight versions start at 0)
EMITTED_GROUP_VERSION = 3

DropReason = Literal[
    "all_rejected",  # every sample of the group was rejected by the workflow (returned None)
    "all_failed",  # no sample was accepted and at least one failed (detail: the first error)
    "filtered",  # a group filter removed it (e.g. all rewards equal)
    "stale",  # the oldest generated token is beyond the staleness bound
    "timeout",  # the group did not complete within the grouping timeout
    "task_failed",  # the prompt could not be run (dead-lettered upstream)
    "dead_lettered",  # the group's samples cannot be padded into one record (dead-lettered by grouping)
]


class _Message(msgspec.Struct, tag_field="kind", kw_only=True):
    schema_version: int = FIRST_SCHEMA_VERSION


def _check_sample(sample_idx: int, group_size: int) -> None:
    if sample_idx >= group_size:
        raise ValueError(f"sample_idx {sample_idx} outside 0..{group_size - 1}")


class PromptTask(_Message, tag="prompt"):
    """One prompt to roll out ``group_size`` times. Key: ``task_id``."""

    task_id: TaskId
    group_size: GroupSize
    data: dict[str, Any]
    is_eval: bool = False
    workflow: str | None = None  # a key of the worker's allow-list, never code
    epoch: int = 0
    index: int = 0
    created_at: float = 0.0


class Episode(_Message, tag="episode"):
    """One sample of a group: its trajectory tensors ``[b, L]`` and how it ended."""

    task_id: TaskId
    sample_idx: SampleIdx
    group_size: GroupSize
    trajectory: dict[str, WireTensor]
    is_eval: bool = False
    data: dict[str, Any] = {}
    stop_reason: str = "stop"
    head_version: int = -1  # oldest version over generated tokens (-1: none generated)
    tail_version: int = -1  # newest version over generated tokens
    has_reward: bool = False  # the workflow set ``rewards`` itself
    worker_id: str = ""
    generated_at: float = 0.0
    # Vision: per trajectory row, the digests (rollstream.vision.image_digest) of the images
    # it shows, in the order of its image slots ([] for a text episode)...
    row_images: list[list[str]] = []
    # ...and the encoded images, by digest, that no earlier message of this run of the prompt
    # carried: each image goes out once per group, with the first episode that shows it.
    images: dict[str, bytes] = {}

    def __post_init__(self) -> None:
        _check_sample(self.sample_idx, self.group_size)


class SampleRejected(_Message, tag="rejected"):
    """A sample the workflow rejected (returned None) or failed on; the group can still complete."""

    task_id: TaskId
    sample_idx: SampleIdx
    group_size: GroupSize
    is_eval: bool = False
    reason: str = "rejected"
    failed: bool = False  # True: an exception, not a rejection; counted apart

    def __post_init__(self) -> None:
        _check_sample(self.sample_idx, self.group_size)


class TaskFailed(_Message, tag="task_failed"):
    """A whole prompt that could not be run; its group ends as a drop."""

    task_id: TaskId
    group_size: Annotated[int, msgspec.Meta(ge=0, le=MAX_GROUP_SIZE)] = 0  # 0: unknown
    is_eval: bool = False
    reason: str = ""


class ScoredEpisode(_Message, tag="scored"):
    """An episode with its scalar reward (also written into ``trajectory['rewards']``).

    ``reward_source``: "reward_fn" when the reward tier computed the rewards, "workflow" when
    it passed through rewards the workflow set itself (``episode.has_reward``).
    """

    episode: Episode
    reward: float
    scored_by: str = ""
    scored_at: float = 0.0
    reward_source: Literal["reward_fn", "workflow"] = "reward_fn"

    def __post_init__(self) -> None:
        if not math.isfinite(self.reward):
            raise ValueError(f"reward {self.reward} is not finite")


class EmittedGroup(_Message, tag="batch", kw_only=True):
    """One complete group, emitted on ``batches`` (wire tag ``batch``): its accepted samples'
    rows padded to one ``[N, L]`` tensor dict in ``packed`` (read it with ``group_arrays``,
    numpy, or ``group_tensors``, torch).

    ``sample_idx[r]``: the sample row ``r`` comes from. ``trainer_version`` is the trainer's
    version at emission as the grouping tier knew it, never older than ``tail_version``;
    ``trainer_version_known`` False says it is not what Redis answered at emission (Redis
    failed or lagged: the last version seen, or the tail's); ``staleness =
    trainer_version - head_version`` (``rollstream.trajectory.staleness``). ``rejected`` /
    ``failed``: how many samples the workflow rejected / failed; the accepted ones (those with
    rows) number ``group_size - rejected - failed``. Vision (empty for text): ``images`` holds
    the group's distinct encoded images once each; ``row_images[r]`` indexes those row ``r``
    shows, in the order of its image slots.
    """

    schema_version: int = EMITTED_GROUP_VERSION
    task_id: TaskId
    group_size: GroupSize
    sample_idx: list[SampleIdx]
    is_eval: bool = False
    trainer_version: int = 0
    trainer_version_known: bool = True
    head_version: int = -1
    tail_version: int = -1
    staleness: int = 0
    emitted_at: float = 0.0
    packed: PackedTensors
    rejected: Annotated[int, msgspec.Meta(ge=0)] = 0
    failed: Annotated[int, msgspec.Meta(ge=0)] = 0
    images: list[bytes] = []
    row_images: list[list[int]] = []

    def __post_init__(self) -> None:
        if self.rejected + self.failed > self.group_size:
            raise ValueError(f"group of {self.group_size} samples has {self.rejected} rejected and {self.failed} failed")
        if self.row_images and len(self.row_images) != len(self.sample_idx):
            raise ValueError(f"group has {len(self.sample_idx)} rows but {len(self.row_images)} row_images entries")


# The oldest version of a kind this reader reads (a kind not named: FIRST_SCHEMA_VERSION).
OLDEST_READABLE: dict[type, int] = {EmittedGroup: EMITTED_GROUP_VERSION}


class GroupDropped(_Message, tag="dropped"):
    """A group that ended without training data, with the reason; counted, never silent."""

    task_id: str
    reason: DropReason
    is_eval: bool = False
    detail: str = ""
    trainer_version: int = 0
    dropped_at: float = 0.0


class GroupOutcome(_Message, tag="outcome"):
    """Grouping changelog value: how a task's group ended (emitted or dropped)."""

    task_id: str
    outcome: Literal["emitted", "dropped"]
    source_partition: int
    max_offset: int
    at: float = 0.0
    # the trainer version the group's record was tagged with (-1: unknown, an older writer): a
    # version the trainer had reached, which an instance taking the partition never goes below
    trainer_version: int = -1


class DeadLetter(_Message, tag="dead_letter"):
    """A record a tier could not process: where it came from, what it was, and why."""

    tier: str
    source_topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    reason: str
    error_type: str = ""
    at: float = 0.0


class ProducerCursor(_Message, tag="cursor"):
    """A producer's position in its dataset, committed in the same transaction as its prompts.

    ``epoch``/``index`` name the NEXT sample to publish.
    """

    producer_id: str
    epoch: int
    index: int
    published: int = 0
    at: float = 0.0
    is_eval: bool = False  # the producer publishes eval prompts (they are not admitted)


class TrainerCommit(msgspec.Struct, kw_only=True):
    """What the trainer's consumer group commits beside its offsets on ``batches`` (Kafka keeps a
    metadata string with every committed offset, in ``__consumer_offsets``; this is JSON there):
    the ``step`` committed and ``stale_dropped``, the groups dropped as stale in all committed
    steps so far (cumulative, so a repeat is harmless). It returns staleness slots
    (``rollstream.state.budget``), and a budget rebuilt from the topics reads it back from Kafka
    (``rollstream.kafka.trainer_commits``), so a Redis that forgot it cannot keep them."""

    schema_version: int = FIRST_SCHEMA_VERSION
    step: int
    stale_dropped: int = 0


EpisodesMessage = Episode | SampleRejected | TaskFailed
ScoredMessage = ScoredEpisode | SampleRejected | TaskFailed
GroupMessage = EmittedGroup | GroupDropped  # a record of ``batches``: how a group ended
