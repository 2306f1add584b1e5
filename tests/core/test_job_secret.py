"""Where a job's secret comes from, and the refusals that name what to do."""

from __future__ import annotations

import pytest

from torchpass.core import job_secret


def test_a_single_node_job_generates_a_fresh_secret(monkeypatch):
    monkeypatch.delenv(job_secret.SECRET_ENV, raising=False)
    first, where = job_secret.for_launch(None, 1)
    second, _ = job_secret.for_launch(None, 1)
    assert where == job_secret.GENERATED and first != second and len(first) >= job_secret.MIN_SECRET_BYTES


def test_a_multi_node_job_without_a_secret_is_refused_naming_both_ways(monkeypatch):
    monkeypatch.delenv(job_secret.SECRET_ENV, raising=False)
    with pytest.raises(job_secret.SecretError, match="--secret-file PATH .* TORCHPASS_SECRET"):
        job_secret.for_launch(None, 2)


def test_the_file_wins_over_the_environment(monkeypatch, tmp_path):
    path = tmp_path / "secret"
    path.write_text("from-the-file-0123456789\n")
    monkeypatch.setenv(job_secret.SECRET_ENV, "from-the-environment-0123")
    assert job_secret.for_launch(str(path), 2) == (b"from-the-file-0123456789", f"--secret-file {path}")
    monkeypatch.setenv(job_secret.SECRET_ENV, "from-the-environment-0123")
    assert job_secret.for_launch(None, 2)[0] == b"from-the-environment-0123"


@pytest.mark.parametrize(("content", "why"), [("short", "at least 16"), ("\x00" * 20, "printable")])
def test_a_weak_or_binary_secret_is_refused(tmp_path, content, why):
    path = tmp_path / "secret"
    path.write_text(content)
    with pytest.raises(job_secret.SecretError, match=why):
        job_secret.for_launch(str(path), 2)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(job_secret.SecretError, match="--secret-file .*nope"):
        job_secret.for_launch(str(tmp_path / "nope"), 2)


def test_a_worker_takes_the_secret_out_of_its_environment(monkeypatch):
    monkeypatch.setattr(job_secret, "_worker_secret", None)
    monkeypatch.setenv(job_secret.SECRET_ENV, "handed-down-by-the-agent-01")
    assert job_secret.from_worker_env() == b"handed-down-by-the-agent-01"
    import os

    assert job_secret.SECRET_ENV not in os.environ  # processes the script starts do not inherit it
    assert job_secret.from_worker_env() == b"handed-down-by-the-agent-01"


def test_an_operator_finds_the_secret_a_single_node_launch_generated_and_nobody_else_can_read_it(monkeypatch, tmp_path):
    monkeypatch.delenv(job_secret.SECRET_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    run_dir = tmp_path / "runs" / "job1"
    kept = job_secret.keep_generated(run_dir, b"generated-for-job1-0123456789")
    assert job_secret.for_operator(run_dir) == b"generated-for-job1-0123456789"
    assert kept.stat().st_mode & 0o077 == 0 and kept.parent.stat().st_mode & 0o077 == 0
    assert run_dir not in kept.parents  # the run directory never holds it
    with pytest.raises(job_secret.SecretError, match="no secret for the job in .*job2.*--secret-file PATH or set TORCHPASS_SECRET"):
        job_secret.for_operator(tmp_path / "runs" / "job2")
