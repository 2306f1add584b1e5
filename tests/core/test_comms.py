"""RebuildableProcessGroup in local mode (a spare's set-up), and the backend rewrite, in one process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp, ReduceScatterOptions

from torchpass.core import comms
from torchpass.core.comms import RebuildableProcessGroup

RANK, SIZE = 1, 4


@pytest.fixture
def group() -> RebuildableProcessGroup:
    g = RebuildableProcessGroup(RANK, SIZE, "unit", list(range(SIZE)), timedelta(seconds=5))
    g.go_local()
    return g


def allreduce_opts(op) -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = op
    return opts


def test_identity_in_local_mode(group):
    assert group.is_local
    assert group.rank() == RANK and group.size() == SIZE
    assert group.group_name == "unit" and group.getGroupName() == "unit"
    assert group.global_ranks == [0, 1, 2, 3]
    assert group.getBackendName() == comms.BACKEND_NAME  # never live: not gloo yet
    assert "local" in repr(group)
    assert group in comms.groups()


def test_groups_are_listed_in_creation_order(group):
    later = RebuildableProcessGroup(0, 2, "later", [0, 1], timedelta(seconds=5))
    listed = comms.groups()
    assert listed.index(group) < listed.index(later)
    assert later.creation_index > group.creation_index


def test_allreduce_sum_multiplies_by_size(group):
    t = torch.tensor([1.0, -2.0])
    work = group.allreduce([t])  # default op: SUM
    assert work.wait()
    assert t.tolist() == [4.0, -8.0]
    group.allreduce([t], allreduce_opts(ReduceOp.SUM)).wait()
    assert t.tolist() == [16.0, -32.0]
    n = torch.tensor([3], dtype=torch.int64)
    group.allreduce([n], ReduceOp.SUM).wait()  # a bare ReduceOp, as some callers pass it
    assert n.item() == 12


@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG])
def test_allreduce_of_identical_values_is_unchanged_for_idempotent_ops(group, op):
    t = torch.tensor([1.5, -2.0])
    group.allreduce([t], allreduce_opts(op)).wait()
    assert t.tolist() == [1.5, -2.0]


def test_allreduce_sum_of_bools_is_an_or(group):
    t = torch.tensor([True, False])
    group.allreduce([t]).wait()
    assert t.tolist() == [True, False]


def test_allreduce_product_raises_to_the_power_of_size(group):
    t = torch.tensor([2.0])
    group.allreduce([t], allreduce_opts(ReduceOp.PRODUCT)).wait()
    assert t.item() == 2.0**SIZE


def test_allreduce_coalesced_and_reduce(group):
    a, b = torch.ones(2), torch.full((3,), 2.0)
    group.allreduce_coalesced([a, b]).wait()
    assert a.tolist() == [4.0, 4.0] and b.tolist() == [8.0] * 3
    c = torch.ones(1)
    group.reduce([c]).wait()
    assert c.item() == 4.0


def test_allgather_replicates_the_input(group):
    outputs = [[torch.zeros(2) for _ in range(SIZE)]]
    group.allgather(outputs, [torch.tensor([3.0, 4.0])]).wait()
    assert [o.tolist() for o in outputs[0]] == [[3.0, 4.0]] * SIZE


def test_allgather_coalesced_gathers_each_input_into_its_slot(group):
    inputs = [torch.tensor([1.0]), torch.tensor([2.0, 3.0])]
    outputs = [[torch.zeros(1), torch.zeros(2)] for _ in range(SIZE)]
    group.allgather_coalesced(outputs, inputs).wait()
    assert [[o.tolist() for o in outs] for outs in outputs] == [[[1.0], [2.0, 3.0]]] * SIZE


def test_all_gather_into_one_tensor_replicates_the_input(group):
    out = torch.zeros(SIZE * 2)
    group.all_gather_single(out, torch.tensor([5.0, 6.0])).wait()
    assert out.tolist() == [5.0, 6.0] * SIZE
    out2 = torch.zeros(SIZE, 3)
    group._allgather_base(out2, torch.arange(3.0)).wait()
    assert out2.tolist() == [[0.0, 1.0, 2.0]] * SIZE
    outs = [torch.zeros(SIZE), torch.zeros(2 * SIZE)]
    group.allgather_into_tensor_coalesced(outs, [torch.ones(1), torch.tensor([1.0, 2.0])]).wait()
    assert outs[0].tolist() == [1.0] * SIZE and outs[1].tolist() == [1.0, 2.0] * SIZE


def test_reduce_scatter_picks_this_ranks_chunk_times_size(group):
    outputs = [torch.zeros(2)]
    inputs = [[torch.full((2,), float(i)) for i in range(SIZE)]]
    group.reduce_scatter(outputs, inputs).wait()
    assert outputs[0].tolist() == [RANK * SIZE] * 2


def test_reduce_scatter_into_one_tensor(group):
    out = torch.zeros(2)
    group.reduce_scatter_single(out, torch.arange(2.0 * SIZE)).wait()
    assert out.tolist() == [2.0 * SIZE, 3.0 * SIZE]  # chunk RANK is [2, 3]
    out = torch.zeros(2)
    opts = ReduceScatterOptions()
    opts.reduceOp = ReduceOp.MAX
    group._reduce_scatter_base(out, torch.arange(2.0 * SIZE), opts).wait()
    assert out.tolist() == [2.0, 3.0]


def test_broadcast_leaves_the_tensor_unchanged(group):
    t = torch.tensor([7.0, 8.0])
    group.broadcast([t]).wait()
    assert t.tolist() == [7.0, 8.0]


def test_scripted_broadcasts_are_delivered_in_order_then_exhausted(group):
    group.script_broadcasts([torch.tensor([1.0, 1.0]), torch.tensor([[2.0], [3.0]])])
    t = torch.zeros(2)
    group.broadcast([t]).wait()
    assert t.tolist() == [1.0, 1.0]
    group.broadcast([t]).wait()
    assert t.tolist() == [2.0, 3.0]  # reshaped to the receiving tensor
    t.fill_(9.0)
    group.broadcast([t]).wait()
    assert t.tolist() == [9.0, 9.0]


def test_alltoall_in_local_mode(group):
    uneven = torch.ones(3)
    group.all_to_all_single(uneven, torch.arange(4.0), [1, 1, 1, 0], [1, 1, 1, 1]).wait()
    assert uneven.tolist() == [0.0, 0.0, 0.0]  # no sensible local answer: deterministic zeros
    outs = [torch.zeros(1) for _ in range(SIZE)]
    group.alltoall(outs, [torch.full((1,), float(i)) for i in range(SIZE)]).wait()
    assert [o.item() for o in outs] == [float(RANK)] * SIZE


def test_alltoall_base_even_split_receives_this_ranks_chunk_from_every_peer(group):
    out = torch.zeros(2 * SIZE)
    group.alltoall_base(out, torch.arange(2.0 * SIZE), [], []).wait()
    assert out.tolist() == [2.0, 3.0] * SIZE


def test_gather_and_scatter(group):
    outs = [[torch.zeros(1) for _ in range(SIZE)]]
    group.gather(outs, [torch.tensor([4.0])]).wait()
    assert [o.item() for o in outs[0]] == [4.0] * SIZE
    out = [torch.zeros(1)]
    group.scatter(out, [[torch.full((1,), float(i)) for i in range(SIZE)]]).wait()
    assert out[0].item() == float(RANK)


def test_barrier_send_recv_complete_at_once(group):
    t = torch.tensor([1.0])
    for work in (group.barrier(), group.send([t], 0), group.recv([t], 2), group.recv_anysource([t])):
        assert work.is_completed()
        assert work.wait()
    assert t.item() == 1.0
    group.monitored_barrier()  # a no-op in local mode
    group._start_coalescing(torch.device("cpu"))
    assert group._end_coalescing(torch.device("cpu")).wait()


def test_returned_work_has_a_completed_future(group):
    t = torch.ones(2)
    work = group.allreduce([t])
    future = work.get_future()
    assert future.done()
    assert torch.equal(future.value()[0], t)


def test_release_of_a_local_group_is_a_no_op(group):
    assert group.release() == 0
    group.go_local()  # idempotent
    assert group.is_local


class _Pending:
    def __init__(self) -> None:
        self.in_flight = True

    def quiet(self) -> bool:
        return not self.in_flight


class _Released:
    """A released transport as the graveyard sees it: gone once gloo has nothing of it in flight.

    Its destruction stands for gloo's destructor: it records the thread that ran it, and it blocks
    while ``destroy_blocks`` is set, as gloo's does on an operation it still runs."""

    def __init__(self, destroyed_on: list[str], destroy_blocks: threading.Event | None = None) -> None:
        self.pending = _Pending()
        self._destroyed_on = destroyed_on
        self._blocks = destroy_blocks

    def __del__(self) -> None:
        if self._blocks is not None:
            self._blocks.wait(5)
        self._destroyed_on.append(threading.current_thread().name)


def _wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.02)


def test_the_graveyard_lets_a_transport_go_once_gloo_ends_its_last_operation_without_another_burial(monkeypatch):
    import weakref

    monkeypatch.setattr(comms._Graveyard, "SWEEP_INTERVAL_S", 0.02)
    graveyard = comms._Graveyard()
    destroyed_on: list[str] = []
    caught = _Released(destroyed_on)  # an operation caught mid-message: it ends at gloo's timeout, long after the release
    quiet = _Released(destroyed_on)
    quiet.pending.in_flight = False
    refs = [weakref.ref(caught), weakref.ref(quiet)]
    graveyard.bury(caught)  # type: ignore[arg-type]
    graveyard.bury(quiet)  # type: ignore[arg-type]
    pending = caught.pending
    del caught, quiet
    _wait_for(lambda: refs[1]() is None)
    assert refs[1]() is None  # nothing in flight: let go at the next sweep
    time.sleep(0.2)
    assert refs[0]() is not None  # destroying it now would block on gloo's running operation
    pending.in_flight = False  # gloo's timeout ends it; no migration follows
    _wait_for(lambda: refs[0]() is None and graveyard._sweeper is None)
    assert refs[0]() is None
    assert graveyard._sweeper is None  # the sweeper runs only while the graveyard holds something
    assert destroyed_on == ["torchpass-graveyard"] * 2


def test_a_burial_never_destroys_a_transport_on_the_callers_thread_nor_waits_for_one_being_destroyed(monkeypatch):
    """A recovering rank buries its last generation's transport; gloo's destructor may block on an operation the
    transport did not track. Neither that burial nor the next may wait for it: a rank that does not report in
    time is fenced."""
    monkeypatch.setattr(comms._Graveyard, "SWEEP_INTERVAL_S", 0.02)
    graveyard = comms._Graveyard()
    destroyed_on: list[str] = []
    unblock = threading.Event()
    blocking = _Released(destroyed_on, unblock)
    blocking.pending.in_flight = False  # quiet as far as the transport knows
    graveyard.bury(blocking)  # type: ignore[arg-type]
    del blocking
    assert destroyed_on == []  # the caller's reference was not the last one
    time.sleep(0.2)  # the sweeper is now inside the blocking destructor
    started = time.monotonic()
    later = _Released(destroyed_on)
    later.pending.in_flight = False
    graveyard.bury(later)  # type: ignore[arg-type]
    del later
    assert time.monotonic() - started < 0.1 and destroyed_on == []
    unblock.set()
    _wait_for(lambda: len(destroyed_on) == 2)
    assert destroyed_on == ["torchpass-graveyard"] * 2


def test_groups_created_under_the_local_default_start_local():
    """What a spare's ``new_group`` calls build while it runs the script's set-up (no store needed)."""
    from types import SimpleNamespace

    opts = SimpleNamespace(group_rank=2, group_size=4, group_id="spare_pg", global_ranks_in_group=[], timeout=30.0, store=None)
    comms.set_local_mode_default(True)
    try:
        created = comms._creator(comms._KINDS[comms.BACKEND_NAME])(opts, None)
    finally:
        comms.set_local_mode_default(False)
    assert created.is_local
    assert created.global_ranks == [0, 1, 2, 3]
    assert created._op_timeout == timedelta(seconds=30)
    t = torch.ones(1)
    created.allreduce([t]).wait()
    assert t.item() == 4.0


# ---- backend rewrite ------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["gloo", "GLOO", "cpu:gloo", dist.Backend.GLOO, "torchpass"])
def test_rewrite_maps_gloo_to_torchpass(backend):
    assert comms._rewrite_backend(backend) == comms.BACKEND_NAME


def test_rewrite_passes_none_through_and_gives_undefined_torchs_default():
    assert comms._rewrite_backend(None) is None
    # torch's default is gloo for CPU plus NCCL for CUDA where both exist; this machine has neither CUDA nor NCCL.
    expected = "torchpass_mixed" if torch.cuda.is_available() and dist.is_nccl_available() else comms.BACKEND_NAME
    assert comms._rewrite_backend("undefined") == expected


@pytest.mark.parametrize(
    "backend, name",
    [("nccl", "torchpass_nccl"), ("cuda:nccl", "torchpass_nccl"), ("cpu:gloo,cuda:nccl", "torchpass_mixed"), ("cpu:gloo, cuda:nccl", "torchpass_mixed")],
)
def test_rewrite_maps_nccl_requests_to_their_kind(backend, name):
    if dist.is_nccl_available():
        assert comms._rewrite_backend(backend) == name
    else:
        with pytest.raises(RuntimeError, match=f"backend {backend!r} asks for NCCL, which this torch build does not have"):
            comms._rewrite_backend(backend)


@pytest.mark.parametrize("name, cpu, cuda, shown", [("torchpass", "gloo", "gloo", "gloo"), ("torchpass_nccl", None, "nccl", "nccl"), ("torchpass_mixed", "gloo", "nccl", "nccl")])
def test_each_registered_name_is_one_kind_of_inner_backends(name, cpu, cuda, shown):
    inner = comms._KINDS[name]
    assert (inner.cpu, inner.cuda, inner.name) == (cpu, cuda, shown)
    if cuda != "nccl" or dist.is_nccl_available():
        assert comms._rewrite_backend(name) == name


@pytest.mark.parametrize("backend", ["mpi", "ucc", "cpu:mpi", "cuda:ucc"])
def test_rewrite_rejects_backends_it_cannot_rebuild(backend):
    with pytest.raises(RuntimeError) as info:
        comms._rewrite_backend(backend)
    message = str(info.value)
    assert f"backend {backend!r} cannot be rebuilt" in message
    assert "'gloo' (CPU and CUDA tensors), 'nccl' and 'cpu:gloo,cuda:nccl'" in message


# ---- install(), in a fresh interpreter (it patches c10d for the whole process) ---------------

_INSTALL_PROBE = textwrap.dedent(
    """
    import json, sys, tempfile
    import torch, torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torchpass.core import comms

    out = {}
    comms.install()
    helper = c10d._new_process_group_helper
    comms.install()  # a second call must change nothing
    out["helper_unchanged"] = c10d._new_process_group_helper is helper
    out["cpu_backend"] = dist.Backend.default_device_backend_map["cpu"]
    out["registered"] = "torchpass" in dist.Backend.backend_list
    path = tempfile.mktemp()
    dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    world = dist.group.WORLD
    out["world_type"] = type(world).__name__
    t = torch.ones(2)
    dist.all_reduce(t)
    out["allreduce"] = t.tolist()
    sub = dist.new_group([0])
    out["new_group_type"] = type(sub).__name__
    out["group_names"] = [g.group_name for g in comms.groups()]
    import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend, as torchtitan does
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("world",))
    try:  # what torchtitan's ParallelDims.build_mesh does for a size-1 dimension
        mesh._unflatten(0, (1, 1), ("pp", "dp"), backend_override={"pp": "fake"})
        out["unflatten"] = "ok"
    except Exception as exc:
        out["unflatten"] = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def installed() -> dict:
    proc = subprocess.run([sys.executable, "-c", _INSTALL_PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_install_is_idempotent_and_routes_gloo_groups(installed):
    assert installed["helper_unchanged"]
    assert installed["cpu_backend"] == "torchpass"
    assert installed["registered"]
    assert installed["world_type"] == "RebuildableProcessGroup"
    assert installed["new_group_type"] == "RebuildableProcessGroup"
    assert installed["allreduce"] == [1.0, 1.0]
    assert len(installed["group_names"]) == 2


def test_install_leaves_fake_groups_alone(installed):
    assert installed["unflatten"] == "ok"
