"""CUDA state on a real GPU: captured through pinned staging and restored bitwise; CUDA RNG streams.

Figures (staging throughput against a bare ``cudaMemcpy`` into pinned memory) are recorded in
``$TORCHPASS_GPU_OUT`` when set; nothing here asserts a timing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from torchpass.core.cuda_staging import measure, stage_to_host
from torchpass.core.manifest import capture, rebuild, state_digest
from torchpass.core.rng import capture_rng, restore_rng

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = torch.device("cuda", 0)


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(256, 8)).to(DEV)
    model.register_buffer("steps_seen", torch.zeros((), dtype=torch.int64, device=DEV))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        loss = model(torch.randn(32, 64, device=DEV)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.steps_seen += 1
    return model, opt


def test_capture_stages_cuda_tensors_into_pinned_host_copies_and_restores_bitwise() -> None:
    model, opt = _trained(0)
    components = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    captured = capture(components, {"model": "replicated", "optimizer": "replicated"}, version=3)
    assert all(t.device.type == "cpu" for t in captured.tensors)
    # Every CUDA tensor (the model's, Adam's moments) is a pinned copy; Adam's step counters were host tensors already.
    on_device = [i for i, e in enumerate(captured.manifest.entries) if not e.name.endswith("/step")]
    assert len(on_device) == len(captured.tensors) - len(opt.state)
    assert all(captured.tensors[i].is_pinned() for i in on_device)
    assert set(on_device) <= set(captured.private)
    # What a receiver gets: the staged bytes, loaded onto its own device by the framework's load_state_dict.
    received = rebuild(captured.manifest, [t.clone() for t in captured.tensors])
    fresh, fresh_opt = _trained(1)
    assert state_digest({"model": fresh.state_dict()}) != state_digest({"model": model.state_dict()})
    fresh.load_state_dict(received["model"])
    fresh_opt.load_state_dict(received["optimizer"])
    assert state_digest({"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()}) == state_digest(components)
    assert next(fresh.parameters()).device == DEV
    assert all(v.device == DEV for s in fresh_opt.state.values() for k, v in s.items() if k != "step")


def test_staging_sees_kernels_queued_before_the_capture() -> None:
    x = torch.zeros(1 << 24, device=DEV)
    for _ in range(20):
        x.add_(1.0)  # queued on the current stream; the side stream must wait for them
    (host,) = stage_to_host([x])
    assert bool((host == 20.0).all())


def test_cuda_rng_stream_is_restored_on_the_current_device() -> None:
    torch.manual_seed(5)
    torch.rand(10, device=DEV)
    state = capture_rng()
    assert "cuda" in state and isinstance(state["cuda"], bytes)
    a = torch.rand(1000, device=DEV)
    torch.rand(77, device=DEV)
    restore_rng(state)
    b = torch.rand(1000, device=DEV)
    assert torch.equal(a, b)


@pytest.mark.parametrize("mib", [32, 256, 2048])
def test_staging_throughput_against_a_bare_copy(mib: int) -> None:
    figures = measure(mib << 20, DEV, repeats=5)
    record = {"mib": mib, "staged_gbps": figures.staged_gbps, "memcpy_pinned_gbps": figures.memcpy_pinned_gbps,
              "pageable_gbps": figures.pageable_gbps, "ratio": figures.ratio}
    print("staging", json.dumps(record))
    folder = os.environ.get("TORCHPASS_GPU_OUT")
    if folder:
        with open(Path(folder, "staging.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
    assert figures.staged_gbps > 0 and figures.memcpy_pinned_gbps > 0


def test_a_spare_makes_its_cuda_context_on_its_own_gpu_while_it_waits() -> None:
    from torchpass.core.devices import warm_spare

    assert warm_spare(0) is True
    assert torch.cuda.is_initialized() and torch.cuda.current_device() == 0


def test_a_buddy_snapshot_stages_live_cuda_state_off_the_training_thread() -> None:
    """The capture keeps the live tensor and an event; the buddy thread stages what the event marks."""
    import threading

    from torchpass.core.buddy import _copy_into

    x = torch.zeros(1 << 24, device=DEV)
    for _ in range(20):
        x.add_(1.0)
    captured = capture({"optimizer": {"x": x}}, {"optimizer": "sharded"}, version=1, device_tensors="live")
    assert captured.tensors[0] is not None and captured.tensors[0].device == DEV and captured.device_events
    assert 0 not in captured.private  # a live tensor: the snapshot must copy it
    done: dict = {}
    worker = threading.Thread(target=lambda: done.update(snap=_copy_into(captured, None)))
    worker.start()
    worker.join()
    staged = done["snap"].tensors[0]
    assert staged.device.type == "cpu" and staged.is_pinned() and bool((staged == 20.0).all())


_BREAK_THE_CONTEXT = """
import json
import torch
from torchpass.core.devices import cuda_context_error
x = torch.ones(4, device="cuda")
healthy = cuda_context_error()
try:
    x[torch.tensor([10], device="cuda")].sum().item()  # out of range: a device-side assert, a sticky error
except RuntimeError:
    pass
print(json.dumps({"healthy": healthy, "broken": cuda_context_error()}))
"""


def test_a_sticky_cuda_error_is_seen_as_a_broken_context() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _BREAK_THE_CONTEXT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print("sticky", report)
    assert report["healthy"] is None
    assert report["broken"] is not None and "CUDA error" in report["broken"]


def test_what_a_capture_costs_the_training_thread() -> None:
    """Seconds on the capturing thread for 1 GiB of CUDA state: staged now, or kept live for the buddy thread."""
    import time

    state = {"optimizer": {f"t{i}": torch.randn(1 << 26, device=DEV) for i in range(4)}}  # 4 x 256 MiB
    figures = {}
    for mode in ("stage", "live", "stage", "live"):
        torch.cuda.synchronize()
        start = time.perf_counter()
        capture(state, {"optimizer": "sharded"}, version=0, device_tensors=mode)
        figures[mode] = time.perf_counter() - start  # the second of each pair: warm
    print("capture_cost", json.dumps(figures))
    folder = os.environ.get("TORCHPASS_GPU_OUT")
    if folder:
        Path(folder, "capture_cost.json").write_text(json.dumps({"bytes": 1 << 30, "seconds": figures}))
