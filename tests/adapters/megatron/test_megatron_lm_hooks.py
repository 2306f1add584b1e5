"""The Megatron-LM hooks, against a stand-in for ``megatron.training`` (Megatron-LM is not on PyPI).

The stand-in (tests/support/megatron/megatron_lm_stand_in) has only the
functions the hooks depend on, with Megatron-LM's signatures and call paths
(``parse_args`` -> ``add_megatron_arguments`` through the module global,
``initialize_megatron`` binding ``parse_args`` by name, ``train`` ->
``train_step`` through the module global). It checks the hooks' wiring; it is
not a model of Megatron-LM.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from torchpass.adapters.megatron import install_megatron_lm_hooks
from torchpass.adapters.megatron.megatron_lm import MEGATRON_LM_UNSUPPORTED

STAND_IN = Path(__file__).resolve().parents[3] / "tests" / "support" / "megatron" / "megatron_lm_stand_in"


def _forget_megatron_training() -> None:
    for name in [n for n in sys.modules if n == "megatron.training" or n.startswith("megatron.training.")]:
        del sys.modules[name]


@pytest.fixture
def megatron_lm(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The stand-in ``megatron.training``, hooked; removed again afterwards."""
    monkeypatch.syspath_prepend(str(STAND_IN))
    _forget_megatron_training()
    assert install_megatron_lm_hooks() is True
    import megatron.training

    yield megatron.training
    _forget_megatron_training()


def _user_flags(parser):  # the script's own extra_args_provider
    parser.add_argument("--user-flag", default="unset")
    return parser


def test_without_megatron_lm_there_is_nothing_to_hook() -> None:
    _forget_megatron_training()
    assert install_megatron_lm_hooks() is False


def test_pretrain_accepts_the_flags_next_to_the_scripts_own(megatron_lm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """core_v0.16/0.17: pretrain(..., extra_args_provider=...) parses through initialize_megatron."""
    argv = ["pretrain_gpt.py", "--num-layers", "2", "--train-iters", "1", "--torchpass", "--torchpass-buddy-interval-steps", "3", "--user-flag", "u"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(RuntimeError, match="cannot protect Megatron-LM's own training loop") as exc:
        megatron_lm.pretrain(None, None, None, None, extra_args_provider=_user_flags)
    assert str(exc.value) == MEGATRON_LM_UNSUPPORTED
    args = megatron_lm.get_args()
    assert args.torchpass and args.torchpass_buddy_interval_steps == 3 and args.user_flag == "u" and args.num_layers == 2


def test_parse_and_validate_args_accepts_the_flags(megatron_lm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """core_v0.18 on: the script calls parse_and_validate_args(extra_args_provider=...) itself."""
    from megatron.training.arguments import parse_and_validate_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--torchpass", "--torchpass-redundancy", "buddy", "--user-flag", "v"])
    args = parse_and_validate_args(extra_args_provider=_user_flags)
    assert args.torchpass and args.torchpass_redundancy == "buddy" and args.user_flag == "v"


def test_without_the_flag_megatron_lm_trains_as_before(megatron_lm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--train-iters", "2"])
    assert megatron_lm.pretrain(None, None, None, None) == 2
    assert megatron_lm.get_args().torchpass is False


def test_installing_twice_hooks_once(megatron_lm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.training import arguments

    hooked = arguments.add_megatron_arguments
    assert install_megatron_lm_hooks() is True
    assert arguments.add_megatron_arguments is hooked
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--torchpass"])
    assert arguments.parse_args().torchpass  # one torchpass group: argparse would reject a second


def test_a_misspelled_flag_fails_even_when_unknown_args_are_ignored(
    megatron_lm: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--torchpass", "--torchpass-heartbeat-intervl-s", "2"])
    with pytest.raises(SystemExit):
        parse_args(ignore_unknown_args=True)
    assert "did you mean --torchpass-heartbeat-interval-s?" in capsys.readouterr().err
