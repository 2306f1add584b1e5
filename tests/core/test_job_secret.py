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
