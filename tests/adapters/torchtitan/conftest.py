"""Fixtures the TorchTitan end-to-end tests share: the generated tokenizer and dataset, a private datasets cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.torchtitan.assets import Assets, make_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Assets:
    """The tokenizer and the c4_test-style dataset TorchTitan's wheel does not ship, made once per module."""
    return make_assets(tmp_path_factory.mktemp("torchtitan-assets"))


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private Hugging Face datasets cache, so jobs run offline and never share state with the machine's."""
    return tmp_path_factory.mktemp("hf-datasets-cache")
