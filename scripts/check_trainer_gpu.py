"""Check the multi-rank trainer path on GPUs: NCCL as the default backend, rollstream's gloo process group
beside it, a GRPO step on CUDA per rank. No broker: the steps come from a dump replay.

    python scripts/check_trainer_gpu.py --ranks 2          # starts torchrun itself
    python scripts/check_trainer_gpu.py --ranks 2 --cpu    # the same with gloo on CPU (no GPU needed)

It writes a ``batches`` dump (``rollstream replay --to-jsonl`` format) of ``4 * ranks`` groups
and a tiny offline model, then runs ``torchrun --nproc-per-node RANKS`` of itself. Each rank
initializes NCCL (one GPU per rank; with fewer GPUs than ranks they share GPU 0 and the model is
not wrapped in DDP, since NCCL refuses two ranks on one GPU), reads the replay with
``TrainerSteps`` (shares scattered over rollstream's gloo process group), takes an example-trainer GRPO
step on CUDA and commits (a replay commits nothing). Checks: every rank got a share of every
step, in lockstep, the shares are disjoint and cover every group, and (with DDP) the weights are
identical on every rank after the steps. Prints PASS / FAIL; exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEPS = 4


def write_inputs(workdir: Path, ranks: int) -> tuple[Path, Path]:
    """A dump of ``STEPS * ranks`` one-group records and the tiny model."""
    import torch

    from rollstream.consumers.grouping.records import build_emitted_group
    from rollstream.consumers.grouping.groups import CompleteGroup
    from rollstream.tiny.text_model import build_tiny_model, default_corpus
    from rollstream.tools.render import message_json
    from rollstream.wire import Episode, ScoredEpisode
    from rollstream.wire.torch_tensors import encode_tensor_dict

    model = build_tiny_model(workdir / "model", default_corpus(), vocab_size=300, hidden_size=32, num_layers=2, num_heads=4)
    lines = []
    for g in range(STEPS * ranks):
        episodes = []
        for i in range(4):
            prompt, generated = 4 + g % 3, 3 + (g + i) % 5
            length = prompt + generated
            loss = torch.tensor([[0] * prompt + [1] * generated], dtype=torch.int32)
            tensors = {
                "input_ids": torch.randint(1, 290, (1, length), dtype=torch.int32),
                "attention_mask": torch.ones((1, length), dtype=torch.bool),
                "loss_mask": loss,
                "logprobs": torch.where(loss.bool(), -1.5, 0.0).to(torch.float32),
                "versions": torch.where(loss.bool(), 0, -1).to(torch.int32),
                "rewards": torch.tensor([float(i % 2)]),
            }
            episode = Episode(task_id=f"task-{g}", sample_idx=i, group_size=4, trajectory=encode_tensor_dict(tensors))
            episodes.append(ScoredEpisode(episode=episode, reward=float(i % 2)))
        batch = build_emitted_group(CompleteGroup(f"task-{g}", 4, False, tuple(episodes), 0, 0, 0, 0, 0.0), trainer_version=0)
        lines.append(b'{"partition":0,"offset":%d,"key":null,"message":' % g + message_json(batch) + b"}\n")
    dump = workdir / "batches.jsonl"
    dump.write_bytes(b"".join(lines))
    return dump, model


def worker(dump: Path, model_path: Path, out: Path, cpu: bool) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rollstream.trainer.grpo import group_advantages, policy_update
    from rollstream.config import config_from_dict
    from rollstream.trainer import DumpReplay, TrainerSteps

    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = cpu or torch.cuda.device_count() >= world
    if cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if ddp else 0)
        torch.cuda.set_device(device)
    config = config_from_dict({"staleness": {"groups_per_step": world}})
    model = AutoModelForCausalLM.from_pretrained(model_path).to(device)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=None if cpu else [device.index])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = []
    with TrainerSteps(config, source=lambda: DumpReplay(config, dump), wait_seconds=1.0) as steps:
        for step in steps:
            advantages = group_advantages(step.tensors["rewards"], step.row_task)
            stats = policy_update(model, optimizer, step.tensors, advantages)
            seen.append({"step": step.step, "tasks": step.task_ids, "loss": stats.loss.loss})
            steps.commit(step)
    weights = (model.module if ddp else model).lm_head.weight.detach().float()
    out.joinpath(f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world": world, "ddp": ddp, "device": str(device), "backend": dist.get_backend(),
        "gpu": "-" if cpu else torch.cuda.get_device_name(device),
        "steps": seen, "checksum": float(weights.sum().item()), "nccl": "-" if cpu else str(torch.cuda.nccl.version()),
    }))
    dist.destroy_process_group()


def check(out: Path, ranks: int) -> list[tuple[bool, str]]:
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    steps = [[s["step"] for s in r["steps"]] for r in results]
    tasks = [t for r in results for s in r["steps"] for t in s["tasks"]]
    checks = [
        (all(s == list(range(1, STEPS + 1)) for s in steps), f"lockstep: every rank trained steps 1..{STEPS} ({steps})"),
        (all(s["tasks"] for r in results for s in r["steps"]), "every rank had a share of every step"),
        (sorted(tasks) == sorted(f"task-{g}" for g in range(STEPS * ranks)), "shares disjoint, covering every group"),
    ]
    if results[0]["ddp"]:
        sums = {round(r["checksum"], 4) for r in results}
        checks.append((len(sums) == 1, f"DDP over {results[0]['backend']} kept the weights identical on every rank ({sums})"))
    info = ", ".join(f"rank {r['rank']}: {r['backend']} {r['device']} {r['gpu']} ddp={r['ddp']} nccl={r['nccl']}" for r in results)
    checks.append((True, f"INFO {info}"))
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU instead of NCCL on GPUs")
    parser.add_argument("--worker", nargs=3, metavar=("DUMP", "MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*(Path(p) for p in args.worker), cpu=args.cpu)
        return 0
    with tempfile.TemporaryDirectory(prefix="rollstream-gpu-check-") as tmp:
        workdir = Path(tmp)
        dump, model = write_inputs(workdir, args.ranks)
        env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
                __file__, "--worker", str(dump), str(model), str(workdir), *(["--cpu"] if args.cpu else [])]
        done = subprocess.run(argv, env=env, cwd=REPO)
        if done.returncode != 0:
            print(f"FAIL  torchrun exited {done.returncode}")
            return 1
        failed = False
        for ok, text in check(workdir, args.ranks):
            print(text if text.startswith("INFO") else f"{'PASS' if ok else 'FAIL'}  {text}")
            failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
