"""The Megatron-LM hooks against Megatron-LM's own ``megatron.training`` (megatron-core 0.17.0), in a subprocess.

The test process imports the installed megatron-core 0.16.1; each case runs a
short Python program with the provisioned 0.17.0 first on ``PYTHONPATH``
(``megatron_lm_env``), which parses arguments through Megatron-LM's real
``parse_args`` and ``inprocess_restart`` and prints what it saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


PRELUDE = """
import json, sys
from torchpass.adapters.megatron import install_megatron_lm_hooks
assert install_megatron_lm_hooks() is True
def user_flags(parser):  # the script's own extra_args_provider
    parser.add_argument("--user-flag", default="unset")
    return parser
"""


def _run(env: dict[str, str], body: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code, *argv], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_megatron_lm_parses_the_flags_next_to_the_scripts_own(megatron_lm_env: dict[str, str]) -> None:
    """Megatron-LM's parse_args (as pretrain and inprocess_restart call it, twice) accepts --torchpass and
    --torchpass-* beside the script's own provider; installing twice hooks once; without torchpass launch
    one line says training is not protected."""
    body = """
    from megatron.training import arguments, training
    hooked = (arguments.add_megatron_arguments, training.train_step, training.setup_model_and_optimizer)
    assert install_megatron_lm_hooks() is True
    assert hooked == (arguments.add_megatron_arguments, training.train_step, training.setup_model_and_optimizer)
    arguments.parse_args(ignore_unknown_args=True)
    args = arguments.parse_args(extra_args_provider=user_flags)
    print(json.dumps([args.torchpass, args.torchpass_buddy_interval_steps, args.user_flag, args.num_layers]))
    """
    argv = ["--num-layers", "2", "--torchpass", "--torchpass-buddy-interval-steps", "3", "--user-flag", "u"]
    result = _run(megatron_lm_env, body, argv)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == [True, 3, "u", 2]
    assert [line for line in result.stderr.splitlines() if "torchpass" in line] == [
        "[torchpass] --torchpass: this process was not started by `torchpass launch`; training runs without live migration"
    ]


def test_a_misspelled_flag_fails_even_when_unknown_args_are_ignored(megatron_lm_env: dict[str, str]) -> None:
    body = """
    from megatron.training.arguments import parse_args
    parse_args(ignore_unknown_args=True)
    """
    result = _run(megatron_lm_env, body, ["--torchpass", "--torchpass-heartbeat-intervl-s", "2"])
    assert result.returncode == 2
    assert "did you mean --torchpass-heartbeat-interval-s?" in result.stderr


def test_inprocess_restart_with_torchpass_is_refused_before_set_up(megatron_lm_env: dict[str, str]) -> None:
    """pretrain_gpt.py's __main__ wraps pretrain for in-process restart first: the refusal comes there."""
    body = """
    from megatron.training import inprocess_restart
    inprocess_restart.maybe_wrap_for_inprocess_restart(lambda *a, **k: None)
    """
    result = _run(megatron_lm_env, body, ["--inprocess-restart", "--torchpass"])
    assert result.returncode == 1
    assert "--torchpass cannot be combined with --inprocess-restart" in result.stderr


def test_loop_changes_outside_train_step_are_refused(megatron_lm_env: dict[str, str]) -> None:
    body = """
    from megatron.training.arguments import parse_args
    from torchpass.adapters.megatron.megatron_lm_loop import refuse_unsupported
    for flags in (["--iterations-to-skip", "3"], ["--perform-rl-step"]):
        sys.argv = [sys.argv[0], "--torchpass", *flags]
        try:
            refuse_unsupported(parse_args(ignore_unknown_args=True))
        except ValueError as exc:
            print(exc)
    """
    result = _run(megatron_lm_env, body, [])
    assert result.returncode == 0, result.stderr[-2000:]
    refused = result.stdout.splitlines()[-2:]
    assert refused[0].startswith("torchpass: --torchpass cannot be combined with --iterations-to-skip"), refused
    assert refused[1].startswith("torchpass: --torchpass cannot be combined with --perform-rl-step"), refused
