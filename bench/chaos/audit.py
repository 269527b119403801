"""The chaos run's token audit (a run on a vLLM server): every generated token on ``batches``,
its logprob recomputed by a forward pass of the weights of the version it is tagged with."""

from __future__ import annotations

from pathlib import Path

from harness.logprob_audit import LogprobAuditor, LogprobTagAudit
from rollstream.wire import EmittedGroup
from rollstream.wire.torch_tensors import unpack_tensor_dict


def audit_groups(groups: list[EmittedGroup], model: Path, checkpoints: Path) -> LogprobTagAudit:
    """Audit every row of ``groups``: version 0 is ``model``, version v the checkpoint ``v<v>``
    under ``checkpoints`` (the example trainer's layout). A token whose version has no weights
    on disk counts as mis-tagged (with an example saying so)."""
    weights = {0: model, **{int(p.name[1:]): p for p in checkpoints.glob("v*") if p.name[1:].isdigit()}}
    auditor = LogprobAuditor([weights.get(v, checkpoints / f"v{v}") for v in range(max(weights) + 1)])
    for group in groups:
        tensors = unpack_tensor_dict(group.packed)
        for row in range(tensors["input_ids"].shape[0]):
            n = int(tensors["attention_mask"][row].sum())
            versions = tensors["versions"][row, :n].tolist()
            missing = {v for v in versions if v >= 0 and v not in weights}
            if missing:
                auditor.result.mistagged += 1
                auditor.result.examples.append(f"{group.task_id} row {row}: no weights on disk for versions {missing}")
                continue
            auditor.row(tensors["input_ids"][row, :n].tolist(), tensors["loss_mask"][row, :n].bool().tolist(),
                        tensors["logprobs"][row, :n].tolist(), versions, f"{group.task_id} row {row}")
    return auditor.result
