"""The configuration schema: defaults, presets, and the error message every front end shows."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from torchpass.core.config import (
    ConfigError,
    TorchPassConfig,
    config_from_mapping,
    load_preset,
    preset_names,
    register_with_hydra,
)
import torchpass.core.config as config_module


def error_for(data, source: str = "torchpass config") -> str:
    with pytest.raises(ConfigError) as info:
        config_from_mapping(data, source=source)
    return str(info.value)


# ---- defaults and presets ----------------------------------------------------


def test_defaults_validate():
    config = TorchPassConfig().validate()
    assert config == config_from_mapping({})
    assert config == config_from_mapping(None)
    assert config.redundancy == "auto"
    assert config.heartbeat_timeout_s > config.heartbeat_interval_s


def test_to_dict_round_trips_through_config_from_mapping():
    config = config_from_mapping({"spares_per_node": 2, "telemetry": {"final_digest": True}})
    assert config_from_mapping(config.to_dict()) == config


def test_presets_are_shipped():
    assert {"default", "fast_detect", "buddy"} <= set(preset_names())


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads(name):
    config = load_preset(name)
    assert isinstance(config, TorchPassConfig)


def test_default_preset_equals_the_schema_defaults():
    assert load_preset("default") == TorchPassConfig()


def test_preset_values_and_overrides():
    assert load_preset("buddy").redundancy == "buddy"
    fast = load_preset("fast_detect", {"spares_per_node": 3, "telemetry": {"console": False}})
    assert fast.heartbeat_timeout_s == 3.0
    assert fast.spares_per_node == 3
    assert fast.telemetry.console is False
    assert fast.telemetry.final_digest is False  # the nested default survives a partial override


def test_preset_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("defaults:\n  - schema\n  - _self_\nspares_per_node: 0\n")
    assert load_preset(str(path)).spares_per_node == 0


def test_preset_error_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("spares_per_node: -2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*spares_per_node: got -2"):
        load_preset(str(path))


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ConfigError) as info:
        load_preset("no_such_preset")
    message = str(info.value)
    assert "'no_such_preset' not found" in message
    for name in preset_names():
        assert name in message


# ---- unknown keys -------------------------------------------------------------


def test_unknown_key_names_it_suggests_the_close_match_and_lists_valid_keys():
    message = error_for({"heartbeat_timout_s": 3})
    assert "unknown key heartbeat_timout_s" in message
    assert "did you mean 'heartbeat_timeout_s'" in message
    assert "valid keys:" in message
    for name in ("enabled", "spares_per_node", "redundancy", "telemetry", "transfer_chunk_bytes"):
        assert name in message


def test_unknown_key_without_close_match_has_no_suggestion():
    message = error_for({"zzzz": 1})
    assert "unknown key zzzz" in message
    assert "did you mean" not in message
    assert "valid keys:" in message


def test_error_message_starts_with_the_source():
    message = error_for({"nope": 1}, source='DeepSpeed config block "torchpass"')
    assert message.startswith('DeepSpeed config block "torchpass": ')


def test_nested_unknown_key_is_named_with_its_path():
    message = error_for({"telemetry": {"consle": False}})
    assert "unknown key telemetry.consle" in message
    assert "did you mean 'console'" in message
    assert "console" in message and "final_digest" in message


def test_nested_values_are_applied():
    config = config_from_mapping({"telemetry": {"console": False, "final_digest": True}})
    assert config.telemetry.console is False
    assert config.telemetry.final_digest is True


def test_nested_section_must_be_a_mapping():
    message = error_for({"telemetry": 3})
    assert "telemetry" in message and "expected a mapping" in message


# ---- wrong types ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"heartbeat_timeout_s": "abc"}, "heartbeat_timeout_s: got 'abc' (str); expected a number"),
        ({"spares_per_node": "2"}, "spares_per_node: got '2' (str); expected an integer"),
        ({"spares_per_node": True}, "spares_per_node: got True (bool); expected an integer"),
        ({"spares_per_node": 1.5}, "spares_per_node: got 1.5 (float); expected an integer"),
        ({"enabled": 1}, "enabled: got 1 (int); expected a boolean"),
        ({"verify_replicas": "yes"}, "verify_replicas: got 'yes' (str); expected a boolean"),
        ({"hang_timeout_s": False}, "hang_timeout_s: got False (bool); expected a number"),
        ({"run_dir": 3}, "run_dir: got 3 (int); expected a string"),
        ({"telemetry": {"final_digest": "yes"}}, "telemetry.final_digest: got 'yes' (str); expected a boolean"),
    ],
)
def test_wrong_type_names_field_value_and_expected_type(data, fragment):
    assert fragment in error_for(data)


def test_int_is_accepted_for_a_float_field():
    config = config_from_mapping({"heartbeat_timeout_s": 20})
    assert config.heartbeat_timeout_s == 20.0
    assert type(config.heartbeat_timeout_s) is float


# ---- out of range -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"spares_per_node": -1}, "spares_per_node: got -1; expected an integer >= 0"),
        ({"transfer_retries": -1}, "transfer_retries: got -1; expected an integer >= 0"),
        ({"heartbeat_interval_s": 0}, "heartbeat_interval_s: got 0.0; expected a number > 0"),
        ({"rebuild_timeout_s": -5}, "rebuild_timeout_s: got -5.0; expected a number > 0"),
        ({"buddy_interval_steps": 0}, "buddy_interval_steps: got 0; expected an integer >= 1"),
        ({"redundancy": "mirror"}, "redundancy: got 'mirror'; expected one of 'auto', 'replica', 'buddy'"),
        ({"transfer_chunk_bytes": 65535}, "transfer_chunk_bytes: got 65535; expected an integer in [65536, 1073741824]"),
        ({"transfer_chunk_bytes": (1 << 30) + 1}, "transfer_chunk_bytes: got 1073741825; expected an integer in"),
    ],
)
def test_out_of_range_names_field_and_what_is_valid(data, fragment):
    assert fragment in error_for(data)


@pytest.mark.parametrize("chunk", [64 << 10, 1 << 30])
def test_chunk_size_bounds_are_inclusive(chunk):
    assert config_from_mapping({"transfer_chunk_bytes": chunk}).transfer_chunk_bytes == chunk


@pytest.mark.parametrize("mode", ["auto", "replica", "buddy"])
def test_every_redundancy_mode_is_accepted(mode):
    assert config_from_mapping({"redundancy": mode}).redundancy == mode


@pytest.mark.parametrize(("interval", "timeout"), [(1.0, 1.0), (2.0, 1.5), (5, 3)])
def test_heartbeat_timeout_must_exceed_interval(interval, timeout):
    message = error_for({"heartbeat_interval_s": interval, "heartbeat_timeout_s": timeout})
    assert "heartbeat_timeout_s" in message
    assert "greater than heartbeat_interval_s" in message


def test_validate_checks_cross_field_constraint_on_a_constructed_config():
    with pytest.raises(ConfigError, match="heartbeat_interval_s"):
        TorchPassConfig(heartbeat_interval_s=5.0, heartbeat_timeout_s=2.0).validate()


# ---- environment ----------------------------------------------------------------------


def test_config_from_env(monkeypatch):
    monkeypatch.delenv("TORCHPASS_CONFIG", raising=False)
    assert config_module.config_from_env() == TorchPassConfig()
    monkeypatch.setenv("TORCHPASS_CONFIG", '{"spares_per_node": 4}')
    assert config_module.config_from_env().spares_per_node == 4
    monkeypatch.setenv("TORCHPASS_CONFIG", '{"spares_per_nod": 4}')
    with pytest.raises(ConfigError, match=r"TORCHPASS_CONFIG.*did you mean 'spares_per_node'"):
        config_module.config_from_env()


# ---- Hydra ------------------------------------------------------------------------------


def test_register_with_hydra_stores_the_schema():
    from hydra.core.config_store import ConfigStore

    register_with_hydra()
    store = ConfigStore.instance()
    assert "schema.yaml" in store.list("torchpass")
    node = store.load("torchpass/schema.yaml")
    assert node.group == "torchpass"
    assert OmegaConf.get_type(node.node) is TorchPassConfig
    assert OmegaConf.to_container(node.node) == TorchPassConfig().to_dict()


@pytest.mark.parametrize("name", preset_names())
def test_preset_merges_into_the_structured_schema(name):
    register_with_hydra()
    schema = OmegaConf.structured(TorchPassConfig)
    preset = OmegaConf.load(config_module._presets_dir() / f"{name}.yaml")
    assert list(preset.pop("defaults")) == ["schema", "_self_"]
    merged = OmegaConf.merge(schema, preset)
    assert OmegaConf.get_type(merged) is TorchPassConfig
    assert config_from_mapping(OmegaConf.to_container(merged)) == load_preset(name)


def test_structured_merge_rejects_a_mistyped_preset_value():
    from omegaconf.errors import ValidationError

    schema = OmegaConf.structured(TorchPassConfig)
    with pytest.raises(ValidationError):
        OmegaConf.merge(schema, OmegaConf.create({"spares_per_node": "abc"}))


def test_hydra_composes_a_preset_with_the_schema():
    from hydra import compose, initialize_config_dir

    register_with_hydra()
    with initialize_config_dir(config_dir=str(config_module._presets_dir().parent), version_base=None):
        cfg = compose(config_name="torchpass/fast_detect")
    assert OmegaConf.get_type(cfg.torchpass) is TorchPassConfig
    assert config_from_mapping(OmegaConf.to_container(cfg.torchpass)) == load_preset("fast_detect")


def test_the_store_bound_follows_the_heartbeat_timeout_unless_set() -> None:
    from torchpass.core.config import ConfigError, config_from_mapping

    assert config_from_mapping({}).store_bound_s() == 30.0
    assert config_from_mapping({"heartbeat_timeout_s": 60.0, "heartbeat_interval_s": 20.0}).store_bound_s() == 180.0
    assert config_from_mapping({"store_timeout_s": 12.0}).store_bound_s() == 12.0
    with pytest.raises(ConfigError, match=r"store_timeout_s: got 5.0; expected a number greater than heartbeat_timeout_s \(10.0\)"):
        config_from_mapping({"store_timeout_s": 5.0})
