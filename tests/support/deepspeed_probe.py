"""One-rank checks of the DeepSpeed adapter's state handling on real engines, without the launcher.

Run as a plain process (world size 1, gloo); prints one ``RESULT {json}`` line.
For each ZeRO stage 0-3 (the reference job's model and config, GA 2):

* ``restore``: train 2 steps, capture the adapter's components (cloned), train
  step 3 and digest; then build a second engine from another seed, load the
  clone into it, train step 3: the digests must be equal;
* ``rederived``: the same with only the classes a migration moves loaded
  (ZeRO 1/2 leave out their derived ``params``) and ``resume()`` called, which
  re-gathers them;
* ``discard``: load the clone again, start step 3 and abort it after its first
  micro-batch (forward, backward, step), let the adapter discard the step,
  execute step 3 again: equal to the uninterrupted step 3;
* ``forms``: the "torchpass" block is read back from a JSON file and from
  ``--deepspeed_config``;
* ``unsupported``: ZeRO 0 with bf16 is refused naming the setting;
* ``refused``: so are ZeRO-Offload, a mixture-of-experts model, and bf16 with
  fp32 gradient accumulation (``BF16_Optimizer``), each built as a real engine;
* ``misspelled``: a bad block fails the drop-in ``torchpass.adapters.deepspeed.initialize`` without the launcher too.

The migration hooks talk to a stub runtime here: the checks are about state.
"""

import argparse
import copy
import json
import os
import tempfile
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from tests.support.deepspeed_job import Regression, dataset, ds_config, final_digest
import torchpass.adapters.deepspeed as torchpass_deepspeed
from torchpass.adapters.deepspeed.config import block_of
from torchpass.adapters.deepspeed.layout import engine_layout
from torchpass.adapters.deepspeed.migration import EngineMigration
from torchpass.adapters.deepspeed.support import UnsupportedEngine, check_supported
from torchpass.core.config import ConfigError


class Experts(torch.nn.Module):
    """A model with a DeepSpeed mixture-of-experts layer (two experts, expert parallelism 1)."""

    def __init__(self) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.moe = MoE(hidden_size=16, expert=torch.nn.Linear(16, 16), num_experts=2, ep_size=1, k=1)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden, _, _ = self.moe(x)
        return torch.nn.functional.mse_loss(self.head(hidden), y)


class StubRuntime:
    """The runtime calls EngineMigration makes, recorded instead of acted on."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def backward_started(self) -> None:
        self.calls.append("backward")

    def commit_started(self) -> None:
        self.calls.append("commit_started")

    def commit_finished(self) -> None:
        self.calls.append("commit_finished")


def clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [clone(v) for v in tree]
    return copy.deepcopy(tree)


def build(stage: int, seed: int, config: dict | None = None) -> tuple[Any, EngineMigration, StubRuntime]:
    torch.manual_seed(seed)
    model = Regression()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config or ds_config(stage, None))
    rt = StubRuntime()
    return engine, EngineMigration(engine, rt), rt  # type: ignore[arg-type]


def micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = dataset().tensors
    first = 8 * step % len(x)
    return [(x[i : i + 4], y[i : i + 4]) for i in (first, first + 4)]


def train_step(engine: Any, migration: EngineMigration, step: int, abort_after: int | None = None) -> None:
    torch.manual_seed(100 + step)  # dropout draws of the step, as the runtime's RNG restore would give
    migration.step_begins()
    for m, (x, y) in enumerate(micro_batches(step)):
        if abort_after == m:
            raise InterruptedError
        engine.backward(engine(x, y))
        engine.step()
    migration.step_ends()


def check_stage(stage: int) -> dict[str, Any]:
    engine, migration, rt = build(stage, seed=0)
    for step in (1, 2):
        train_step(engine, migration, step)
    saved = clone(migration.state_components()[0])
    rt.calls.clear()
    train_step(engine, migration, 3)
    expected = final_digest(engine)
    calls = list(rt.calls)

    fresh, fresh_migration, _ = build(stage, seed=7)
    fresh_migration.load_components(clone(saved), joining=True)
    train_step(fresh, fresh_migration, 3)
    restore = final_digest(fresh) == expected

    # What a migration moves: the copied classes only; resume() recomputes the derived ones.
    copied = set(engine_layout(fresh).copied_classes())
    classes = migration.state_components()[1]
    derived_engine, derived_migration, _ = build(stage, seed=7)
    derived_migration.load_components({k: v for k, v in clone(saved).items() if classes[k] in copied}, joining=True)
    derived_migration.resume()
    train_step(derived_engine, derived_migration, 3)
    rederived = final_digest(derived_engine) == expected

    migration.load_components(clone(saved), joining=False)
    try:
        train_step(engine, migration, 3, abort_after=1)
    except InterruptedError:
        migration.discard_step()
    train_step(engine, migration, 3)
    discard = final_digest(engine) == expected
    return {"restore": restore, "rederived": rederived, "moved": sorted(copied), "discard": discard, "calls": calls}


def main() -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    os.environ.setdefault("MASTER_PORT", "29531")
    deepspeed.init_distributed(dist_backend="gloo")
    out: dict[str, Any] = {f"zero{stage}": check_stage(stage) for stage in range(4)}

    block = {"enabled": True, "buddy_interval_steps": 3}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ds_config(1, block), f)
    forms = {}
    for form, kwargs in {
        "file": {"config": f.name},
        "args": {"args": argparse.Namespace(deepspeed_config=f.name, local_rank=0)},
    }.items():
        model = Regression()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), **kwargs)
        forms[form] = dict(block_of(engine._config._param_dict) or {}) == block
    out["forms"] = forms

    bf16 = {**ds_config(0, None), "bf16": {"enabled": True}}
    model = Regression()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=bf16)
    try:
        check_supported(engine)
        out["unsupported"] = "accepted"
    except UnsupportedEngine as exc:
        out["unsupported"] = str(exc)
    out["refused"] = {}
    zero2 = ds_config(2, None)
    for name, config, make in (
        (
            "offload",
            {**zero2, "zero_force_ds_cpu_optimizer": False, "zero_optimization": {**zero2["zero_optimization"], "offload_optimizer": {"device": "cpu"}}},
            Regression,
        ),
        ("moe", ds_config(1, None), Experts),
        ("bf16_optimizer", {**ds_config(1, None), "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, Regression),
    ):
        model = make()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        try:
            check_supported(engine)
            out["refused"][name] = "accepted"
        except UnsupportedEngine as exc:
            out["refused"][name] = str(exc)
    model = Regression()
    try:
        torchpass_deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(1, {"enabeld": True}))
        out["misspelled"] = "accepted"
    except ConfigError as exc:
        out["misspelled"] = str(exc)
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
