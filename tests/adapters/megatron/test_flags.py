"""``--torchpass`` and ``--torchpass-*``: one flag per config field, errors that name the flag."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from torchpass.adapters.megatron.flags import add_torchpass_args, config_flags, config_from_args
from torchpass.core.config import ConfigError, TorchPassConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    parser.add_argument("--num-layers", type=int)
    return add_torchpass_args(parser)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str], known: bool = False) -> str:
    parser = _parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_known_args(argv) if known else parser.parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_every_config_field_has_a_flag_named_after_it() -> None:
    flags = {f.flag: f.field for f in config_flags()}
    assert flags["--torchpass-buddy-interval-steps"] == "buddy_interval_steps"
    assert flags["--torchpass-chaos-kill-rank"] == "chaos.kill_rank"
    assert flags["--torchpass-telemetry-final-digest"] == "telemetry.final_digest"
    top = {f.name for f in dataclasses.fields(TorchPassConfig)} - {
        "enabled", "spares_per_node", "run_dir", "signals", "metrics", "telemetry", "chaos", "controller_lease_s"
    }
    assert top <= set(flags.values())
    # Read by the launcher before the script starts: a script flag could not act on them.
    assert "--torchpass-spares-per-node" not in flags and "--torchpass-run-dir" not in flags
    assert "--torchpass-controller-lease-s" not in flags
    assert not any(flag.startswith("--torchpass-signals") for flag in flags)


def test_flags_set_their_fields_over_the_base_config() -> None:
    args = _parser().parse_args(
        ["--num-layers", "2", "--torchpass", "--torchpass-buddy-interval-steps", "3", "--torchpass-redundancy", "buddy",
         "--torchpass-verify-replicas", "false", "--torchpass-chaos-kill-rank", "1", "--torchpass-heartbeat-timeout-s", "20"]
    )  # fmt: skip
    config = config_from_args(args)
    assert config is not None
    assert config.buddy_interval_steps == 3 and config.redundancy == "buddy" and config.verify_replicas is False
    assert config.chaos.kill_rank == 1 and config.heartbeat_timeout_s == 20.0
    assert config.report_timeout_s == TorchPassConfig().report_timeout_s
    assert args.num_layers == 2


def test_without_the_switch_nothing_is_configured() -> None:
    assert config_from_args(_parser().parse_args(["--num-layers", "2"])) is None


def test_options_without_the_switch_are_an_error() -> None:
    args = _parser().parse_args(["--torchpass-buddy-interval-steps", "2"])
    with pytest.raises(ConfigError, match="--torchpass-buddy-interval-steps given without --torchpass"):
        config_from_args(args)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--torchpass-heartbeat-interval-s", "-1"], "argument --torchpass-heartbeat-interval-s: got '-1'; expected a number > 0"),
        (["--torchpass-redundancy", "mirror"], "argument --torchpass-redundancy: got 'mirror'; expected one of auto, replica, buddy"),
        (["--torchpass-verify-replicas", "maybe"], "argument --torchpass-verify-replicas: got 'maybe'; expected true or false"),
        (["--torchpass-buddy-interval-steps", "1.5"], "argument --torchpass-buddy-interval-steps: got '1.5'; expected an integer"),
    ],
)
def test_a_bad_value_names_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert message in _error(capsys, ["--torchpass", *argv])


@pytest.mark.parametrize("known", [False, True], ids=["parse_args", "parse_known_args"])
def test_a_misspelled_flag_names_the_closest_valid_one(capsys: pytest.CaptureFixture[str], known: bool) -> None:
    err = _error(capsys, ["--torchpass", "--torchpass-buddy-intervl-steps", "2"], known=known)
    assert "unknown flag --torchpass-buddy-intervl-steps: did you mean --torchpass-buddy-interval-steps?" in err
    err = _error(capsys, ["--torchpass", "--torchpass-xyz=1"], known=known)
    assert "unknown flag --torchpass-xyz: valid torchpass flags: --torchpass, --torchpass-heartbeat-interval-s" in err


def test_unknown_flags_of_other_tools_still_pass_through_parse_known_args() -> None:
    args, extras = _parser().parse_known_args(["--torchpass", "--some-megatron-flag", "1"])
    assert args.torchpass and extras == ["--some-megatron-flag", "1"]


def test_rules_across_fields_are_checked_once_all_flags_are_parsed() -> None:
    args = _parser().parse_args(["--torchpass", "--torchpass-heartbeat-interval-s", "20"])
    with pytest.raises(ConfigError, match="heartbeat_timeout_s: got 10.0; expected a number greater than heartbeat_interval_s"):
        config_from_args(args)
    args = _parser().parse_args(
        ["--torchpass", "--torchpass-heartbeat-interval-s", "20", "--torchpass-heartbeat-timeout-s", "60"]
    )
    config = config_from_args(args)
    assert config is not None and config.heartbeat_interval_s == 20.0
