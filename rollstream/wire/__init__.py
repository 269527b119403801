"""Wire schemas and codecs for every topic.

This package is numpy only: messages, decoders and the numpy tensor functions
(``decode_array``, ``group_arrays``, ``pack_arrays``...). The torch face of the wire
(``decode_tensor_dict``, ``group_tensors``, ``pack_tensor_dict``...) is
:mod:`rollstream.wire.torch_tensors`, imported by name where a model runs. The modules import
each other in one direction: ``dtypes`` <- ``tensor_codec`` <- ``packed`` <- ``messages`` <-
``codec`` <- ``torch_tensors``.
"""

from rollstream.wire.codec import (
    WireDecodeError,
    decode_cursor,
    decode_dead_letter,
    decode_episode,
    decode_group,
    decode_outcome,
    decode_prompt,
    decode_scored,
    decode_trainer_commit,
    encode,
    encode_trainer_commit,
    group_arrays,
)
from rollstream.wire.messages import (
    SCHEMA_VERSION,
    DeadLetter,
    EmittedGroup,
    Episode,
    GroupDropped,
    GroupOutcome,
    ProducerCursor,
    PromptTask,
    SampleRejected,
    ScoredEpisode,
    TaskFailed,
    TrainerCommit,
)
from rollstream.wire.packed import (
    ArrayArena,
    PackedTensors,
    allocate_arrays,
    check_packed,
    pack_arrays,
    unpack_arrays,
)
from rollstream.wire.tensor_codec import (
    WireTensor,
    decode_array,
    decode_arrays,
    encode_array,
    encode_arrays,
)

__all__ = [
    "SCHEMA_VERSION",
    "ArrayArena",
    "DeadLetter",
    "EmittedGroup",
    "Episode",
    "GroupDropped",
    "GroupOutcome",
    "PackedTensors",
    "ProducerCursor",
    "PromptTask",
    "SampleRejected",
    "ScoredEpisode",
    "TaskFailed",
    "TrainerCommit",
    "WireDecodeError",
    "WireTensor",
    "allocate_arrays",
    "check_packed",
    "decode_array",
    "decode_arrays",
    "decode_cursor",
    "decode_dead_letter",
    "decode_episode",
    "decode_group",
    "decode_outcome",
    "decode_prompt",
    "decode_scored",
    "decode_trainer_commit",
    "encode",
    "encode_array",
    "encode_arrays",
    "encode_trainer_commit",
    "group_arrays",
    "pack_arrays",
    "unpack_arrays",
]

