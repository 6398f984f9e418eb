"""Source checks of the HTTP service: short functions, one route declaration, no name sniffing.

These read the source (``ast``) and build applications without serving or
loading a model, so they run in milliseconds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "aner_nb"
MAX_FUNCTION_LINES = 60


def _functions(path: Path) -> list[tuple[str, int]]:
    """(name:line, length) of every function in ``path``, nested ones included; length is def line to last line."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        (f"{node.name}:{node.lineno}", node.end_lineno - node.lineno + 1)  # type: ignore[operator]
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


@pytest.mark.parametrize("module", ["api/service.py", "llm/scheduler.py"])
def test_every_function_is_shorter_than_60_lines(module):
    long = [(name, n) for name, n in _functions(ROOT / module) if n >= MAX_FUNCTION_LINES]
    assert not long, f"{module}: functions of {MAX_FUNCTION_LINES} lines or more: {long}"


def test_the_service_never_sniffs_class_or_module_names():
    for path in sorted((ROOT / "api").glob("*.py")):
        # A module's command-line entry (``if __name__ == "__main__":``) names no class or lease.
        source = path.read_text(encoding="utf-8").replace('if __name__ == "__main__":', "")
        for needle in ("__name__ ==", "__module__", "__qualname__", '"Session"', '"BatchingModel"', '"LLMModel"'):
            assert needle not in source, f"{path.name} checks a name ({needle}); use Lease.kind / supports()"


def test_library_errors_are_mapped_by_their_param_not_their_message():
    from aner_nb.api.errors import from_library, request_param
    from aner_nb.llm.errors import ContextOverflowError, InvalidRequestError

    seed = {"prompt", "max_tokens", "temperature", "seed", "stop"}
    openai = {"model", "messages", "max_tokens", "temperature", "seed", "stop", "stream", "n"}
    assert request_param("stop[0]", seed, "prompt") == "stop[0]"
    assert request_param("messages[2].role", openai, "messages") == "messages[2].role"
    assert request_param("messages[0].content", seed, "prompt") == "prompt"
    assert request_param("context", seed, "prompt") is None  # not a field of the route
    assert request_param(None, seed, "prompt") is None
    misleading = InvalidRequestError("seed is what the message starts with", param="temperature")
    assert from_library(misleading, fields=seed, prompt_field="prompt").param == "temperature"
    overflow = from_library(ContextOverflowError("too long", param="max_tokens"), fields=seed, prompt_field="prompt")
    assert (overflow.status, overflow.param, overflow.code) == (400, "prompt", "context_length_exceeded")


def test_routes_are_declared_once_and_registered_as_declared():
    from fastapi.routing import APIRoute

    from aner_nb.api import routes as declared
    from aner_nb.api import service

    app = service.build_app(service.ServiceConfig(title="t", mounts=()))
    registered = {(next(iter(r.methods)), r.path): r for r in app.routes if isinstance(r, APIRoute)}
    for route in declared.ROUTES:
        if route.builtin:
            continue
        api_route = registered.pop((route.method, route.path))
        assert api_route.name == route.name and api_route.response_model is route.response_model
    assert not registered, f"routes registered but not declared in aner_nb.api.routes: {sorted(registered)}"
    assert declared.OPEN_PATHS == {"/health", "/openapi.json"}
    assert {"/v1", "/health", "/metrics", "/openapi.json"} <= set(declared.RESERVED)


def test_openapi_publishes_what_the_routes_return():
    from aner_nb.api import service

    app = service.build_app(service.ServiceConfig(title="t", mounts=(), bearer_token="t" * 12))
    schema = app.openapi()
    components = schema["components"]["schemas"]
    completions = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert completions["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    assert completions["text/event-stream"]["schema"]["$ref"].endswith("/ChatCompletionChunk")
    for name in ("ChatCompletionChunk", "ChunkChoice", "ChunkDelta", "Timings", "Health", "ModelList"):
        assert name in components, name
    assert "security" not in schema["paths"]["/health"]["get"]
    assert schema["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]


def test_a_non_lease_is_refused():
    from aner_nb import api
    from aner_nb.llm.errors import ConfigurationError

    class LooksLikeALease:  # every attribute a lease has, but not a Lease
        closed = False
        name = "fake"

        def stream(self, *args, **kwargs):
            raise AssertionError("never called")

        def supports(self, feature):
            return True

    with pytest.raises(ConfigurationError, match="must be a lease"):
        api.app("t").llm(path="/chat", model=LooksLikeALease())
