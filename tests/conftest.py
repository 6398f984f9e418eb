"""Shared pytest fixtures.

``fixture_models`` writes every tiny GGUF fixture once per session (see
``tests/fixtures/models.py``); it maps stable keys (``llama``, ``mistral``,
``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``, ``phi3``, ``llama_q8_0``,
``no_template``, ``lora``, ``split``, ``projector``, ``not_gguf``,
``truncated``, ...) to paths.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures.models import write_all


@pytest.fixture(scope="session")
def fixture_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_all(tmp_path_factory.mktemp("gguf-fixtures"))


@pytest.fixture(scope="session")
def llama_path(fixture_models: dict[str, Path]) -> Path:
    return fixture_models["llama"]


@pytest.fixture(scope="session")
def qwen2_path(fixture_models: dict[str, Path]) -> Path:
    return fixture_models["qwen2"]
