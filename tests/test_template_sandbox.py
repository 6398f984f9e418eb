"""Chat templates are untrusted code: known escape attempts, runaway work and hostile GGUF templates.

Every attempt must end in a ``ChatTemplateError`` within a time bound (the
render deadline plus slack) and without producing unbounded output; the
process, the kernel and other leases keep working.
"""

from __future__ import annotations

import os
import time

import pytest

from aner_nb import llm
from aner_nb.llm import errors
from aner_nb.llm.chat import MAX_RENDER_CHARS, RENDER_SECONDS, resolve_template
from aner_nb.llm.deadline import DeadlineExceeded, within
from fixtures.models import write_tiny_model

USER = [{"role": "user", "content": "hi"}]
BOUND_S = RENDER_SECONDS + 1.5

ESCAPES = {
    # attribute walks towards globals, builtins and subclasses
    "mro walk": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "tuple subclasses": "{{ ().__class__.__base__.__subclasses__() }}",
    "cycler globals": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "joiner globals": "{{ joiner.__init__.__globals__ }}",
    "namespace globals": "{% set ns = namespace(a=1) %}{{ ns.__init__.__globals__ }}",
    "self globals": "{{ self.__init__.__globals__ }}",
    "raise_exception globals": "{{ raise_exception.__globals__['__builtins__'] }}",
    "strftime globals": "{{ strftime_now.__globals__ }}",
    "attr filter": "{{ messages | attr('__class__') }}",
    "getattr via format": "{{ '{0.__class__.__init__.__globals__}'.format(cycler) }}",
    "format_map": "{{ '{x.__class__}'.format_map({'x': messages}) }}",
    # files, environment, network
    "open": "{{ open('/etc/passwd').read() }}",
    "include": "{% include '/etc/passwd' %}",
    "import": "{% import 'os' as os %}",
    "environ": "{{ environ['HOME'] }}",
    "urllib": "{{ urllib.request.urlopen('http://127.0.0.1') }}",
    # runaway work
    "huge range": "{% for i in range(10**9) %}{% endfor %}",
    "nested loops": "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}",
    "deep recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "huge repeat": "{{ 'x' * 10**9 }}",
    "huge power": "{{ 7 ** 9999999 }}",  # Jinja's ** is left-associative: one big exponent
    "huge output": "{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}",
    "mutation": "{{ messages.append(messages) }}",
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_each_escape_attempt_is_refused_within_a_time_bound(name):
    template = resolve_template(ESCAPES[name], None)
    t0 = time.monotonic()
    with pytest.raises(errors.ChatTemplateError):
        template.render(USER)
    assert time.monotonic() - t0 < BOUND_S


def test_a_template_reads_no_secret_from_files_or_the_environment(monkeypatch):
    monkeypatch.setenv("ANER_NB_SECRET", "s3cr3t-value")
    probes = ["{{ ANER_NB_SECRET }}", "{{ env }}", "{{ config }}", "{{ request }}", "{{ self }}", "{{ lipsum }}",
              "{{ __builtins__ }}", "{{ globals }}", "{{ os }}"]
    for source in probes:
        try:
            text = resolve_template(source, None).render(USER)
        except errors.ChatTemplateError:
            continue
        assert "s3cr3t-value" not in text and "root:" not in text and os.environ["HOME"] not in text


def test_the_deadline_stops_only_the_call_it_bounds():
    with pytest.raises(DeadlineExceeded):
        within(0.2, lambda: [None for _ in iter(int, 1)])  # an endless pure-Python loop
    assert within(5.0, lambda: sum(range(1000))) == 499500  # a call that ends first is untouched
    time.sleep(0.3)  # no late exception lands after within() returned
    assert MAX_RENDER_CHARS >= 1 << 20


HOSTILE = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"


def test_a_hostile_template_embedded_in_a_gguf_is_refused_at_load(tmp_path, llama_path):
    path = write_tiny_model(tmp_path / "hostile.gguf", chat_template=HOSTILE)
    t0 = time.monotonic()
    with pytest.raises(errors.ChatTemplateError, match="took longer than"):
        llm.load(path, context=256)
    assert time.monotonic() - t0 < BOUND_S + 2
    with llm.load(llama_path, context=256) as model:  # the process is unharmed
        assert model.generate("hello", max_tokens=2).finish_reason in ("stop", "length")


def test_a_template_that_hangs_on_one_input_fails_that_request_only(llama_path):
    source = (
        "{% for m in messages %}{% if m.content == 'boom' %}"
        "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
        "{% endif %}<|user|>{{ m.content }}{% endfor %}<|assistant|>"
    )
    with llm.load(llama_path, context=256, chat_template=source) as model:
        t0 = time.monotonic()
        with pytest.raises(errors.ChatTemplateError, match="took longer than") as info:
            model.generate("boom", max_tokens=2)
        assert time.monotonic() - t0 < BOUND_S and info.value.param == "messages"
        assert model.generate("fine", max_tokens=2).finish_reason in ("stop", "length")
