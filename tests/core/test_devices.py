"""GPU slots of a node: how many workers ``--nproc-per-node`` means, and which slots share a GPU."""

from __future__ import annotations

import pytest

from torchpass.core import devices


@pytest.mark.parametrize(
    "value, spares, gpus, cpus, expected",
    [
        ("4", 1, 8, 2, 4),
        ("gpu", 1, 8, 2, 7),  # each spare owns a GPU of its own
        ("gpu", 0, 8, 2, 8),
        ("auto", 2, 8, 16, 6),  # GPUs where there are some
        ("auto", 2, 0, 16, 16),  # CPUs otherwise (torchrun's meaning)
        ("cpu", 1, 8, 16, 16),
    ],
)
def test_nproc_per_node(value, spares, gpus, cpus, expected):
    assert devices.nproc_per_node(value, spares, gpus, cpus) == expected


@pytest.mark.parametrize(
    "value, spares, gpus, message",
    [
        ("gpu", 0, 0, "--nproc-per-node gpu: this node has no GPU torch can use"),
        ("gpu", 2, 2, "the node's 2 GPU(s) leave none for workers once each of the 2 spare(s) owns one"),
        ("auto", 4, 4, "--nproc-per-node auto: the node's 4 GPU(s) leave none"),
        ("two", 0, 0, "--nproc-per-node: got 'two'; expected an integer >= 1, 'gpu', 'cpu', 'auto'"),
        ("0", 0, 0, "--nproc-per-node: got 0; expected an integer >= 1, 'gpu', 'cpu', 'auto'"),
    ],
)
def test_nproc_per_node_errors_name_the_flag_and_what_is_valid(value, spares, gpus, message):
    with pytest.raises(ValueError) as info:
        devices.nproc_per_node(value, spares, gpus, 8)
    assert message in str(info.value)


def test_sharing_note_names_the_slots_without_a_gpu_of_their_own():
    assert devices.sharing_note(7, 1, 8) is None
    assert devices.sharing_note(4, 1, 0) is None  # a CPU job: no GPU to share
    note = devices.sharing_note(4, 1, 1)
    assert note is not None
    assert "5 processes (4 worker(s), 1 spare(s)) on 1 GPU(s): slots 1..4 have no GPU of their own" in note
    assert "NCCL refuses two ranks on one GPU" in note


def test_a_spare_without_a_gpu_makes_no_cuda_context():
    assert devices.warm_spare(devices.gpu_count()) is False


def test_without_a_cuda_context_there_is_nothing_broken():
    assert devices.cuda_context_error() is None
