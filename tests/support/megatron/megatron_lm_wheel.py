"""Test support only: Megatron-LM's training code (``megatron.training``) from the megatron-core 0.17.0 wheel, on Python 3.11.

Megatron-LM's ``pretrain()``/``train()`` is not on PyPI as a package of its own:
from 0.17.0 on the megatron-core wheel carries ``megatron.training``. That wheel's
metadata asks for Python >= 3.12 and its one compiled module (the dataset index
helpers) is built for CPython 3.12, so pip refuses it here; its Python code runs
on 3.11 beside torch 2.13. :func:`ensure` provisions it for the tests:

1. ``pip download`` of the pinned wheel (any interpreter's tags, no dependencies),
   checked against :data:`WHEEL_SHA256` before anything is unpacked;
2. the wheel unpacked into a fresh directory;
3. ``megatron/core/datasets/helpers.cpp`` (shipped in the wheel) compiled for this
   interpreter with pybind11 (a test dependency) by a Makefile written beside it,
   the one a Megatron-LM checkout has there, so ``MockGPTDataset`` builds its
   sample index and Megatron-LM's own ``make`` at start-up finds it up to date;
4. the directory renamed into place: a failed or interrupted provisioning leaves
   nothing a later run could mistake for a complete one.

Processes that put the returned directory first on ``PYTHONPATH`` import
megatron-core 0.17.0 with ``megatron.training`` (``megatron`` is a namespace
package, so the 0.16.1 installed in site-packages stays shadowed, not mixed in).
The unit tests and the megatron-core tests keep using the installed 0.16.1.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

__all__ = ["VERSION", "WHEEL_SHA256", "ensure"]

VERSION = "0.17.0"
WHEEL = f"megatron_core-{VERSION}-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "0cbacf043603f9dc2735310e1b1dcd5c076c02caab13849c2d2fe6a99cbea4f6"
"""SHA-256 of :data:`WHEEL` as PyPI serves it (checked before unpacking)."""

DEFAULT_HOME = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchpass-tests"


def ensure(home: Path = DEFAULT_HOME) -> Path:
    """The directory holding megatron-core 0.17.0 with ``megatron.training``, provisioned on first use."""
    target = home / f"megatron-core-{VERSION}-py{sys.version_info.major}{sys.version_info.minor}"
    if (target / "megatron" / "training" / "training.py").exists():
        return target
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home, prefix=".provisioning-") as scratch:
        wheel = _download(Path(scratch))
        site = Path(scratch) / "site"
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
        _compile_helpers(site / "megatron" / "core" / "datasets")
        try:
            site.rename(target)
        except OSError:
            if not (target / "megatron" / "training" / "training.py").exists():
                raise  # not a concurrent provisioning that finished first
    return target


def _download(scratch: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", f"megatron-core=={VERSION}", "--no-deps",
        "--only-binary=:all:", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
        "--dest", str(scratch), "--quiet", "--disable-pip-version-check",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    wheel = scratch / WHEEL
    if result.returncode != 0 or not wheel.exists():
        raise RuntimeError(
            f"could not download megatron-core {VERSION} (Megatron-LM's training code for the Megatron-LM tests): "
            f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-2000:]}"
        )
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{WHEEL}: SHA-256 {digest}, expected {WHEEL_SHA256}; refusing to unpack it")
    return wheel


def _compile_helpers(datasets: Path) -> None:
    """Write the Makefile a Megatron-LM checkout has there (the wheel has none) and run it.

    Megatron-LM's ``initialize_megatron`` runs ``make -C megatron/core/datasets`` on
    rank 0 at every start (``compile_helpers``); with the module built here, that
    make finds it up to date.
    """
    import pybind11

    module = f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    includes = f"-I{pybind11.get_include()} -I{sysconfig.get_paths()['include']}"
    (datasets / "Makefile").write_text(
        f"{module}: helpers.cpp\n\t$(CXX) -O3 -shared -std=c++17 -fPIC {includes} $< -o $@\n"
    )
    result = subprocess.run(["make", "-C", str(datasets)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"compiling megatron-core's dataset helpers failed (make -C {datasets}):\n{result.stderr[-2000:]}")
