"""The uvicorn internals ``aner_nb/api/edges.py`` builds on, checked so that a change fails here, loudly.

``EdgeProtocol`` subclasses ``uvicorn.protocols.http.h11_impl.H11Protocol``
(uvicorn has no public hook for read deadlines, lingering closes, JSON
framing errors or connection slots). ``pyproject.toml`` pins uvicorn and h11
to the tested ranges; these tests fail with a message saying what to do when
the installed versions are outside them or the internals changed shape. h11
is used through its public API only, and no module of ``aner_nb.api``
imports a private module.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import tomllib
from importlib import metadata
from pathlib import Path

import h11
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import aner_nb.api
from aner_nb.api import edges

ROOT = Path(__file__).resolve().parents[1]
ADVICE = ("aner_nb/api/edges.py subclasses uvicorn's internal H11Protocol: run tests/test_api_edges.py, "
          "tests/test_api_flood.py and this file against the new version, adapt edges.py, then widen the "
          "pin in pyproject.toml")


def _pins() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(text) for text in project["dependencies"]]
    return {r.name: r for r in requirements if r.name in ("uvicorn", "h11")}


@pytest.mark.parametrize("package", ["uvicorn", "h11"])
def test_installed_versions_are_in_the_tested_range(package):
    pins = _pins()
    assert package in pins, f"pyproject.toml must pin {package} to a tested range ({ADVICE})"
    spec = pins[package].specifier
    assert any(s.operator in ("<", "<=", "==", "~=") for s in spec), \
        f"the {package} pin {spec} has no upper bound; {ADVICE}"
    installed = Version(metadata.version(package))
    assert spec.contains(installed), (f"{package} {installed} is installed, outside the tested range {spec}. "
                                      f"{ADVICE}")


def test_no_private_imports_in_the_api_package():
    private = re.compile(r"^\s*(from|import)\s+(h11|uvicorn|starlette|fastapi)(\.\w+)*\._", re.M)
    for path in Path(aner_nb.api.__file__).parent.glob("*.py"):
        found = private.search(path.read_text())
        assert found is None, f"{path.name} imports a private module: {found.group(0).strip()}"


def test_the_h11_protocol_has_the_shape_edge_protocol_overrides():
    from uvicorn.protocols.http import h11_impl

    base = h11_impl.H11Protocol
    expected = {"connection_made": ["transport"], "connection_lost": ["exc"], "data_received": ["data"],
                "handle_events": [], "on_response_complete": [], "shutdown": [], "send_400_response": ["msg"]}
    assert set(expected) == set(edges.UVICORN_HOOKS["methods"])
    for name, params in expected.items():
        method = getattr(base, name, None)
        assert callable(method), f"uvicorn's H11Protocol has no method {name}; {ADVICE}"
        assert list(inspect.signature(method).parameters)[1:] == params, \
            f"uvicorn's H11Protocol.{name} now takes {inspect.signature(method)}; {ADVICE}"
    events = inspect.getsource(base.handle_events)
    assert "self.send_400_response(" in events and "RequestResponseCycle(" in events, \
        f"uvicorn's H11Protocol.handle_events no longer answers framing errors or builds cycles as expected; {ADVICE}"
    assert "on_response=self.on_response_complete" in events, f"on_response_complete is no longer the hook; {ADVICE}"
    cycle = inspect.getsource(h11_impl.RequestResponseCycle)
    assert "self.response_complete = True" in cycle, f"RequestResponseCycle.response_complete changed; {ADVICE}"
    assert "limit_concurrency" in inspect.getsource(base.handle_events)


def test_an_edge_protocol_instance_has_the_attributes_it_uses():
    import uvicorn
    from uvicorn.server import ServerState

    async def app(scope, receive, send):  # pragma: no cover - never called
        pass

    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(app, loop="asyncio", ws="none", lifespan="off")
        protocol = edges.edge_protocol(header_timeout_s=1, body_timeout_s=1)(config, ServerState(), {}, _loop=loop)
    finally:
        loop.close()
    for name in edges.UVICORN_HOOKS["attributes"]:
        assert hasattr(protocol, name), f"uvicorn's H11Protocol instances have no attribute {name}; {ADVICE}"
    assert isinstance(protocol.conn, h11.Connection) and protocol.cycle is None
    assert isinstance(protocol.connections, set)


def test_h11_public_api_used_by_edges():
    assert "max_incomplete_event_size" in inspect.signature(h11.Connection).parameters
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=edges.MAX_HEAD_BYTES)
    conn.receive_data(b"GET / HTTP/1.1\r\n")
    assert conn.next_event() is h11.NEED_DATA and conn.trailing_data[0] == b"GET / HTTP/1.1\r\n"
    conn.receive_data(b"x" * (edges.MAX_HEAD_BYTES + 1))
    with pytest.raises(h11.RemoteProtocolError) as caught:
        conn.next_event()
    assert caught.value.error_status_hint == 431
