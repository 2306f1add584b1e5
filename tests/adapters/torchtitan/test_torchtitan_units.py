"""Unit tests of the TorchTitan adapter: the [torchpass] section, the layout, replayable data, FSDP2 reset.

Single process, no launcher: TorchTitan's own ConfigManager and ParallelDims
(on a fake process group) are the references where they exist.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchpass.adapters.torchtitan.data import TitanData
from torchpass.adapters.torchtitan.job_config import LAUNCHER_SETTINGS, TorchPass, resolve_config, section_settings
from torchpass.adapters.torchtitan.layout import layout_of
from tests.support.harness import free_port
from torchpass.core.config import ConfigError, TorchPassConfig, config_from_mapping

# ---- the [torchpass] section ------------------------------------------------------------------


def _dotted_fields(cls: type, prefix: str = "") -> set[str]:
    out = set()
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out |= _dotted_fields(type(default), f"{prefix}{f.name}.") if dataclasses.is_dataclass(default) else {prefix + f.name}
    return out


def test_section_mirrors_every_core_setting_and_sets_none_by_default() -> None:
    # `enable` (TorchTitan's spelling of a section's switch) stands for the core's `enabled`.
    assert _dotted_fields(TorchPass) == _dotted_fields(TorchPassConfig) - {"enabled"} | {"enable"}
    assert section_settings(TorchPass()) == {}
    assert TorchPass().enable is True


@pytest.mark.parametrize(("section", "launcher", "enabled"), [(True, True, True), (False, True, False), (True, False, False)])
def test_migration_is_off_when_the_section_or_the_launcher_says_so(section: bool, launcher: bool, enabled: bool) -> None:
    launched = config_from_mapping({"enabled": launcher})
    assert resolve_config(TorchPass(enable=section), launched, "[torchpass] of job.toml").enabled is enabled


@pytest.mark.parametrize(("flags", "enable"), [([], True), (["--torchpass.enable"], True), (["--torchpass.no-enable"], False)])
def test_enable_is_a_flag_on_torchtitan_s_command_line(tmp_path: Path, flags: list[str], enable: bool) -> None:
    from torchtitan.config import ConfigManager

    toml = _write_toml(tmp_path / "job.toml", "[torchpass]\nenable = true\n")
    assert ConfigManager().parse_args(["--job.config_file", str(toml), *flags]).torchpass.enable is enable


def test_keys_the_section_leaves_out_keep_what_torchpass_launch_was_given() -> None:
    launched = config_from_mapping({"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "chaos": {"kill_rank": 2}})
    section = TorchPass(redundancy="buddy", buddy_interval_steps=3)
    section.chaos.kill_step = 5
    config = resolve_config(section, launched, "[torchpass] of job.toml")
    assert (config.redundancy, config.buddy_interval_steps) == ("buddy", 3)
    assert (config.heartbeat_interval_s, config.heartbeat_timeout_s) == (0.5, 3.0)
    assert (config.chaos.kill_rank, config.chaos.kill_step) == (2, 5)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"buddy_interval_steps": "two"}, "[torchpass] of job.toml: buddy_interval_steps: got 'two' (str); expected an integer"),
        ({"buddy_interval_steps": 0}, "buddy_interval_steps: got 0; expected an integer >= 1"),
        ({"redundancy": "mirror"}, "redundancy: got 'mirror'; expected one of 'auto', 'replica', 'buddy'"),
        ({"heartbeat_timeout_s": 0.5}, "heartbeat_timeout_s: got 0.5; expected a number greater than heartbeat_interval_s (1.0)"),
        ({"run_dir": "elsewhere"}, "run_dir: torchpass launch reads this before the job config exists; set it on the launcher instead (torchpass launch --run-dir DIR)"),
    ],
)
def test_a_bad_value_fails_naming_the_key(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_config(TorchPass(**settings), TorchPassConfig(), "[torchpass] of job.toml")
    assert message in str(err.value)


def test_launcher_settings_are_section_keys() -> None:
    assert set(LAUNCHER_SETTINGS) <= _dotted_fields(TorchPass)


def _write_toml(path: Path, torchpass_table: str) -> Path:
    path.write_text('[job]\ncustom_config_module = "torchpass.adapters.torchtitan.job_config"\n\n' + torchpass_table)
    return path


def test_torchtitan_reads_the_section_through_its_custom_config_module(tmp_path: Path) -> None:
    from torchtitan.config import ConfigManager

    toml = _write_toml(tmp_path / "job.toml", "[torchpass]\nbuddy_interval_steps = 2\n\n[torchpass.chaos]\nkill_rank = 1\n")
    config = ConfigManager().parse_args(["--job.config_file", str(toml), "--torchpass.redundancy", "buddy"])
    assert section_settings(config.torchpass) == {"buddy_interval_steps": 2, "redundancy": "buddy", "chaos": {"kill_rank": 1}}


def test_the_entry_point_declares_the_section_unless_the_job_names_its_own_module(tmp_path: Path) -> None:
    from torchtitan.config import ConfigManager

    from torchpass.adapters.torchtitan.train import with_torchpass_section

    bare = tmp_path / "bare.toml"
    bare.write_text("[torchpass]\nbuddy_interval_steps = 3\n")
    config = ConfigManager().parse_args(with_torchpass_section(["--job.config_file", str(bare)]))
    assert section_settings(config.torchpass) == {"buddy_interval_steps": 3}
    own = ["--job.config_file", str(_write_toml(tmp_path / "own.toml", ""))]
    assert with_torchpass_section(own) == own
    flagged = ["--job.config_file", str(bare), "--job.custom_config_module=my.module"]
    assert with_torchpass_section(flagged) == flagged


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("enabled = true", "unknown key enabled (did you mean 'enable'?); valid keys: buddy_interval_steps, chaos, comm_failures_per_step, controller_lease_s, enable,"),
        ("buddy_interval_step = 2", "unknown key buddy_interval_step (did you mean 'buddy_interval_steps'?)"),
        ("[torchpass.chaos]\nkill_rnk = 1", "unknown key chaos.kill_rnk (did you mean 'kill_rank'?); valid keys: action, kill_point, kill_rank, kill_step"),
    ],
)
def test_the_entry_point_names_an_unknown_key_before_torchtitan_parses(tmp_path: Path, table: str, message: str) -> None:
    from torchpass.adapters.torchtitan.train import with_torchpass_section

    toml = tmp_path / "job.toml"
    toml.write_text("[torchpass]\n" + table + "\n")
    with pytest.raises(ConfigError) as err:
        with_torchpass_section(["--job.config_file", str(toml)])
    assert f"[torchpass] section of {toml}: {message}" in str(err.value)


def test_torchtitan_rejects_an_unknown_key_in_the_section(tmp_path: Path) -> None:
    from torchtitan.config import ConfigManager

    toml = _write_toml(tmp_path / "job.toml", "[torchpass]\nbuddy_interval_stepz = 2\n")
    with pytest.raises(ValueError, match="buddy_interval_stepz"):
        ConfigManager().parse_args(["--job.config_file", str(toml)])


# ---- when the trainer migrates -------------------------------------------------------------------


def _job_config(section: Any, pp: int = 1, ft: bool = False, checkpoint: str | None = None, compile: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        torchpass=section,
        compile=SimpleNamespace(enable=compile),
        job=SimpleNamespace(config_file="job.toml"),
        parallelism=SimpleNamespace(pipeline_parallel_degree=pp),
        fault_tolerance=SimpleNamespace(enable=ft),
        checkpoint=SimpleNamespace(enable=checkpoint is not None, async_mode=checkpoint or "disabled"),
    )


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A stand-in for the runtime ``torchpass launch`` starts in each worker."""
    from torchpass.core import runtime

    rt = SimpleNamespace(config=config_from_mapping({"redundancy": "replica"}))
    monkeypatch.setattr(runtime, "current", lambda: rt)
    return rt


def test_without_torchpass_launch_the_section_is_validated_but_nothing_migrates() -> None:
    from torchpass.adapters.torchtitan.trainer import migration_config

    assert migration_config(_job_config(TorchPass(buddy_interval_steps=2))) is None
    with pytest.raises(ConfigError, match="buddy_interval_steps"):
        migration_config(_job_config(TorchPass(buddy_interval_steps=-1)))


def test_under_torchpass_launch_the_section_becomes_the_runtime_config(launched: SimpleNamespace) -> None:
    from torchpass.adapters.torchtitan.trainer import migration_config

    config = migration_config(_job_config(TorchPass(buddy_interval_steps=2)))
    assert config is launched.config
    assert (config.buddy_interval_steps, config.redundancy) == (2, "replica")


def test_no_section_or_enable_false_runs_without_migration(launched: SimpleNamespace) -> None:
    from torchpass.adapters.torchtitan.trainer import migration_config

    before = launched.config
    assert migration_config(SimpleNamespace(job=SimpleNamespace(config_file="job.toml"))) is None
    assert migration_config(_job_config(TorchPass(enable=False))) is None
    assert launched.config is before


def test_pipeline_parallelism_is_refused_naming_the_setting(launched: SimpleNamespace) -> None:
    from torchpass.adapters.torchtitan.trainer import migration_config

    with pytest.raises(ConfigError, match="pipeline_parallel_degree = 2"):
        migration_config(_job_config(TorchPass(), pp=2))


def test_torchtitan_fault_tolerance_and_torchpass_together_are_refused(launched: SimpleNamespace) -> None:
    from torchpass.adapters.torchtitan.trainer import migration_config

    with pytest.raises(ConfigError, match=r"\[fault_tolerance\] enable = true and \[torchpass\] enable = true: only one of them can drive recovery"):
        migration_config(_job_config(TorchPass(), ft=True))
    # Either one alone is fine.
    assert migration_config(_job_config(TorchPass(enable=False), ft=True)) is None
    assert migration_config(_job_config(TorchPass(), checkpoint="disabled")) is launched.config


def test_a_compiled_model_is_refused_naming_the_setting(launched: SimpleNamespace) -> None:
    from torchpass.adapters.torchtitan.trainer import migration_config

    with pytest.raises(ConfigError, match=r"\[compile\] enable = true: the TorchTitan adapter does not migrate compiled models yet"):
        migration_config(_job_config(TorchPass(), compile=True))


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_an_asynchronous_checkpointer_is_refused_naming_the_setting(launched: SimpleNamespace, mode: str) -> None:
    from torchpass.adapters.torchtitan.trainer import migration_config

    with pytest.raises(ConfigError, match=f"checkpoint.async_mode = '{mode}'"):
        migration_config(_job_config(TorchPass(), checkpoint=mode))


# ---- layout -------------------------------------------------------------------------------------

DEGREES = [
    # dp_replicate, dp_shard, cp, tp, pp, ep, etp
    (4, 1, 1, 1, 1, 1, 1),
    (2, 2, 1, 1, 1, 1, 1),
    (1, 4, 1, 1, 1, 1, 1),
    (1, 2, 1, 2, 1, 1, 1),
    (2, 2, 2, 2, 1, 1, 2),
    (2, 2, 1, 2, 2, 2, 1),
]


@pytest.mark.parametrize(("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp"), DEGREES)
def test_replica_sets_are_the_ranks_torchtitan_meshes_replicate_over(
    monkeypatch: pytest.MonkeyPatch, dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int, ep: int, etp: int
) -> None:
    """For dense and expert parameters alike, ranks differing only in dp_replicate hold the same shard."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed import ParallelDims

    monkeypatch.setattr(parallel_dims_module, "device_type", "cpu")
    world = dp_replicate * dp_shard * cp * tp * pp
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        pd = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, ep=ep, etp=etp, world_size=world)
        pd.build_mesh()
        layout = layout_of(pd)
        for mesh_name in ("dense", "sparse"):
            mesh = pd._global_meshes[mesh_name]
            ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("dp_replicate"), -1).reshape(-1, dp_replicate)
            for replicas in ranks.tolist():
                for rank in replicas:
                    assert layout.replica_set(rank, "params") == sorted(replicas), (mesh_name, rank)
                    assert layout.replica_set(rank, "optimizer") == sorted(replicas), (mesh_name, rank)
        assert layout.replica_set(0, "global") == list(range(world))
    finally:
        dist.destroy_process_group()


def test_without_dp_replicate_the_state_is_sharded() -> None:
    pd = SimpleNamespace(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, etp=1, world_size=4)
    assert layout_of(pd).sharded_classes() == ["optimizer", "params"]


# ---- replayable data -----------------------------------------------------------------------------


class _Counting(IterableDataset):
    """0, 1, 2, ... (``limit`` items), resumable from its state like TorchTitan's text datasets."""

    def __init__(self, limit: int = 1000):
        self.limit = limit
        self.next = 0

    def __iter__(self) -> Iterator[int]:
        while self.next < self.limit:
            self.next += 1
            yield self.next - 1

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next = state["next"]


def _data(limit: int = 1000, stream: str = "batch rank 0 of 1") -> TitanData:
    return TitanData(StatefulDataLoader(_Counting(limit), batch_size=2), stream=stream, keep_steps=2)


def _ints(batch: torch.Tensor) -> list[int]:
    return batch.tolist()


def test_a_rewound_step_gets_its_batches_again() -> None:
    data = _data()
    data.mark_step(1)
    first = [_ints(data.next_batch()) for _ in range(2)]
    data.mark_step(2)
    second = [_ints(data.next_batch()) for _ in range(2)]
    start = data.step_start(2)
    assert start is not None
    data.seek(start)
    assert [_ints(data.next_batch()) for _ in range(2)] == second
    assert first == [[0, 1], [2, 3]] and second == [[4, 5], [6, 7]]


@pytest.mark.parametrize("replaying", [False, True])
def test_a_spare_continues_the_stream_from_a_snapshot(replaying: bool) -> None:
    data = _data()
    for step in (1, 2):
        data.mark_step(step)
        data.next_batch()
    if replaying:
        start = data.step_start(2)
        assert start is not None
        data.seek(start)
    snapshot = data.snapshot()
    expected = [_ints(data.next_batch()) for _ in range(3)]
    spare = _data()
    spare.fast_forward(snapshot)
    assert spare.position == data.position - 3
    assert [_ints(spare.next_batch()) for _ in range(3)] == expected


def test_a_spare_s_loader_reports_the_position_it_trains_from_not_how_far_it_read() -> None:
    """TorchTitan's checkpoint saves the loader's state_dict(): after a spare's fast-forward it must be the
    source's, although opening the spare's iterator already drew the next batch."""
    data = _data()
    for step in (1, 2):
        data.mark_step(step)
        data.next_batch()
    snapshot = data.snapshot()
    spare = _data()
    spare.fast_forward(snapshot)
    assert spare.loader.state_dict() == data.loader.state_dict() == snapshot["loader"]
    assert spare.snapshot()["loader"] == snapshot["loader"]
    spare.mark_step(3)
    data.mark_step(3)
    assert _ints(spare.next_batch()) == _ints(data.next_batch())
    assert spare.loader.state_dict() == data.loader.state_dict()


def test_a_job_resumed_from_torchtitan_s_checkpoint_streams_from_the_loaded_state() -> None:
    source = _data()
    for step in (1, 2):
        source.mark_step(step)
        source.next_batch()
    saved = source.loader.state_dict()  # what TorchTitan's checkpointer saved
    resumed = _data()
    resumed.loader.load_state_dict(saved)  # what its load does on restart
    resumed.mark_step(3)
    first = _ints(resumed.next_batch())
    assert first == [4, 5]
    start = resumed.step_start(3)
    assert start is not None
    resumed.seek(start)
    spare = _data()
    spare.fast_forward(resumed.snapshot())  # a spare replacing a rank in the first step after the restart
    assert _ints(spare.next_batch()) == first


def test_a_snapshot_before_the_first_batch_starts_the_stream_from_the_beginning() -> None:
    spare = _data()
    spare.fast_forward(_data().snapshot())
    assert _ints(spare.next_batch()) == [0, 1]


def test_a_spare_refuses_another_batch_rank_s_stream() -> None:
    data = _data(stream="batch rank 1 of 2")
    data.mark_step(1)
    data.next_batch()
    with pytest.raises(RuntimeError, match="reads the data of batch rank 0 of 2, but the data position it was given is that of batch rank 1 of 2"):
        _data(stream="batch rank 0 of 2").fast_forward(data.snapshot())


def test_an_exhausted_loader_ends_training_as_torchtitan_does() -> None:
    from torchtitan.components.dataloader import DataloaderExhaustedError

    data = _data(limit=4)
    data.mark_step(1)
    data.next_batch()
    data.next_batch()
    with pytest.raises(DataloaderExhaustedError):
        data.next_batch()


# ---- FSDP2 after an interrupted backward ---------------------------------------------------------


class _Interrupt(Exception):
    pass


def test_fsdp2_reset_lets_an_interrupted_step_run_again_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.fsdp import fully_shard

    from torchpass.adapters.torchtitan.fsdp2 import reset_after_abort

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), block, torch.nn.Linear(16, 4))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        x = torch.randn(3, 8)

        def grads() -> list[torch.Tensor]:
            model.zero_grad(set_to_none=True)
            model(x).square().sum().backward()
            return [p.grad.to_local().clone() for p in model.parameters()]

        expected = grads()
        model.zero_grad(set_to_none=True)
        # Interrupt the backward inside `block`, one FSDP unit: its second layer has its (unsharded)
        # gradient, the unit has not reduced it. torch's reset_iter_state() alone keeps that gradient.
        handle = block[0].register_full_backward_pre_hook(lambda module, grad: (_ for _ in ()).throw(_Interrupt()))
        with pytest.raises(_Interrupt):
            model(x).square().sum().backward()
        handle.remove()
        reset_after_abort(model)
        model.zero_grad(set_to_none=True)
        again = grads()
        assert all(torch.equal(a, b) for a, b in zip(again, expected))
    finally:
        dist.destroy_process_group()


# ---- TorchTitan's checkpointer under migration -----------------------------------------------------


class _Checkpointer:
    """The part of TorchTitan's CheckpointManager the adapter uses: ``save``, ``load``, ``_should_save``, ``enable``."""

    def __init__(self, interval: int):
        self.enable = True
        self.interval = interval
        self.saved: list[tuple[int, bool]] = []
        self.loaded = False

    def _should_save(self, step: int, last_step: bool = False) -> bool:
        return last_step or step % self.interval == 0

    def save(self, step: int, last_step: bool = False) -> None:
        self.saved.append((step, last_step))

    def load(self, step: int = -1) -> bool:
        self.loaded = True
        return True


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_due_save_is_written_once_and_a_spare_never_loads() -> None:
    from torchpass.adapters.torchtitan.checkpointing import Checkpoints

    active, spare = _Checkpointer(interval=5), _Checkpointer(interval=5)
    saves = Checkpoints(active, last_step=10, device=torch.device("cpu"), joining=False)
    Checkpoints(spare, last_step=10, device=torch.device("cpu"), joining=True)
    for step in (1, 5, 5, 7, 10, 10):
        saves.write(step)
    assert active.saved == [(5, False), (10, True)]
    assert spare.load() is False and not spare.loaded
    assert active.load() is True


def test_after_a_migration_an_interrupted_save_is_owed_and_a_completed_one_is_not(world_of_one: None) -> None:
    from torchpass.adapters.torchtitan.checkpointing import Checkpoints

    ckpt = _Checkpointer(interval=5)
    saves = Checkpoints(ckpt, last_step=10, device=torch.device("cpu"), joining=False)
    saves.agree(5, joining=False)  # the fault came before (or inside) the save of step 5
    assert saves.pending == 5
    saves.write(5)
    assert ckpt.saved == [(5, False)] and saves.pending is None
    saves.agree(5, joining=False)  # a second migration back to step 5: already written
    assert saves.pending is None
    saves.write(5)
    assert ckpt.saved == [(5, False)]
    saves.agree(6, joining=False)  # step 6 saves nothing
    assert saves.pending is None
    # A joining rank has no say; here it is the only member, so nothing is owed.
    fresh = Checkpoints(_Checkpointer(interval=5), last_step=10, device=torch.device("cpu"), joining=True)
    fresh.agree(10, joining=True)
    assert fresh.pending is None
