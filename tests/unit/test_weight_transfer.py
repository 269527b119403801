"""The weight-transfer protocol's pure pieces: buckets, packing, the manifest, the tensors a
trainer sends (what the gloo transfer between processes carries is proved against a real vLLM
server in tests/integration/test_vllm_weight_transfer.py)."""

from __future__ import annotations

import torch

from rollstream.engines.weight_transfer import ALIGN, Manifest, pack, plan, unpack
from rollstream.testing.tiny import tiny_model_dir
from rollstream.trainer.weight_sender import named_tensors


def tensors() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=generator)),
        ("b.weight", torch.randn(7, generator=generator).to(torch.bfloat16)),
        ("c.big", torch.randn(64, 64, generator=generator)),  # 16 KiB: a bucket of its own
        ("d.ids", torch.arange(5, dtype=torch.int64)),
    ]


def test_every_tensor_comes_back_bit_for_bit_from_its_bucket() -> None:
    items = tensors()
    manifest = Manifest.decode(plan(4, items, bucket_bytes=1024).encode())
    assert manifest.version == 4 and [e.name for e in manifest.entries] == [n for n, _ in items]
    assert len(manifest.bucket_sizes) == 3 and manifest.entries[2].bucket == 1  # the big one alone
    assert all(e.offset % ALIGN == 0 for e in manifest.entries)
    by_name = dict(items)
    back: dict[str, torch.Tensor] = {}
    for bucket in range(len(manifest.bucket_sizes)):
        buffer = pack(manifest, bucket, by_name, torch.device("cpu"))
        assert buffer.numel() == manifest.bucket_sizes[bucket]
        back.update(unpack(manifest, bucket, buffer))
    for name, tensor in items:
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name], tensor), name


def test_a_tied_head_is_sent_once_under_the_embedding_name() -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir())  # ties its output head
    names = [name for name, _ in named_tensors(model)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names)) == len({id(p) for p in model.parameters()})
    wrapped = type("DDP", (), {"module": model})()  # what DistributedDataParallel exposes
    assert [name for name, _ in named_tensors(wrapped)] == names
