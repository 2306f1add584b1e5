"""The worker bootstrap's spare preload: which modules a spare imports while it waits."""

from __future__ import annotations

from pathlib import Path

from torchpass.core.worker import _script_imports


def test_a_spare_preloads_every_installed_module_the_script_imports(tmp_path: Path) -> None:
    (tmp_path / "helpers.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text(
        "import json, torch.nn\n"
        "from helpers import thing\n"
        "from . import sibling\n"
        "def main():\n"
        "    import torch.distributed.checkpoint as dcp\n"
        "    from numpy.linalg import norm\n"
        "    import not_installed_anywhere\n"
        "    if True:\n"
        "        from torch.utils.data import DataLoader\n"
    )
    names = _script_imports(str(script))
    # Full module paths, imports inside functions included, files next to the script and absent packages left out.
    assert names == ["json", "torch.nn", "torch.distributed.checkpoint", "numpy.linalg", "torch.utils.data"]


def test_an_unreadable_script_preloads_nothing(tmp_path: Path, capsys) -> None:
    assert _script_imports(str(tmp_path / "missing.py")) == []
    assert "not preloading imports" in capsys.readouterr().err
