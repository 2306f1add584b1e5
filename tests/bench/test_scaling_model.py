"""The scaling model's arithmetic on one case small enough to check by hand (bench/scaling_model.py)."""

from __future__ import annotations

import math

import pytest

from bench.scaling_model import Inputs, Scale, evaluate, field_docs, markdown

# 1,000 GPUs, one failure a day, every failure handled; round numbers everywhere.
CASE = Inputs(
    qualifying_fraction=1.0,
    state_bytes_per_gpu=1e9,
    step_s=5.0,
    replica_group_gpus=100,
    nic_GBps=10.0,
    pcie_GBps=1.0,
    nccl_init_small=(0, 0.0),
    nccl_init_large=(1000, 20.0),  # 0.02 s per rank
    store_init_large=(1000, 10.0),  # 0.01 s per rank
    detect_s=10.0,
    survivor_abort_s=0.0,
    report_and_plan_s=0.0,
    control_plane_s=((1000, 0.0),),
    spare_setup_s=0.0,
    transfer_efficiency=0.1,  # 1 GB/s: the 1 GB state moves in 1 s
    rollback_steps=0.0,
    relaunch_s=100.0,
    storage_read_GBps_per_gpu=1.0,
    storage_write_GBps_per_gpu=10.0,
    ckpt_async=True,
    ckpt_fixed_s=2.0,
    fixed_interval_s=5400.0,
    ft_quorum_s=0.0,
)


def test_hand_computed_case() -> None:
    rows = {o.strategy: o for o in evaluate(CASE, Scale(1000, 24.0))}
    # torchpass: detect 10 + transfer 1 + NCCL init of 1,000 ranks 20 + the re-executed step 5 = 36 s, x 1,000 GPUs, once a day.
    tp = rows["torchpass"]
    assert tp.failures_per_day == 1.0
    assert tp.recovery_s == pytest.approx(36.0)
    assert tp.lost_gpu_h == pytest.approx(10.0)  # 36,000 GPU-s; no checkpoints needed when every failure is handled
    assert math.isinf(tp.interval_s) and tp.lost_saves_gpu_h == 0.0
    # Checkpoint restart: detect 10 + relaunch 100 + store 10 + NCCL 20 + load 1 (1 GB at 1 GB/s) + step 5 = 146 s.
    # A save blocks 2 + 1 GB / 1 GB/s = 3 s; Young: sqrt(2 x 3 s x 86,400 s) = 720 s (above the 0.1 s write floor).
    ck = rows["checkpoint restart, Young interval"]
    assert ck.interval_s == pytest.approx(720.0)
    assert ck.recovery_s == pytest.approx(146.0 + 360.0)
    assert ck.lost_failures_gpu_h == pytest.approx(1000 * 506 / 3600)  # 140.56
    assert ck.lost_saves_gpu_h == pytest.approx(1000 * 3 * 86400 / 720 / 3600)  # 120 saves a day: 100 GPU-h
    assert ck.ettr == pytest.approx(1 - (1000 * 506 / 3600 + 100.0) / 24000)
    fixed = rows["checkpoint restart, 1.5 h interval"]
    assert fixed.lost_failures_gpu_h == pytest.approx(1000 * (146 + 2700) / 3600)
    assert fixed.lost_saves_gpu_h == pytest.approx(1000 * 3 * 16 / 3600)
    # torchft: survivors stall detect 10 + NCCL init of the 10-rank cross-replica group 0.2 + the discarded step 5 = 15.2 s;
    # the failed group of 100 is back after detect 10 + relaunch 100 + store 1 + NCCL 2 + heal 1 + step 5 = 119 s.
    ft = rows["torchft"]
    assert ft.recovery_s == pytest.approx(15.2)
    assert ft.notes["group rejoin (s)"] == pytest.approx(119.0)
    assert ft.lost_gpu_h == pytest.approx((900 * 15.2 + 100 * 119) / 3600)  # 7.106


def test_unhandled_failures_fall_back_to_checkpoints() -> None:
    half = Inputs(**{**CASE.__dict__, "qualifying_fraction": 0.5})
    rows = {o.strategy: o for o in evaluate(half, Scale(1000, 24.0))}
    tp = rows["torchpass"]
    # Half a failure a day restored from a checkpoint taken every sqrt(2 x 3 x 172,800) = 1,018 s.
    interval = math.sqrt(2 * 3 * 172_800)
    assert tp.interval_s == pytest.approx(interval)
    expected = 0.5 * 36_000 + 0.5 * 1000 * (146 + interval / 2) + 1000 * 3 * 86_400 / interval
    assert tp.lost_gpu_h == pytest.approx(expected / 3600)


def test_every_input_names_its_source_and_the_page_renders() -> None:
    docs = field_docs()
    assert set(docs) == {f for f in Inputs.__dataclass_fields__}
    assert all(len(text) > 20 for text in docs.values())
    page = markdown(Inputs(), {}, "python bench/scaling_model.py")
    assert "## What must be measured on a GPU cluster to confirm this" in page
    assert "| 16,384 | 1.8 h |" in page


def test_detection_matches_the_configured_heartbeat_timeout() -> None:
    from torchpass.core.config import TorchPassConfig

    assert Inputs().detect_s == TorchPassConfig().heartbeat_timeout_s
