"""Chat templates are untrusted code: known escape attempts, runaway work and hostile GGUF templates.

Every attempt must end in a ``ChatTemplateError`` within a time bound (the
render deadline plus slack, counted in CPU seconds of the rendering thread so
that a busy machine cannot fail it) and without producing unbounded output;
the process, the kernel and other leases keep working.
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
    t0 = time.thread_time()
    with pytest.raises(errors.ChatTemplateError):
        template.render(USER)
    assert time.thread_time() - t0 < BOUND_S  # CPU seconds of this thread, where the template runs


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


def test_an_interrupt_while_the_deadline_is_armed_leaves_no_deadline_behind(monkeypatch):
    from aner_nb.llm import deadline

    arm = deadline._WATCHDOG.arm

    def arm_then_interrupted(bound, seconds):  # Ctrl-C lands just after the deadline was armed
        arm(bound, seconds)
        raise KeyboardInterrupt

    monkeypatch.setattr(deadline._WATCHDOG, "arm", arm_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        within(0.1, lambda: None)
    monkeypatch.undo()
    time.sleep(0.4)  # a deadline left armed would raise DeadlineExceeded here, in this thread
    assert sum(range(10)) == 45


def _spin(seconds: float) -> str:
    """A pure-Python loop that gives up after ``seconds`` (so a deadline that never fires fails the test)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        pass
    return "not stopped"


def test_one_watchdog_thread_serves_every_deadline_and_an_earlier_one_wakes_it():
    import threading

    for _ in range(50):
        assert within(30.0, lambda: 1) == 1
    watchdogs = [t for t in threading.enumerate() if t.name == "aner-nb-deadlines"]
    assert len(watchdogs) == 1  # not a thread per call
    # The watchdog sleeps until the outer call's 60 s deadline; the inner, earlier one must wake it.
    with pytest.raises(DeadlineExceeded):
        within(60.0, lambda: within(0.2, lambda: _spin(20.0)))
    # Calls from several threads at once: each is stopped in its own thread, the others finish.
    results: dict[str, object] = {}

    def bounded(name: str, seconds: float, work) -> None:
        try:
            results[name] = within(seconds, work)
        except DeadlineExceeded:
            results[name] = "stopped"

    threads = [threading.Thread(target=bounded, args=("loop", 0.2, lambda: _spin(20.0))),
               threading.Thread(target=bounded, args=("quick", 30.0, lambda: sum(range(100))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"loop": "stopped", "quick": 4950}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX only")
def test_a_forked_child_bounds_its_own_calls():
    import threading

    assert within(5.0, lambda: 1) == 1  # the parent's watchdog thread runs
    assert any(t.name == "aner-nb-deadlines" for t in threading.enumerate())
    pid = os.fork()
    if pid == 0:  # the child: no watchdog thread was copied, and none of the parent's deadlines are its own
        code = 1
        try:
            within(0.2, lambda: _spin(20.0))
        except DeadlineExceeded:
            code = 0
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


HOSTILE = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"


def test_a_hostile_template_embedded_in_a_gguf_is_refused_at_load(tmp_path, llama_path):
    path = write_tiny_model(tmp_path / "hostile.gguf", chat_template=HOSTILE)
    t0 = time.thread_time()
    with pytest.raises(errors.ChatTemplateError, match="took longer than"):
        llm.load(path, context=256)
    assert time.thread_time() - t0 < BOUND_S + 2  # CPU seconds of this thread (hashing, rendering)
    with llm.load(llama_path, context=256) as model:  # the process is unharmed
        assert model.generate("hello", max_tokens=2).finish_reason in ("stop", "length")


def test_a_template_that_hangs_on_one_input_fails_that_request_only(llama_path):
    source = (
        "{% for m in messages %}{% if m.content == 'boom' %}"
        "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
        "{% endif %}<|user|>{{ m.content }}{% endfor %}<|assistant|>"
    )
    with llm.load(llama_path, context=256, chat_template=source) as model:
        t0 = time.thread_time()
        with pytest.raises(errors.ChatTemplateError, match="took longer than") as info:
            model.generate("boom", max_tokens=2)
        assert time.thread_time() - t0 < BOUND_S and info.value.param == "messages"  # this thread's CPU
        assert model.generate("fine", max_tokens=2).finish_reason in ("stop", "length")


# -- one C call that would allocate gigabytes: refused on sizes, before it runs -------------------------
BOMBS = {
    "percent width": "{{ '%999999999d' % 1 }}",
    "percent precision": "{{ '%.999999999f' % 1 }}",
    "percent star width": "{{ '%*d' % (999999999, 1) }}",
    "center": "{{ 'x'.center(10**9) }}",
    "ljust": "{{ 'x'.ljust(10**9) }}",
    "rjust": "{{ 'x'.rjust(10**9) }}",
    "zfill": "{{ 'x'.zfill(10**9) }}",
    "expandtabs": "{{ '\\t'.expandtabs(10**9) }}",
    "format width": "{{ '{:999999999}'.format(1) }}",
    "format nested width": "{{ '{:{w}}'.format(1, w=999999999) }}",
    "format_map width": "{{ '{x:999999999}'.format_map({'x': 1}) }}",
    "format many fields": "{{ ('{0:1000000}' * 1000).format(1) }}",
    "replace growth": "{{ ('x' * 1000000).replace('x', 'y' * 1000) }}",
    "replace empty": "{{ ('x' * 1000000).replace('', 'y' * 100) }}",
    "translate growth": "{{ ('x' * 1000000).translate({120: 'y' * 1000000}) }}",
    "join method": "{{ ''.join(['x' * 1000000] * 1000000) }}",
    "to_bytes": "{{ (7).to_bytes(10**9, 'big') }}",
    "bytes repeat": "{{ 'x'.encode() * 10**9 }}",
    "center filter": "{{ 'x' | center(10**9) }}",
    "indent filter": "{{ 'x' | indent(10**9) }}",
    "indent many lines": "{{ ('\\n' * 1000000) | indent(1000) }}",
    "wordwrap filter": "{{ ('a ' * 500000) | wordwrap(1, wrapstring='y' * 1000) }}",
    "replace filter": "{{ ('x' * 1000000) | replace('x', 'y' * 1000) }}",
    "format filter": "{{ '%999999999d' | format(1) }}",
    "join filter": "{{ (['x' * 1000000] * 1000000) | join }}",
    "batch filter": "{{ [1] | batch(10**9, 0) | list }}",
    "slice filter": "{{ [1] | slice(10**9) | list }}",
    "sum filter": "{{ ([['x'] * 1000000] * 1000000) | sum(start=[]) }}",
    "string filter": "{{ (['x' * 1000000] * 1000000) | string }}",
    "tojson filter": "{{ (['x' * 1000000] * 1000000) | tojson }}",
    "tojson indent": "{{ [[[[1]]]] | tojson(indent=10**9) }}",
    "output of a list": "{{ ['x' * 1000000] * 1000000 }}",
    "tilde of a list": "{{ '' ~ (['x' * 1000000] * 1000000) }}",
    "percent s of a list": "{{ '%s' % ((['x' * 1000000] * 1000000),) }}",
    "plus doubling": "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(30) %}"
                     "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
    "tilde doubling": "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(30) %}"
                      "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
}

_CHILD = r"""
import json, resource, sys
from aner_nb.llm import errors
from aner_nb.llm.chat import resolve_template
bombs = json.loads(sys.stdin.read())
user = [{"role": "user", "content": "hi"}]
resolve_template("{{ 'warm' | center(9) }}{{ '%5d' % 1 }}", None).render(user)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
for name, source in bombs.items():
    try:
        resolve_template(source, None).render(user)
        outcome = "rendered"
    except errors.ChatTemplateError:
        outcome = "refused"
    out[name] = [outcome, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024]
print(json.dumps(out))
"""


def test_every_single_call_bomb_is_refused_before_it_allocates():
    """Each bomb raises ChatTemplateError, and the child's peak RSS grows by under 64 MB over all of them
    (ru_maxrss is a peak, so the last figure bounds every bomb's growth)."""
    import json
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, "-c", _CHILD], input=json.dumps(BOMBS), capture_output=True, text=True, timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert child.returncode == 0, child.stderr[-2000:]
    results = json.loads(child.stdout)
    assert {name: r[0] for name, r in results.items()} == {name: "refused" for name in BOMBS}
    assert max(r[1] for r in results.values()) < 64, results


def test_ordinary_templates_still_render_with_the_bounded_operations():
    source = (
        "{{ '%-6s|%5.2f' % ('ab', 1.5) }} {{ '{:>4}'.format(7) }} {{ 'x'.center(5, '-') }} {{ 'a b' | replace(' ', '_') }}"
        " {{ ['a', 'b'] | join(', ') }} {{ 'l1\nl2' | indent(2) }} {{ [1, 2, 3] | batch(2) | list }}"
        " {{ [[1], [2]] | sum(start=[]) }} {{ messages | tojson }} {{ 'a' ~ 1 ~ none }} {{ 'ab' + 'c' }}"
    )
    text = resolve_template(source, None).render(USER)
    assert text == (
        "ab    | 1.50    7 --x-- a_b a, b l1\n  l2 [[1, 2], [3]] [1, 2] "
        '[{"role": "user", "content": "hi"}] a1None abc'
    )
    big = [{"role": "user", "content": "y" * (2 << 20)}]  # a 2 MiB message passes through trim, join and ~
    long = "{{ (messages | map(attribute='content') | join('\n')) | trim ~ '!' }}"
    assert len(resolve_template(long, None).render(big)) == (2 << 20) + 1


def test_an_embedded_single_call_bomb_is_refused_at_load(tmp_path, llama_path):
    path = write_tiny_model(tmp_path / "bomb.gguf", chat_template="{{ '%999999999d' % 1 }}")
    with pytest.raises(errors.ChatTemplateError, match="width or precision"):
        llm.load(path, context=256)
    with llm.load(llama_path, context=256) as model:  # the process is alive and unharmed
        assert model.generate("hello", max_tokens=2).finish_reason in ("stop", "length")
