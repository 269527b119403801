"""The command-line flags an inference server is started with, from ``rollout.launch``
(:class:`~rollstream.config.ServerLaunchConfig`), for vLLM and SGLang alike.

Callers may rely on:

* ``device`` "auto" is cuda when torch sees a GPU, else cpu; ``dtype`` "auto" is bfloat16 on
  cuda (half the memory of float32, and the fast attention kernels) and float32 on cpu (the
  CPU server's tested dtype);
* each setting maps to the flag of the same meaning on each server: dtype, eager execution
  when ``cuda_graphs`` is off, no prefix cache when ``prefix_caching`` is off, batch size, tensor parallelism, context length (omitted at 0: the model's own),
  memory fraction (cuda only; a CPU server sizes its KV cache by environment);
* the flags rollstream itself needs (vLLM's token-in/token-out route, logprobs mode, worker
  extension and weight fence) are not these: ``rollstream.dev.vllm_server.server_argv`` adds them.
"""

from __future__ import annotations

from rollstream.config import ServerLaunchConfig


def resolved_device(launch: ServerLaunchConfig) -> str:
    """``launch.device``, with "auto" decided by what torch sees."""
    if launch.device != "auto":
        return launch.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolved_dtype(launch: ServerLaunchConfig, device: str) -> str:
    """``launch.dtype``, with "auto" bfloat16 on cuda and float32 elsewhere."""
    if launch.dtype != "auto":
        return launch.dtype
    return "bfloat16" if device == "cuda" else "float32"


def vllm_flags(launch: ServerLaunchConfig, device: str) -> list[str]:
    """vLLM's ``api_server`` flags for ``launch`` on ``device`` (resolved: cpu or cuda)."""
    flags = ["--dtype", resolved_dtype(launch, device)]
    if launch.max_model_len:
        flags += ["--max-model-len", str(launch.max_model_len)]
    flags += ["--max-num-seqs", str(launch.max_num_seqs)]
    if not launch.cuda_graphs:
        flags.append("--enforce-eager")
    if launch.tensor_parallel_size > 1:
        flags += ["--tensor-parallel-size", str(launch.tensor_parallel_size)]
    flags.append("--enable-prefix-caching" if launch.prefix_caching else "--no-enable-prefix-caching")
    if device == "cuda":
        flags += ["--gpu-memory-utilization", f"{launch.memory_fraction:g}"]
    return flags


def sglang_flags(launch: ServerLaunchConfig, device: str) -> list[str]:
    """SGLang's ``launch_server`` flags for ``launch`` on ``device`` (resolved: cpu or cuda)."""
    flags = ["--dtype", resolved_dtype(launch, device), "--max-running-requests", str(launch.max_num_seqs),
             "--tp-size", str(launch.tensor_parallel_size)]
    if launch.max_model_len:
        flags += ["--context-length", str(launch.max_model_len)]
    if not launch.cuda_graphs:
        flags.append("--disable-cuda-graph")
    if not launch.prefix_caching:
        flags.append("--disable-radix-cache")
    if device == "cuda":
        flags += ["--mem-fraction-static", f"{launch.memory_fraction:g}"]
    return flags
