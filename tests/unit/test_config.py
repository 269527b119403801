"""Config: file < environment < --set, unknown keys rejected, secrets redacted."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.config import ConfigError, config_from_dict, load_config, redacted, secret_values


def test_file_then_environment_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  max_concurrent_rollouts: 2\nkafka:\n  bootstrap_servers: file:1\n")
    env = {"KAFKA_BOOTSTRAP_SERVERS": "env:2", "ROLLSTREAM__ROLLOUT__MAX_CONCURRENT_ROLLOUTS": "5"}
    assert load_config(path, environ=env).rollout.max_concurrent_rollouts == 5
    config = load_config(path, ["rollout.max_concurrent_rollouts=7"], environ=env)
    assert config.rollout.max_concurrent_rollouts == 7
    assert config.kafka.bootstrap_servers == "env:2"


def test_unknown_key_is_an_error_naming_its_path() -> None:
    with pytest.raises(ConfigError, match=r"unknown field `max_concurent_rollouts` - at `\$.rollout`"):
        load_config(overrides=["rollout.max_concurent_rollouts=3"], environ={})


def test_wrong_type_and_range_are_errors() -> None:
    with pytest.raises(ConfigError, match="rollout.max_concurrent_rollouts"):
        load_config(overrides=["rollout.max_concurrent_rollouts=lots"], environ={})
    with pytest.raises(ConfigError, match="producer.group_size"):
        load_config(overrides=["producer.group_size=0"], environ={})


def test_bad_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad, environ={})
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(overrides=["novalue"], environ={})


def test_secrets_are_redacted_and_listed() -> None:
    config = load_config(
        overrides=["kafka.sasl_password=hunter2", "redis.url=redis://u:s3cret@h:1/0"], environ={}
    )
    tree = redacted(config)
    assert tree["kafka"]["sasl_password"] == "***"
    assert "s3cret" not in tree["redis"]["url"]
    assert set(secret_values(config)) == {"hunter2", "s3cret"}


def test_a_key_that_moved_is_an_error_naming_where_it_went() -> None:
    with pytest.raises(ConfigError, match=r"trainer.batch_size is no longer a setting: groups per trainer step are staleness.groups_per_step"):
        config_from_dict({"trainer": {"batch_size": 4}})
    assert config_from_dict({"staleness": {"groups_per_step": 4}}).staleness.groups_per_step == 4


def test_staleness_batch_size_is_refused_naming_groups_per_step_in_a_file_and_the_environment(tmp_path: Path) -> None:
    moved = r"staleness.batch_size is no longer a setting: groups per trainer step are staleness.groups_per_step"
    path = tmp_path / "rollstream.yaml"
    path.write_text("staleness:\n  batch_size: 4\n")
    with pytest.raises(ConfigError, match=moved):
        load_config(path, environ={})
    with pytest.raises(ConfigError, match=moved):
        load_config(environ={"ROLLSTREAM__STALENESS__BATCH_SIZE": "4"})
    with pytest.raises(ConfigError, match=moved):
        load_config(overrides=["staleness.batch_size=4"], environ={})
    config = load_config(environ={"ROLLSTREAM__STALENESS__GROUPS_PER_STEP": "4"})
    assert config.staleness.groups_per_step == 4
