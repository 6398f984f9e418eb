"""The main job on the real demo model (installed by the ``demo`` extra): it runs and measures.

The demo package is a declared test dependency (``.[test,demo]``); without it
these tests fail with an install hint rather than skipping.
"""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from aner_nb import llm
from aner_nb.demo_model import DEMO_CHAT_TEMPLATE, demo_model_path
from aner_nb.demo import run_demo

pytestmark = pytest.mark.demo


@pytest.fixture(scope="module")
def demo_path():
    return demo_model_path()


def test_demo_model_is_admitted_as_gemma3(demo_path):
    facts = llm.inspect_model(demo_path)
    assert facts.architecture == "gemma3"
    assert facts.chat_template is None  # a base model: the Gemma template is passed explicitly
    assert facts.sliding_window > 0
    with pytest.raises(llm.errors.ChatTemplateError, match="no embedded chat template"):
        llm.load(demo_path, context=512)


def test_run_demo_streams_and_reports(demo_path):
    out = io.StringIO()
    response = run_demo("Say hello.", max_tokens=8, context=512, out=out)
    text = out.getvalue()
    assert response.usage.completion_tokens >= 1
    assert response.text in text
    assert "prompt_eval_duration" in text and "fingerprint" in text and "kv_bytes" in text
    assert response.timings.prompt_tokens > 0


def test_gemma_template_prompt_starts_with_a_single_bos(demo_path):
    with llm.load(demo_path, context=512, chat_template=DEMO_CHAT_TEMPLATE) as model:
        tokens = model.prompt_tokens("hi")
        bos = model._weights.native.bos
        assert tokens[0] == bos and tokens[1] != bos


def test_cli_entry_point_runs(demo_path):
    proc = subprocess.run(
        [sys.executable, "-m", "aner_nb", "demo", "--max-tokens", "4", "--context", "512"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "timings" in proc.stdout and "memory" in proc.stdout


DEMO_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "weather": {"enum": ["sunny", "rainy", "cloudy"]},
        "days": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"day": {"enum": ["mon", "tue", "wed"]}, "warm": {"type": "boolean"}},
                "required": ["day", "warm"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["city", "weather", "days"],
    "additionalProperties": False,
}


def test_structured_output_on_the_demo_model_always_validates(demo_path):
    """20 seeded requests on an ordinary lease and 4 concurrent ones on a batching lease: all parse and validate."""
    import json

    import jsonschema

    prompt = "A weather report as JSON:\n"
    with llm.load(demo_path, context=1024, chat_template=DEMO_CHAT_TEMPLATE) as model:
        for seed in range(20):
            r = model.complete(prompt, max_tokens=160, json_schema=DEMO_SCHEMA, temperature=0.8, seed=seed)
            assert r.finish_reason == "stop", r.text
            jsonschema.validate(json.loads(r.text), DEMO_SCHEMA)
        with model.with_batching(4) as serving:
            prompts = [f"Report {i} for a city you like, as JSON." for i in range(4)]
            many = serving.generate_many(prompts, max_tokens=160, json_schema=DEMO_SCHEMA, temperature=0.8, seed=3)
        for r in many:
            assert r.finish_reason == "stop", r.text
            jsonschema.validate(json.loads(r.text), DEMO_SCHEMA)
