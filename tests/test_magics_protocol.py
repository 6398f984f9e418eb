"""The notebook layer asks leases what they are (``Lease``, ``kind``, ``supports``), never their names.

A lease kind defined outside ``aner_nb.llm`` is still a handle; ``kv_table`` is the KV budget
calculator's arithmetic; unloading finds the magics in IPython's registry by identity; and no
``__name__`` / ``__module__`` is read in ``aner_nb.magics`` or ``aner_nb.widgets`` except to
write an error message.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pandas as pd
import pytest
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

import aner_nb
from aner_nb import llm
from aner_nb import magics as magics_pkg
from aner_nb.llm import Lease
from aner_nb.llm.errors import ConfigurationError
from aner_nb.llm.weights import LoadSummary
from aner_nb.magics import handle_info, handle_table, is_handle, kv_table
from aner_nb.magics.tables import handle_kind
from aner_nb.widgets import kv_budget
from fixtures.models import write_tiny_model

PACKAGES = [Path(aner_nb.__file__).parent / name for name in ("magics", "widgets")]


class FakeLease(Lease):
    """A lease kind that lives in this test module, not in aner_nb.llm, and has no weights."""

    facts = None  # plain values instead of the protocol's metadata read from weights
    context = 512

    def load_summary(self):  # summaries of nothing: no file was loaded, no context exists
        return LoadSummary("0" * 64, 0, -1, -1, -1, -1, -1)

    def memory_summary(self):
        return llm.MemorySummary(
            model="fake", weights_bytes=0, file_bytes=0, context=self.context, kv_cache_type="f16",
            flash_attention="auto", kv_bytes=0, kv_scope="none", kv_formula="", live_contexts=0, sliding_window=0,
            rss_bytes=-1, peak_rss_bytes=-1,
        )

    def __init__(self, kind: str, facts=None, features=("generate",)) -> None:
        self._kind, self.facts, self._open_features, self._closed = kind, facts, frozenset(features), False

    @property
    def kind(self):
        return self._kind

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True

    def _features(self) -> frozenset[str]:
        return self._open_features


FakeLease.__abstractmethods__ = frozenset()  # requests are not what these tests are about


def test_any_lease_is_a_handle_and_its_kind_comes_from_the_protocol():
    throughput = FakeLease("throughput", features=("generate", "continuous_batching"))
    assert is_handle(throughput) and not is_handle(object()) and not is_handle(FakeLease)
    assert type(throughput).__module__ == __name__  # not aner_nb.llm: no module sniffing needed
    assert handle_kind(throughput) == "batching"
    assert handle_kind(FakeLease("session")) == "session"
    assert [handle_kind(FakeLease(k)) for k in ("ordinary", "latency", "adapter")] == ["lease"] * 3

    table = handle_table({"many": throughput, "_": throughput, "n": 3}).set_index("name")
    assert list(table.index) == ["many"] and table.loc["many", "kind"] == "batching"
    info = handle_info(throughput)["value"]
    assert info["kind"] == "batching" and info["supports"] == "generate, continuous_batching"
    throughput.close()
    assert handle_info(throughput)["value"]["supports"] == "(closed)"  # closed leases support nothing


@pytest.fixture(scope="module")
def odd_facts(tmp_path_factory):
    """Header facts of a model whose head dims (48) no quantized KV type can store."""
    path = write_tiny_model(
        tmp_path_factory.mktemp("odd") / "odd.gguf", "llama",
        metadata={"llama.attention.key_length": 48, "llama.attention.value_length": 48},
    )
    return llm.inspect_model(path)


def test_kv_table_is_the_kv_budget_arithmetic(odd_facts):
    lease = FakeLease("ordinary", facts=odd_facts)
    lease.close()  # a closed lease has no current KV type, but its facts still give the estimate
    frame = kv_table(lease, context=300, slots=2).set_index("kv_cache_type")
    budget = kv_budget(odd_facts, slots=2)
    for kv_type in llm.KV_CACHE_TYPES:
        expected = budget.total_kv_bytes(kv_type, 300)
        shown = frame.loc[kv_type, "total_bytes"]
        assert (pd.isna(shown) and expected is None) or shown == expected, kv_type
        assert not frame.loc[kv_type, "current"]
    # llama.cpp allocates KV cells in blocks of 256: a 300-token context takes 512 cells.
    per_slot = 512 * odd_facts.layers * odd_facts.kv_heads * (48 * 2 + 48 * 2)  # f16: head_dim x 2 bytes, K and V
    assert frame.loc["f16", "bytes_per_slot"] == budget.kv_bytes("f16", 300) == per_slot
    assert frame.loc["q8_0", "note"] == budget.unusable("q8_0") and "multiples of 32" in frame.loc["q8_0", "note"]
    assert frame.loc["f16", "note"] == "" and budget.unusable("f16") is None
    with pytest.raises(ConfigurationError, match="multiples of 32"):
        kv_table(lease, kv_cache_type="q4_0")
    with pytest.raises(ConfigurationError, match="kv_cache_type must be one of"):
        kv_table(lease, kv_cache_type="q9")
    with pytest.raises(ConfigurationError, match="needs a lease with a model path, got FakeLease"):
        kv_table(FakeLease("session", facts=odd_facts))


def _attribute_reads(path: Path, names: set[str]):
    """(line, inside an f-string) of every ``x.__name__`` / ``x.__module__`` in a source file."""
    tree = ast.parse(path.read_text(), str(path))
    in_fstring = {id(n) for js in ast.walk(tree) if isinstance(js, ast.JoinedStr) for n in ast.walk(js)}
    return [(node.lineno, id(node) in in_fstring)
            for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in names]


def test_no_class_or_module_name_sniffing():
    found = {}
    for package in PACKAGES:
        for path in sorted(package.glob("*.py")):
            for line, in_message in _attribute_reads(path, {"__name__", "__module__"}):
                if not in_message:
                    found.setdefault(path.name, []).append(line)
    assert found == {}, f"__name__/__module__ read outside an error message: {found}"


def test_unload_finds_the_magics_in_the_registry_by_identity():
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell.instance(config=config)
    was_loaded = magics_pkg.extension_for(shell) is not None
    settings = shell.config.pop("LLMMagics", None)  # what other tests left in %config is not ours to load
    if not was_loaded:
        shell.run_line_magic("load_ext", "aner_nb")
    ext = magics_pkg.extension_for(shell)
    registry = shell.magics_manager.registry
    registry["an alias of ours"] = ext.magics  # whatever key it is under, it is ours
    registry["someone else's"] = other = object()
    try:
        shell.run_line_magic("unload_ext", "aner_nb")
        assert not any(value is ext.magics for value in registry.values())
        assert registry["someone else's"] is other
    finally:
        registry.pop("someone else's", None)
        if was_loaded:
            shell.run_line_magic("load_ext", "aner_nb")
        if settings is not None:
            shell.config["LLMMagics"] = settings

