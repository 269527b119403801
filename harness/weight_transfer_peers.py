"""Peers of a weight transfer that die in the middle of it, as processes of their own (run as
``python -m harness.weight_transfer_peers ...``), built from the product's own pieces:

* ``trainer REDIS_URL EXPERIMENT VERSION``: a trainer's rank 0 that opens ``VERSION`` on a
  :class:`~rollstream.trainer.weight_sender.WeightSender`, publishes it to Redis, and is
  SIGKILLed by itself as soon as a server joined (before it sent a byte);
* ``server ADDRESS VERSION NAME``: a server's worker that joins the trainer's transfer of
  ``VERSION`` (:class:`~rollstream.engines.weight_transfer.Receiver`), prints ``joined`` and
  waits, to be SIGKILLed by the test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from rollstream.api.engine import WeightUpdate
from rollstream.config import WeightSenderConfig
from rollstream.engines.weight_transfer import Receiver
from rollstream.state.client import RedisKeys
from rollstream.state.version_store import VersionStore
from rollstream.trainer.weight_sender import WeightSender, named_tensors


def trainer(redis_url: str, experiment: str, version: int) -> None:
    import redis.asyncio as aioredis
    from transformers import AutoModelForCausalLM

    from rollstream.testing.tiny import tiny_model_dir

    sender = WeightSender(WeightSenderConfig(timeout_seconds=30))
    sender.open(version, named_tensors(AutoModelForCausalLM.from_pretrained(tiny_model_dir())))

    async def publish() -> None:
        client = aioredis.from_url(redis_url)
        update = WeightUpdate(version, "", sender.address, time.time() + 30, "gloo")
        await VersionStore(client, RedisKeys(experiment, "t0")).publish_newer(update)
        await client.aclose()

    asyncio.run(publish())
    print(f"published {sender.address}", flush=True)
    while int(sender._store.add(f"{sender._session.name}/tickets", 0)) < 1:  # type: ignore[union-attr]
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGKILL)


def server(address: str, version: int, name: str) -> None:
    receiver = Receiver(address, version, name, timeout=60)
    receiver.join()
    print("joined", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "trainer":
        trainer(args[0], args[1], int(args[2]))
    else:
        server(args[0], int(args[1]), args[2])
