"""Wire schemas and codecs for every topic.

Importing this package does not import torch: messages, decoders and the numpy tensor
functions (``decode_array``, ``batch_arrays``, ``pack_arrays``...) are plain numpy. The torch
functions (``decode_tensor_dict``, ``batch_tensors``, ``pack_tensor_dict``...) live in
``rollstream.wire.torch_tensors`` and are importable from here as before; torch is imported
when one of them is first asked for.
"""

from typing import Any

from rollstream.wire.codec import (
    WireDecodeError,
    batch_arrays,
    decode_batch,
    decode_cursor,
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
    ProducerCursor,
    PromptTask,
    SampleRejected,
    ScoredEpisode,
    TaskFailed,
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

# the torch face of the wire (rollstream.wire.torch_tensors), imported on first use
_TORCH_NAMES = (
    "allocate_packed",
    "batch_tensors",
    "decode_tensor",
    "decode_tensor_dict",
    "encode_tensor",
    "encode_tensor_dict",
    "pack_tensor_dict",
    "unpack_tensor_dict",
)

__all__ = [
    "SCHEMA_VERSION",
    "ArrayArena",
    "Batch",
    "DeadLetter",
    "Episode",
    "GroupDropped",
    "GroupOutcome",
    "PackedTensors",
    "ProducerCursor",
    "PromptTask",
    "SampleRejected",
    "ScoredEpisode",
    "TaskFailed",
    "WireDecodeError",
    "WireTensor",
    "allocate_arrays",
    "batch_arrays",
    "check_packed",
    "decode_array",
    "decode_arrays",
    "decode_batch",
    "decode_cursor",
    "decode_dead_letter",
    "decode_episode",
    "decode_outcome",
    "decode_prompt",
    "decode_scored",
    "encode",
    "encode_array",
    "encode_arrays",
    "pack_arrays",
    "unpack_arrays",
    *_TORCH_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from rollstream.wire import torch_tensors

        return getattr(torch_tensors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
