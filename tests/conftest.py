"""Shared pytest fixtures.

``fixture_models`` writes every tiny GGUF fixture once per session (see
``tests/fixtures/models.py``); it maps stable keys (``llama``, ``mistral``,
``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``, ``phi3``, ``llama_q8_0``,
``no_template``, ``lora``, ``split``, ``projector``, ``not_gguf``,
``truncated``, ...) to paths.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from aner_nb import magics as magics_pkg
from fixtures.models import write_all


@pytest.fixture(scope="module")
def one_thread():
    """One engine thread for the module that asks for it: two spinning engine threads on a shared
    2-vCPU machine make the tiny model 100x slower."""
    from aner_nb.llm import _engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_engine.THREADS_ENV, "1")
        yield


@pytest.fixture
def free_rows(monkeypatch):
    """Speculative leases made in the test treat verification rows as free, so every lookup is verified.

    For tests of verification itself (rollback, identity, statistics): on the tiny fixtures a second
    row costs about a whole step, so the measured policy (tested in test_row_costs.py and
    test_draft_policy.py) rightly proposes almost nothing there.
    """
    from aner_nb.llm import speculation
    from aner_nb.llm.draft_policy import FREE_ROWS

    monkeypatch.setattr(speculation, "row_costs", lambda *args, **kwargs: FREE_ROWS)


@pytest.fixture
def decode_sizes(monkeypatch) -> list[int]:
    """The row count of every ``llama_decode`` call made in the test, in order (each still runs)."""
    from aner_nb.llm import _engine

    sizes: list[int] = []
    real = _engine.NativeContext.decode

    def counted(self, batch):
        sizes.append(batch.n_tokens)
        return real(self, batch)

    monkeypatch.setattr(_engine.NativeContext, "decode", counted)
    return sizes


@pytest.fixture(scope="session")
def fixture_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_all(tmp_path_factory.mktemp("gguf-fixtures"))


@pytest.fixture(scope="session")
def llama_path(fixture_models: dict[str, Path]) -> Path:
    return fixture_models["llama"]


@pytest.fixture(scope="session")
def qwen2_path(fixture_models: dict[str, Path]) -> Path:
    return fixture_models["qwen2"]


# -- an IPython shell with the extension, for the magics tests ----------------------------------------
@pytest.fixture(scope="module")
def shell():
    """The process-wide IPython shell (history in memory); the extension is unloaded after the module."""
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    ip = InteractiveShell.instance(config=config)
    yield ip
    if magics_pkg.extension_for(ip) is not None:
        ip.run_line_magic("unload_ext", "aner_nb")


@pytest.fixture
def ip(shell):
    """The shell with the extension loaded; afterwards every handle is closed, every setting restored
    and the namespace reset, so each test starts from the same shell."""
    # %config also records values in the shell's config (a rejected one included), and a
    # newly loaded extension would read them: every test starts and ends without them.
    shell.config.pop("LLMMagics", None)
    if magics_pkg.extension_for(shell) is None:
        shell.run_line_magic("load_ext", "aner_nb")
    magics = magics_pkg.extension_for(shell).magics
    saved = {name: getattr(magics, name) for name in magics.trait_names(config=True)}
    yield shell
    ext = magics_pkg.extension_for(shell)
    if ext is not None:
        ext.handles.close_all()
        for name, value in saved.items():
            setattr(ext.magics, name, value)
    shell.config.pop("LLMMagics", None)
    shell.run_cell("%reset -f")
    for name in ("last_value", "last_traceback", "last_type", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
