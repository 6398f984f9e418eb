"""Fuzzing the adapter-manifest parser (issue 18): any text or file gets a manifest or an AdapterError.

``parse_manifest`` / ``read_manifest`` / ``resolve_adapter_file`` are fed
arbitrary JSON values, well-shaped manifests with one field replaced by
anything (wrong types, huge numbers, path traversal, unencodable names,
uppercase, short or non-hex digests), duplicate keys, deep nesting up to the
64 KiB size limit, non-UTF-8 and random bytes. Every call returns or raises
:class:`AdapterError` within a time bound, and whatever is accepted obeys the
manifest's rules (lowercase hexdigests, a plain file name inside the folder).
Hypothesis runs derandomized with fixed example counts.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aner_nb.llm.adapters import (
    MANIFEST_FIELDS,
    MAX_MANIFEST_BYTES,
    SCHEMA,
    AdapterManifest,
    parse_manifest,
    read_manifest,
    resolve_adapter_file,
)
from aner_nb.llm.errors import AdapterError
from fixtures.bounds import bounded

FUZZ = settings(
    max_examples=500, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
VALID = {
    "schema": SCHEMA, "base_sha256": "0123456789abcdef" * 4, "adapter_sha256": "f" * 64,
    "architecture": "llama", "adapter_file": "adapter.gguf",
}
HEX = re.compile(r"[0-9a-f]{64}")

json_scalars = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**80), max_value=2**80), st.text(max_size=80),
)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=12), inner, max_size=5)), max_leaves=20)
digests = st.one_of(
    st.text("0123456789abcdef", min_size=60, max_size=68),
    st.text("0123456789abcdefABCDEF", min_size=64, max_size=64),
    st.text("0123456789abcdefg \n-", min_size=64, max_size=66),
    st.just("a" * 64 + "\n"), st.just("A" * 64), st.just(""),
)
file_names = st.one_of(
    st.sampled_from(("..", ".", "../adapter.gguf", "a/b.gguf", "a\\b.gguf", "/etc/passwd", "x\x00.gguf",
                     "\ud800.gguf", "\udcff.gguf", "~/.ssh/id_rsa", "..\\..\\x", "x" * 300, " ", "\n")),
    st.text(max_size=40),
)


def check_parse(text: str | bytes) -> AdapterManifest | AdapterError:
    """The property: a well-formed manifest or an AdapterError naming a field, in bounded time."""
    manifest, error = bounded(parse_manifest, text)
    if error is not None:
        assert isinstance(error, AdapterError), f"parse_manifest raised {error!r}"
        assert error.field is not None, error
        return error
    assert isinstance(manifest, AdapterManifest) and manifest.schema == SCHEMA
    assert HEX.fullmatch(manifest.base_sha256) and HEX.fullmatch(manifest.adapter_sha256)
    name = manifest.adapter_file
    assert name and name not in (".", "..") and "/" not in name and "\\" not in name and "\x00" not in name
    os.fsencode(name)
    return manifest


@FUZZ
@given(value=json_values)
def test_any_json_value_is_a_manifest_or_an_adapter_error(value):
    result = check_parse(json.dumps(value))
    if isinstance(result, AdapterManifest):
        assert value == {**result.as_dict()}


@FUZZ
@given(field=st.sampled_from(MANIFEST_FIELDS), data=st.data())
def test_one_field_replaced_by_anything(field, data):
    strategy = {"base_sha256": st.one_of(digests, json_values), "adapter_sha256": st.one_of(digests, json_values),
                "adapter_file": st.one_of(file_names, json_values)}.get(field, json_values)
    value = data.draw(strategy)
    result = check_parse(json.dumps({**VALID, field: value}))
    if isinstance(result, AdapterError):
        assert result.field == field, result
    else:
        assert result.as_dict()[field] == value


@FUZZ
@given(fields=st.lists(st.sampled_from((*MANIFEST_FIELDS, "extra", "Schema", "")), max_size=8),
       values=st.lists(st.one_of(st.just("x"), json_scalars), min_size=8, max_size=8))
def test_missing_unknown_and_duplicate_fields(fields, values):
    pairs = [f"{json.dumps(k)}: {json.dumps(VALID.get(k, v))}" for k, v in zip(fields, values)]
    result = check_parse("{" + ", ".join(pairs) + "}")
    if len(set(fields)) != len(fields) or set(fields) != set(MANIFEST_FIELDS):
        assert isinstance(result, AdapterError)


@FUZZ
@given(raw=st.one_of(
    st.binary(max_size=300),
    st.builds(lambda cut, junk: json.dumps(VALID).encode()[:cut] + junk, st.integers(0, 300), st.binary(max_size=8)),
    st.sampled_from([json.dumps(VALID).encode(enc) for enc in ("utf-16", "utf-32", "utf-8-sig", "utf-16-be")]),
))
def test_arbitrary_bytes_never_crash(raw):
    check_parse(raw)


@pytest.mark.parametrize("text", [
    "[" * 100_000, "{\"a\":" * 20_000 + "1" + "}" * 20_000,           # deeper than the recursion limit
    "[" * (MAX_MANIFEST_BYTES // 2) + "]" * (MAX_MANIFEST_BYTES // 2),  # as deep as a 64 KiB file can be
    "1" * 5000, "-" + "9" * 4400, "1e999999", "[1e400, -1e400, NaN, Infinity]",  # numbers past the limits
    "\"\\ud800\"", "", " ", "null", "\x00", "{\"schema\": \"\\u0000\"}",
])
def test_hostile_texts(text):
    assert isinstance(check_parse(text), AdapterError)
    assert isinstance(check_parse(text.encode("utf-8", "surrogatepass")), AdapterError)


@pytest.mark.parametrize("value", [None, 1, 1.5, ["{}"], {"schema": SCHEMA}, object()])
def test_parse_manifest_of_a_non_text_is_an_adapter_error(value):
    with pytest.raises(AdapterError, match="JSON text"):
        parse_manifest(value)


def test_uppercase_digests_are_refused():
    """The audit's finding: a digest is hashlib's lowercase hexdigest, nothing else."""
    for field in ("base_sha256", "adapter_sha256"):
        for bad in ("A" * 64, VALID[field].upper(), "0" * 63 + "F", "a" * 64 + "\n"):
            with pytest.raises(AdapterError, match="64 hexadecimal characters, lowercase") as info:
                parse_manifest(json.dumps({**VALID, field: bad}))
            assert info.value.field == field


@pytest.mark.parametrize("name", ["\ud800.gguf", "a\udfffb"])
def test_unencodable_file_names_are_refused(name):
    """JSON may carry lone surrogates; before the fix they escaped as UnicodeEncodeError from os.stat."""
    with pytest.raises(AdapterError, match="cannot be a file name") as info:
        parse_manifest(json.dumps({**VALID, "adapter_file": name}))
    assert info.value.field == "adapter_file"


# --------------------------------------------------------------------------------- files


@FUZZ
@given(name=file_names, other=st.sampled_from(("", "sub", "outside")), data=st.data())
def test_read_and_resolve_keep_the_adapter_inside_the_folder(tmp_path_factory, name, other, data):
    """Whatever adapter_file names, the resolved path is a regular file inside the manifest's folder."""
    root = tmp_path_factory.mktemp("m")
    folder = root / "folder"
    folder.mkdir()
    (folder / "adapter.gguf").write_bytes(b"GGUF")
    (folder / "sub").mkdir()
    (root / "outside").write_bytes(b"GGUF")
    if data.draw(st.booleans()):  # a symlink in the folder, pointing inside or out
        os.symlink(root / other if other == "outside" else folder / (other or "adapter.gguf"), folder / "link")
    manifest_path = folder / "m.json"
    manifest_path.write_text(json.dumps({**VALID, "adapter_file": name}), encoding="utf-8")
    manifest, error = bounded(read_manifest, manifest_path)
    if error is not None:
        assert isinstance(error, AdapterError) and error.field is not None, repr(error)
        return
    resolved, error = bounded(resolve_adapter_file, manifest)
    if error is not None:
        assert isinstance(error, AdapterError) and error.field == "adapter_file", repr(error)
        return
    real_folder = os.path.realpath(folder)
    assert os.path.commonpath([real_folder, resolved]) == real_folder and os.path.isfile(resolved)


@FUZZ
@given(raw=st.one_of(st.binary(max_size=200), st.builds(
    lambda text, pos, byte: text[:pos] + bytes([byte]) + text[pos + 1:],
    st.just(json.dumps(VALID).encode()), st.integers(0, 250), st.integers(0, 255))))
def test_read_manifest_of_any_file(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("r") / "m.json"
    path.write_bytes(raw)
    manifest, error = bounded(read_manifest, path)
    assert error is None or isinstance(error, AdapterError), repr(error)
    if error is None:
        assert manifest.folder == os.path.realpath(path.parent)


def test_oversized_and_special_manifest_files(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * MAX_MANIFEST_BYTES + json.dumps(VALID).encode())
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, needle in ((big, "at most"), (fifo, "not a regular file"), (tmp_path, "not a regular file"),
                         (tmp_path / "missing.json", "not found")):
        _, error = bounded(read_manifest, path)
        assert isinstance(error, AdapterError) and needle in str(error), (path, error)
