"""The "torchpass" block of a DeepSpeed config: validation and mapping onto TorchPassConfig (no DeepSpeed engine)."""

from __future__ import annotations

import pytest

from torchpass.adapters.deepspeed.config import LAUNCHER_SETTINGS, block_of, resolve_block
from torchpass.core.config import ConfigError, TorchPassConfig, config_from_mapping


def test_a_config_without_the_block_has_none() -> None:
    assert block_of({"train_batch_size": 8}) is None


def test_the_block_must_be_an_object() -> None:
    with pytest.raises(ConfigError, match=r'DeepSpeed config block "torchpass": got True \(bool\); expected an object'):
        block_of({"torchpass": True})


def test_a_misspelled_key_is_named_with_the_closest_spelling() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_block({"enabled": True, "heartbeat_timout_s": 5}, TorchPassConfig())
    message = str(err.value)
    assert message.startswith('DeepSpeed config block "torchpass": unknown key heartbeat_timout_s')
    assert "did you mean 'heartbeat_timeout_s'?" in message


def test_a_bad_value_names_the_key_and_what_is_valid() -> None:
    with pytest.raises(ConfigError, match=r'"torchpass": buddy_interval_steps: got 0; expected an integer >= 1'):
        resolve_block({"buddy_interval_steps": 0}, TorchPassConfig())
    with pytest.raises(ConfigError, match=r"chaos\.kill_point: got 'nowhere'; expected one of"):
        resolve_block({"chaos": {"kill_point": "nowhere"}}, TorchPassConfig())


@pytest.mark.parametrize("key", sorted(LAUNCHER_SETTINGS))
def test_launcher_settings_are_refused_with_the_flag_to_use(key: str) -> None:
    head, _, leaf = key.rpartition(".")
    block = {head: {leaf: False}} if head else {leaf: 2 if leaf == "spares_per_node" else "x"}
    with pytest.raises(ConfigError, match=f"{key}: torchpass launch reads this .*{LAUNCHER_SETTINGS[key].split()[2]}"):
        resolve_block(block, TorchPassConfig())


def test_the_block_overrides_only_what_it_sets() -> None:
    launched = config_from_mapping({"heartbeat_timeout_s": 3.0, "heartbeat_interval_s": 0.5, "redundancy": "buddy"})
    config = resolve_block({"buddy_interval_steps": 2, "chaos": {"kill_rank": 1}}, launched)
    assert config.buddy_interval_steps == 2 and config.chaos.kill_rank == 1
    assert config.heartbeat_timeout_s == 3.0 and config.redundancy == "buddy" and config.enabled


def test_cross_field_rules_apply_to_the_merged_config() -> None:
    launched = config_from_mapping({"heartbeat_timeout_s": 3.0, "heartbeat_interval_s": 0.5})
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        resolve_block({"heartbeat_interval_s": 5.0}, launched)
