"""rollout.launch: one set of server settings, the same meaning in vLLM's flags and SGLang's,
with GPU defaults on a GPU and the tested CPU defaults on a CPU."""

from __future__ import annotations

import pytest

from rollstream.config import ConfigError, ServerLaunchConfig, load_config
from rollstream.engines.server_launch import resolved_dtype, sglang_flags, vllm_flags


def value(flags: list[str], flag: str) -> str | None:
    return flags[flags.index(flag) + 1] if flag in flags else None


def test_auto_dtype_is_bfloat16_on_gpus_and_float32_on_cpus() -> None:
    launch = ServerLaunchConfig()
    assert resolved_dtype(launch, "cuda") == "bfloat16" and resolved_dtype(launch, "cpu") == "float32"
    assert value(vllm_flags(launch, "cuda"), "--dtype") == "bfloat16"
    assert value(sglang_flags(launch, "cpu"), "--dtype") == "float32"
    assert value(vllm_flags(ServerLaunchConfig(dtype="float16"), "cuda"), "--dtype") == "float16"


def test_each_setting_becomes_the_flag_of_the_same_meaning_on_each_server() -> None:
    launch = ServerLaunchConfig(cuda_graphs=False, max_num_seqs=64, memory_fraction=0.7, tensor_parallel_size=2,
                                max_model_len=4096)
    vllm, sglang = vllm_flags(launch, "cuda"), sglang_flags(launch, "cuda")
    assert "--enforce-eager" in vllm and "--disable-cuda-graph" in sglang
    assert value(vllm, "--max-num-seqs") == value(sglang, "--max-running-requests") == "64"
    assert value(vllm, "--gpu-memory-utilization") == value(sglang, "--mem-fraction-static") == "0.7"
    assert value(vllm, "--tensor-parallel-size") == value(sglang, "--tp-size") == "2"
    assert value(vllm, "--max-model-len") == value(sglang, "--context-length") == "4096"


def test_defaults_leave_out_what_does_not_apply() -> None:
    cpu = vllm_flags(ServerLaunchConfig(max_model_len=0), "cpu")
    assert "--gpu-memory-utilization" not in cpu and "--max-model-len" not in cpu  # 0: the model's own
    assert "--enforce-eager" not in cpu and "--tensor-parallel-size" not in cpu


def test_settings_come_from_the_file_and_the_environment(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  launch:\n    dtype: bfloat16\n    max_num_seqs: 32\n")
    config = load_config(path, environ={"ROLLSTREAM__ROLLOUT__LAUNCH__CUDA_GRAPHS": "false"})
    assert (config.rollout.launch.dtype, config.rollout.launch.max_num_seqs) == ("bfloat16", 32)
    assert config.rollout.launch.cuda_graphs is False
    with pytest.raises(ConfigError, match="dtype"):
        load_config(None, ["rollout.launch.dtype=float8"], environ={})
    with pytest.raises(ConfigError, match="memory_fraction"):
        load_config(None, ["rollout.launch.memory_fraction=1.5"], environ={})


@pytest.mark.parametrize("item, named", [("dtype=float64", "dtype"), ("gpus=2", "gpus"), ("dtype", "KEY=VALUE")])
def test_the_demo_refuses_a_bad_launch_setting_before_it_starts_anything(
    item: str, named: str, capsys: pytest.CaptureFixture[str],
) -> None:
    from rollstream.cli import main

    assert main(["demo", "--engine", "vllm", "--launch", item]) == 2
    assert named in capsys.readouterr().err


def test_the_demo_passes_its_launch_settings_to_the_server() -> None:
    from rollstream.demo.settings import DemoSettings, demo_launch

    launch = demo_launch(DemoSettings(launch={"dtype": "bfloat16", "max_num_seqs": 16}))
    assert (launch.dtype, launch.max_num_seqs, launch.max_model_len) == ("bfloat16", 16, 256)
