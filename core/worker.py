"""Worker bootstrap: ``python -m torchpass.core.worker [-m module | script] [args...]``.

``torchpass launch`` starts every worker, active or spare, through this module:

0. die with its launcher (``liveness.die_with_parent``): no orphan outlives it;
1. install rebuildable process groups (:func:`torchpass.core.comms.install`) so
   the training script's ``init_process_group("gloo")`` creates them;
2. start the runtime: register with the controller, start heartbeats;
3. activate the installed framework integrations
   (:mod:`torchpass.core.integrations`), which hook a framework when the
   script imports it, so an unmodified script is migratable;
4. a spare makes its CUDA context on its own GPU where its slot has one
   (:func:`torchpass.core.devices.warm_spare`), imports the modules the
   script imports (so it is warm; the integrations' warm-ups run then) and
   freezes what that made out of later garbage collections, then waits for an assignment; once it has a rank it sets the environment
   ``torchrun`` would have given that rank and makes new process groups start
   local;
5. run the training script as ``__main__``. An uncaught exception is written
   to ``TORCHELASTIC_ERROR_FILE`` (torch elastic's error-file format) so the
   agent can tell a bug in the script, which it must not retry on a spare, from
   a crash or a kill, which it migrates.
"""

from __future__ import annotations

import ast
import atexit
import gc
import importlib
import importlib.util
import os
import runpy
import sys
import traceback
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from . import comms, devices, integrations, liveness, rng, runtime

__all__ = ["main"]


def _script_imports(script: str) -> list[str]:
    """Installed modules the script imports anywhere (a ``main()`` that imports its framework too), module-level
    imports first; not modules of files next to it."""
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"))
    except (OSError, SyntaxError) as exc:
        print(f"[torchpass] not preloading imports of {script}: {exc}", file=sys.stderr, flush=True)
        return []
    here = Path(script).resolve().parent
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    out = []
    for name in dict.fromkeys(names):
        top = name.split(".")[0]
        if (here / top).exists() or (here / f"{top}.py").exists():
            continue
        if importlib.util.find_spec(top) is not None:
            out.append(name)
    return out


# Modules torch imports lazily the first time a job builds its model (measured: DDP's
# constructor spends 2.2 s importing torch._dynamo on a cold process); a spare imports
# them while it waits, so they are not on the migration's critical path.
_WARM = (
    "torch._dynamo",
    "torch.nn.parallel",
    "torch.distributed.optim",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.utils.data",
    "torchpass.core.api",
)


def _preload(target: str, is_module: bool) -> None:
    """Import what the script will import, so a spare's set-up after assignment is short."""
    names = [target] if is_module else _script_imports(target)
    for name in [*_WARM, *names]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the script will import it again and fail loudly if it must
            print(f"[torchpass] spare preload of {name!r} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _freeze_preloaded() -> None:
    """Keep the preloaded modules' objects out of every later garbage collection.

    Frameworks collect during set-up (DeepSpeed's ZeRO-3 partitioning calls ``gc.collect()``),
    and a full collection walks every object the imports made: ~0.13 s in a spare that has
    imported torch and DeepSpeed, paid after the assignment. Frozen objects are moved to a
    permanent generation that collections skip (``gc.freeze``); the garbage the imports left
    is collected first, so what is frozen is what stays alive anyway.
    """
    gc.collect()
    gc.freeze()


def _become_rank(rank: int) -> None:
    os.environ["RANK"] = str(rank)
    os.environ["ROLE_RANK"] = str(rank)
    os.environ["TORCHPASS_ROLE"] = "active"


_own_setup_store: list[dist.TCPStore] = []
"""The set-up store a spare hosts for itself on an etcd job (kept alive as long as the process)."""


def _host_own_setup_store() -> None:
    """Point a spare's ``init_process_group`` at a store of its own, on a job whose control plane is on etcd.

    The script's ``env://`` rendezvous connects to ``MASTER_ADDR:MASTER_PORT``, node 0's set-up store. A spare's
    groups start local and join the generation through the job's store, so that store is never read; but node 0
    may be the host that was lost (and the controller moved): a connection to it would only time out.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _own_setup_store.append(store)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(store.port)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    is_module = bool(argv) and argv[0] in ("-m", "--module")
    if is_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m torchpass.core.worker [-m module | script] [args...]")
    target, args = argv[0], argv[1:]
    liveness.die_with_parent(int(os.environ["TORCHPASS_AGENT_PID"]))
    comms.install()
    rt = runtime.init_from_env()
    rt.install_signal_handlers()
    integrations.activate_all(args)
    # The script's command line from the start: a module that reads sys.argv when imported (TorchTitan's
    # ConfigManager binds it as a default) sees the same in a spare's preload as in the script.
    sys.argv = [target, *args]
    if rt.role == "spare":
        devices.warm_spare(int(os.environ["LOCAL_RANK"]))
        _preload(target, is_module)
        # Its first call proves NumPy's state layout (core/rng.py): ~1-11 ms, while waiting.
        rng.capture_rng()
        _freeze_preloaded()
        _become_rank(rt.wait_for_assignment())
        comms.set_local_mode_default(True)
        if rt.store_address.etcd:
            _host_own_setup_store()
    error_handler = ErrorHandler()
    error_handler.initialize()
    code = 0
    try:
        if is_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(target).resolve().parent))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        error_handler.record_exception(exc)
        traceback.print_exc()
        code = 1
    rt.finish()
    _exit(code)


def _exit(code: int) -> None:
    """Leave without interpreter finalization.

    The runtime's threads block in store waits and gloo keeps worker threads;
    tearing those down during finalization aborts the process ("terminate
    called without an active exception"), which would look like a crash to the
    agent. The script's atexit handlers still run first.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
