"""Post-import hooks and entry-point integrations (core/integrations.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from torchpass.core import integrations


@pytest.fixture
def package_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("tp_hooked")]:
        del sys.modules[name]


def test_callback_runs_after_the_module_executes_and_the_loader_is_restored(package_dir: Path) -> None:
    (package_dir / "tp_hooked_a.py").write_text("VALUE = 41\n")
    seen: list[ModuleType] = []
    integrations.when_imported("tp_hooked_a", seen.append)
    assert not seen
    import tp_hooked_a  # type: ignore[import-not-found]

    assert seen == [tp_hooked_a] and tp_hooked_a.VALUE == 41
    assert type(tp_hooked_a.__loader__).__name__ == "SourceFileLoader"
    assert tp_hooked_a.__spec__.loader is tp_hooked_a.__loader__


def test_an_already_imported_module_is_called_back_at_once(package_dir: Path) -> None:
    (package_dir / "tp_hooked_b.py").write_text("")
    import tp_hooked_b  # type: ignore[import-not-found]

    seen: list[ModuleType] = []
    integrations.when_imported("tp_hooked_b", seen.append)
    assert seen == [tp_hooked_b]


def test_a_package_is_hooked_before_its_submodules_run(package_dir: Path) -> None:
    pkg = package_dir / "tp_hooked_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub.py").write_text("import tp_hooked_pkg\nHOOKED = getattr(tp_hooked_pkg, 'hooked', False)\n")
    integrations.when_imported("tp_hooked_pkg", lambda m: setattr(m, "hooked", True))
    from tp_hooked_pkg import sub  # type: ignore[import-not-found]

    assert sub.HOOKED


def test_a_failing_integration_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        name = "broken"
        value = "somewhere:activate"

        def load(self):  # noqa: ANN202
            def activate(argv: list[str]) -> None:
                raise ValueError("no such thing")

            return activate

    monkeypatch.setattr(integrations, "entry_points", lambda group: [Broken()])
    with pytest.raises(RuntimeError, match="integration 'broken' .*no such thing"):
        integrations.activate_all([])


def test_installed_integrations_do_not_import_their_frameworks() -> None:
    code = (
        "import sys; from torchpass.core import integrations; "
        "names = integrations.activate_all(['--torchpass']); "
        "print(sorted(names), 'deepspeed' in sys.modules, 'megatron' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("]")[1].split() == ["False", "False"], out
    assert "'deepspeed'" in out and "'megatron'" in out, out


def test_a_spare_warm_up_runs_for_an_import_while_the_spare_waits_and_not_after_its_assignment(
    package_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An import the script makes only after the assignment must not run a warm-up there, on the critical path."""
    (package_dir / "tp_hooked_preloaded.py").write_text("")
    (package_dir / "tp_hooked_later.py").write_text("")
    warmed: list[str] = []
    monkeypatch.setenv("TORCHPASS_ROLE", "spare")
    integrations.when_imported_by_waiting_spare("tp_hooked_preloaded", lambda m: warmed.append(m.__name__))
    integrations.when_imported_by_waiting_spare("tp_hooked_later", lambda m: warmed.append(m.__name__))
    import tp_hooked_preloaded  # type: ignore[import-not-found]  # noqa: F401  (the spare's preload)

    monkeypatch.setenv("TORCHPASS_ROLE", "active")  # what torchpass.core.worker does at the assignment
    import tp_hooked_later  # type: ignore[import-not-found]  # noqa: F401  (the script, after it)

    assert warmed == ["tp_hooked_preloaded"]


def test_an_active_worker_registers_no_spare_warm_up(package_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (package_dir / "tp_hooked_active.py").write_text("")
    monkeypatch.setenv("TORCHPASS_ROLE", "active")
    warmed: list[str] = []
    integrations.when_imported_by_waiting_spare("tp_hooked_active", lambda m: warmed.append(m.__name__))
    import tp_hooked_active  # type: ignore[import-not-found]  # noqa: F401

    assert warmed == [] and "tp_hooked_active" not in integrations._callbacks
