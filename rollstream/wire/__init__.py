"""Wire schemas and codecs for every topic."""

from rollstream.wire.codec import (
    WireDecodeError,
    decode_batch,
    decode_dead_letter,
    decode_episode,
    decode_outcome,
    decode_prompt,
    decode_scored,
    encode,
)
from rollstream.wire.messages import (
    SCHEMA_VERSION,
    Batch,
    DeadLetter,
    Episode,
    GroupDropped,
    GroupOutcome,
    PromptTask,
    SampleRejected,
    ScoredEpisode,
    TaskFailed,
)
from rollstream.wire.tensor_codec import (
    WireTensor,
    decode_tensor,
    decode_tensor_dict,
    encode_tensor,
    encode_tensor_dict,
)

__all__ = [
    "SCHEMA_VERSION",
    "Batch",
    "DeadLetter",
    "Episode",
    "GroupDropped",
    "GroupOutcome",
    "PromptTask",
    "SampleRejected",
    "ScoredEpisode",
    "TaskFailed",
    "WireDecodeError",
    "WireTensor",
    "decode_batch",
    "decode_dead_letter",
    "decode_episode",
    "decode_outcome",
    "decode_prompt",
    "decode_scored",
    "decode_tensor",
    "decode_tensor_dict",
    "encode",
    "encode_tensor",
    "encode_tensor_dict",
]
