"""``torchpass launch`` refuses bad input before it starts or writes anything.

The refusals are exercised through the launcher's entry point in this process
(argparse -> ``launch``), with the process-starting parts replaced by a tripwire
so a missing check fails the test instead of starting a job; one test runs the
real ``python -m torchpass.core.cli`` command.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchpass.core import cli, launcher
from torchpass.core.free_port import free_port

RUN_FILES = ("events.jsonl", "workers.json", "summary.json")


class Tripwire(Exception):
    pass


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('training')\n")
    return path


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"


@pytest.fixture(autouse=True)
def no_job(monkeypatch):
    def refuse(*args, **kwargs):
        raise Tripwire("launch got past its checks and tried to start the job")

    monkeypatch.setattr(launcher, "Agent", refuse)
    monkeypatch.setattr(launcher, "Controller", refuse)


def launch(argv: list[str], capsys) -> tuple[int, str]:
    args = cli._parser().parse_args(["launch", *argv])
    code = launcher.launch(args)
    return code, capsys.readouterr().err


def assert_nothing_written(run_dir: Path) -> None:
    for name in RUN_FILES:
        assert not (run_dir / name).exists(), name
    assert not (run_dir / "logs").exists()



@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--set", "nope=1"], ["unknown key nope", "valid keys:", "heartbeat_timeout_s"]),
        (["--set", "heartbeat_timout_s=3"], ["unknown key heartbeat_timout_s", "did you mean 'heartbeat_timeout_s'"]),
        (["--set", "heartbeat_timeout_s=abc"], ["heartbeat_timeout_s: got 'abc' (str); expected a number"]),
        (["--set", "telemetry.consle=false"], ["unknown key telemetry.consle", "did you mean 'console'"]),
        (["--set", "justakey"], ["--set 'justakey': expected KEY=VALUE"]),
        (["--config", "no_such_preset"], ["preset 'no_such_preset' not found", "fast_detect"]),
        (["--config", "fast_detect", "--set", "redundancy=mirror"], ["fast_detect.yaml", "redundancy: got 'mirror'"]),
        (["--spares-per-node", "-1"], ["--spares-per-node: got -1; expected an integer >= 0"]),
        (["--nnodes", "1:2"], ["--nnodes 1:2", "MIN == MAX"]),
        (["--nnodes", "0"], ["--nnodes: got 0; expected an integer >= 1"]),
        (["--nproc-per-node", "two"], ["--nproc-per-node: got 'two'"]),
        (["--node-rank", "2", "--nnodes", "2"], ["--node-rank: got 2; expected 0..1 for --nnodes 2"]),
        (["--no-python"], ["--no-python is not supported"]),
        (["--rdzv-endpoint", "hostonly"], ["--rdzv-endpoint 'hostonly': expected HOST:PORT"]),
        (["--set", "signals.slurm=always"], ["signals.slurm: got 'always'", "'auto'", "'disabled'"]),
        (["--set", "signals.poll_interval_s=0"], ["signals.poll_interval_s: got 0", "a number > 0"]),
        (["--store", "http://a:2379"], ["--store 'http://a:2379': expected etcd://HOST:PORT"]),
        (["--nproc-per-node", "gpu"], ["--nproc-per-node gpu: this node has no GPU torch can use"]),
    ],
)
def test_bad_input_exits_2_naming_the_cause(argv, fragments, script, run_dir, capsys):
    code, err = launch([*argv, "--run-dir", str(run_dir), str(script)], capsys)
    assert code == 2
    assert err.startswith("torchpass launch: error: ")
    for fragment in fragments:
        assert fragment in err
    assert_nothing_written(run_dir)


def test_several_nodes_on_an_etcd_store_need_one_job_id(script, run_dir, capsys, tmp_path):
    secret = tmp_path / "job.secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    argv = ["--store", "etcd://a:2379", "--nnodes", "2", "--secret-file", str(secret), "--run-dir", str(run_dir), str(script)]
    code, err = launch(argv, capsys)
    assert code == 2 and "--store etcd://a:2379: give every node the same --rdzv-id; the job's keys live under it" in err
    assert_nothing_written(run_dir)


_SET_IS_UNTYPED = (
    "core/launcher.py _parse_overrides: OmegaConf.create({'v': raw}) keeps the raw string (a dict value is not "
    "YAML-parsed), so every --set value stays a str: --set spares_per_node=2 or the README's "
    "--set heartbeat_timeout_s=5 is refused with \"got '5' (str); expected a number\""
)


def test_slurm_signals_asked_for_without_slurm_name_the_field_and_the_missing_commands(script, run_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo, no scontrol
    code, err = launch(["--set", "signals.slurm=required", "--run-dir", str(run_dir), str(script)], capsys)
    assert code == 2 and "signals.slurm: got 'required'" in err and "sinfo and scontrol are not on PATH" in err
    assert_nothing_written(run_dir)


def test_kubernetes_signals_without_a_node_name_or_credentials_name_the_field(script, run_dir, capsys, monkeypatch, tmp_path):
    pytest.importorskip("kubernetes")
    monkeypatch.delenv("NODE_NAME", raising=False)
    code, err = launch(["--set", "signals.k8s=required", "--run-dir", str(run_dir), str(script)], capsys)
    assert code == 2 and "signals.k8s_node: empty and NODE_NAME is not set" in err
    missing = tmp_path / "no-such-kubeconfig"
    argv = ["--set", "signals.k8s=required", "--set", "signals.k8s_node=n1", "--set", f"signals.k8s_kubeconfig={missing}"]
    code, err = launch([*argv, "--run-dir", str(run_dir), str(script)], capsys)
    assert code == 2 and "signals.k8s_kubeconfig: cannot load Kubernetes credentials" in err, err
    assert_nothing_written(run_dir)


def test_set_values_are_typed_like_yaml():
    overrides = launcher._parse_overrides(
        ["spares_per_node=2", "enabled=false", "heartbeat_timeout_s=5", "hang_timeout_s=0.5", "telemetry.console=true", "run_dir=out"]
    )
    assert overrides == {
        "spares_per_node": 2,
        "enabled": False,
        "heartbeat_timeout_s": 5,
        "hang_timeout_s": 0.5,
        "telemetry": {"console": True},
        "run_dir": "out",
    }


def test_valid_set_values_pass_the_config_check(script, run_dir, capsys):
    # --no-python is refused after the config is built: reaching it means the config was accepted.
    code, err = launch(["--set", "heartbeat_timeout_s=5", "--set", "spares_per_node=0", "--no-python", "--run-dir", str(run_dir), str(script)], capsys)
    assert code == 2
    assert "--no-python is not supported" in err, err


def test_set_value_of_the_wrong_type_is_refused(script, run_dir, capsys):
    code, err = launch(["--set", "spares_per_node=lots", "--run-dir", str(run_dir), str(script)], capsys)
    assert code == 2
    assert "spares_per_node: got 'lots' (str); expected an integer" in err
    assert_nothing_written(run_dir)


def test_missing_script(tmp_path, run_dir, capsys):
    missing = tmp_path / "nope.py"
    code, err = launch(["--run-dir", str(run_dir), str(missing)], capsys)
    assert code == 2
    assert f"training script {str(missing)!r} not found" in err
    assert_nothing_written(run_dir)


def test_missing_module(run_dir, capsys):
    code, err = launch(["--run-dir", str(run_dir), "-m", "torchpass_no_such_module"], capsys)
    assert code == 2
    assert "module 'torchpass_no_such_module' not found (given with -m)" in err
    assert_nothing_written(run_dir)


def test_port_in_use(script, run_dir, capsys):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        start = time.monotonic()
        code, err = launch(["--master-port", str(port), "--run-dir", str(run_dir), str(script)], capsys)
    assert code == 2
    assert f"cannot host the torchpass store on 127.0.0.1:{port}" in err
    assert "is the port in use? pass --master-port" in err
    assert time.monotonic() - start < 30
    assert_nothing_written(run_dir)


def test_unreachable_store_for_node_1(script, run_dir, capsys, monkeypatch):
    monkeypatch.setenv("TORCHPASS_SECRET", "shared-by-every-node-0123")
    port = free_port()
    start = time.monotonic()
    code, err = launch(
        ["--nnodes", "2", "--node-rank", "1", "--master-port", str(port), "--rdzv-conf", "join_timeout=2", "--run-dir", str(run_dir), str(script)],
        capsys,
    )
    elapsed = time.monotonic() - start
    assert code == 2
    assert f"cannot reach the torchpass store of node 0 at 127.0.0.1:{port} within 2 s" in err
    assert elapsed < 15, elapsed
    assert_nothing_written(run_dir)


def test_a_multi_node_launch_without_a_secret_is_refused_naming_both_ways(script, run_dir, capsys, monkeypatch):
    monkeypatch.delenv("TORCHPASS_SECRET", raising=False)
    code, err = launch(["--nnodes", "2", "--node-rank", "1", "--run-dir", str(run_dir), str(script)], capsys)
    assert code == 2
    assert "a job on 2 nodes needs the same secret on every node: pass --secret-file PATH" in err and "TORCHPASS_SECRET" in err
    assert_nothing_written(run_dir)


def test_an_unreadable_secret_file_is_named(script, run_dir, capsys, tmp_path):
    code, err = launch(["--secret-file", str(tmp_path / "missing"), "--run-dir", str(run_dir), str(script)], capsys)
    assert code == 2
    assert f"--secret-file '{tmp_path / 'missing'}'" in err
    assert_nothing_written(run_dir)


def test_existing_run_dir_is_left_untouched_by_a_refused_launch(script, run_dir, capsys):
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text('{"type": "job_start"}\n')
    code, _ = launch(["--set", "nope=1", "--run-dir", str(run_dir), str(script)], capsys)
    assert code == 2
    assert (run_dir / "events.jsonl").read_text() == '{"type": "job_start"}\n'
    assert not (run_dir / "previous").exists()


def test_cli_command_refuses_an_unknown_key(script, run_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "torchpass.core.cli", "launch", "--set", "nope=1", "--run-dir", str(run_dir), str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "torchpass launch: error:" in proc.stderr and "unknown key nope" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert_nothing_written(run_dir)
