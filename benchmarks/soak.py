"""Soak: mixed HTTP load on the batching service for minutes, watching the server for leaks.

One ``aner-nb serve`` process (a batching lease, ``--max-sequences 4``, a
queue of 8, one engine thread) serves a tiny fixture model written into a
temporary directory (the suite's ``tests/fixtures/models.py`` writer), so the
script runs standalone and downloads nothing. ``--clients`` (default 8)
client threads run a fixed mix until ``--minutes`` are up:

- ``chat``: non-streaming ``/v1/chat/completions`` or ``/v1/completions`` or ``/chat``; the answer must be
  complete JSON;
- ``stream``: streaming chat; the stream must end with ``data: [DONE]``;
- ``cancel``: streaming chat, the client closes the connection after the first text piece;
- ``disconnect``: non-streaming chat with a client read timeout of a few milliseconds (the client leaves
  while the request is queued or decoding; a fast answer may still arrive);
- ``bad``: malformed JSON, wrong types, out-of-range or unknown fields, an unknown path; each must be a 4xx;
- ``burst``: more concurrent streaming requests than the service admits (sequences + queue), so some
  are refused with the documented busy ``503`` + ``Retry-After`` (docs/deploy.md); the rest must complete.

Every ``--interval`` seconds (10) the clients pause between requests and
close their connections; once the server has no request in flight the
sampler records the server process's RSS, threads and open file
descriptors (psutil) and, from ``/metrics``, the live llama.cpp contexts on
the served weights (``aner_native_contexts``) and the in-flight, queue and
active-sequence gauges. Sampling the quiet server makes samples comparable:
a sample taken mid-burst would count the burst's sockets and worker threads.

Growth per resource: the warm-up is the first 20% of the run, at least one
minute; ``baseline`` is the largest warm-up sample (the working set the
service settled on), ``final`` the largest sample of the last 10% (at least
three samples); growth = (final - baseline) / baseline.

Verdict (exit status 1 when any fails): every growth < ``--max-growth`` (5%);
no 5xx answer other than the busy 503; every accepted (200) request not
deliberately abandoned answered completely; the server idle (nothing in
flight, queued or active) at every sample; the server's own request count
equal to what the clients sent; the server exits cleanly on SIGTERM. The
server's ERROR log lines are counted in the manifest, not judged.

``--model`` takes ``smollm2`` (SmolLM2-135M-Instruct), ``gemma`` (Gemma 3 270M, served
with the ``gemma`` template) or a GGUF path (see ``_models.py``); the default stays the tiny
fixture, because the soak judges the service's resources, not a model, and runs in CI.

Run: ``python benchmarks/soak.py`` (30 minutes) or ``--minutes 3`` (the CI
short mode, ``tests/test_soak.py``); ``--json manifest.json`` writes the
environment, settings, counts per request kind, the status-code histogram,
every sample and the verdict.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from aner_nb.bench import harness
from aner_nb.llm.artifact import sha256_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import ModelChoice, header, manifest_fields, resolve  # noqa: E402
from _workloads import TOPICS  # noqa: E402
from bench_http import start_server  # noqa: E402 - the same server start as the HTTP benchmark

KINDS = ("chat", "stream", "cancel", "disconnect", "bad", "burst")
# Share of each kind in a client's mix. A burst runs at most once per --burst-every seconds across all
# clients (a client whose draw is a burst sends a chat instead): each one refuses most other clients' requests
# while it lasts.
WEIGHTS = {"chat": 30, "stream": 30, "cancel": 12, "disconnect": 8, "bad": 15, "burst": 5}
RESOURCES = ("rss_bytes", "threads", "fds", "native_contexts")
PROMPTS = TOPICS[:5]  # the first five of the serving benchmarks' questions
CHAT_PATH = "/v1/chat/completions"


def _messages(rng: random.Random) -> list[dict[str, str]]:
    return [{"role": "user", "content": rng.choice(PROMPTS)}]


# Malformed or invalid requests: (method, path, json body or raw bytes). Each must be answered 4xx.
def _bad_requests() -> list[tuple[str, str, Any]]:
    msgs = [{"role": "user", "content": "hi"}]
    return [
        ("POST", CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"'),  # truncated JSON
        ("POST", CHAT_PATH, b"not json at all"),
        ("POST", CHAT_PATH, {"messages": "hi"}),  # wrong type
        ("POST", CHAT_PATH, {"messages": []}),  # empty conversation
        ("POST", CHAT_PATH, {"messages": msgs, "temperature": 7}),  # out of range
        ("POST", CHAT_PATH, {"messages": msgs, "max_tokens": -3}),
        ("POST", CHAT_PATH, {"messages": msgs, "frobnicate": True}),  # unknown field
        ("POST", CHAT_PATH, {"messages": [{"role": "wizard", "content": "hi"}]}),
        ("POST", "/v1/completions", {"prompt": 42}),
        ("POST", "/chat", {"prompt": "hi", "max_tokens": "many"}),
        ("GET", "/v1/no-such-route", None),
        ("GET", "/v1/models/no-such-model", None),
    ]


class Tally:
    """Thread-safe counts: requests per kind, status codes per kind, and failures (with examples)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kinds: collections.Counter[str] = collections.Counter()
        self.statuses: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in KINDS}
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, str] = {}
        self.sent = 0  # HTTP requests sent to the server (scrapes excluded)

    def status(self, kind: str, code: int | str) -> None:
        with self.lock:
            self.statuses[kind][str(code)] += 1

    def outcome(self, name: str) -> None:
        with self.lock:
            self.outcomes[name] += 1

    def fail(self, name: str, detail: str) -> None:
        with self.lock:
            self.failures[name] += 1
            self.examples.setdefault(name, detail[:400])

    def sending(self, n: int = 1) -> None:
        with self.lock:
            self.sent += n


class Pause:
    """Lets the sampler stop the clients between requests and wait until all of them are idle."""

    def __init__(self, clients: int) -> None:
        self.cond = threading.Condition()
        self.requested = False
        self.idle = 0
        self.clients = clients

    def checkpoint(self, close_connections: Any) -> None:
        """Called by a client between requests: block while a pause is requested."""
        with self.cond:
            if not self.requested:
                return
            close_connections()
            self.idle += 1
            self.cond.notify_all()
            while self.requested:
                self.cond.wait()
            self.idle -= 1

    def hold(self, timeout: float) -> bool:
        with self.cond:
            self.requested = True
            return self.cond.wait_for(lambda: self.idle >= self.clients, timeout=timeout)

    def release(self) -> None:
        with self.cond:
            self.requested = False
            self.cond.notify_all()

    def leave(self) -> None:
        """A client that stopped for good counts as idle from now on."""
        with self.cond:
            self.idle += 1
            self.cond.notify_all()


class Soak:
    def __init__(self, url: str, args: argparse.Namespace, capacity: int) -> None:
        self.url = url
        self.args = args
        self.capacity = capacity
        self.tally = Tally()
        self.burst_lock = threading.Lock()
        self.next_burst = 0.0
        self.stop = threading.Event()

    # -- request kinds ----------------------------------------------------------------------------
    def chat(self, client: httpx.Client, rng: random.Random) -> None:
        n = rng.randint(2, self.args.max_tokens // 2)
        route = rng.choice([CHAT_PATH, CHAT_PATH, "/v1/completions", "/chat"])
        body: dict[str, Any] = {"max_tokens": n, "temperature": 0}
        if route == CHAT_PATH:
            body["messages"] = _messages(rng)
        else:
            body["prompt"] = rng.choice(PROMPTS)
        self.tally.sending()
        r = client.post(route, json=body)
        self.tally.status("chat", r.status_code)
        if r.status_code == 200:
            try:
                data = r.json()
                complete = "choices" in data if route != "/chat" else "text" in data
            except ValueError:
                complete = False
            if not complete:
                self.tally.fail("accepted_unanswered", f"chat {route}: {r.text[:200]}")
        else:
            self._refused("chat", r)

    def stream(self, client: httpx.Client, rng: random.Random, *, kind: str = "stream", cancel: bool = False,
               max_tokens: int | None = None) -> None:
        body = {"messages": _messages(rng), "max_tokens": max_tokens or rng.randint(2, self.args.max_tokens),
                "temperature": 0.7, "seed": rng.randint(0, 2**31), "stream": True}
        self.tally.sending()
        with client.stream("POST", CHAT_PATH, json=body) as r:
            self.tally.status(kind, r.status_code)
            if r.status_code != 200:
                r.read()
                self._refused(kind, r)
                return
            done = False
            for line in r.iter_lines():
                if cancel and line.startswith("data: {"):
                    self.tally.outcome("cancelled_mid_stream")
                    return  # leaving the block closes the connection: the server sees the disconnect
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {") and '"error"' in line[:20]:
                    self.tally.fail("stream_error_event", line)
            if cancel:
                self.tally.outcome("cancel_finished_first")  # no text piece before the end: nothing to cancel
            elif not done:
                self.tally.fail("accepted_unanswered", f"{kind}: stream ended without [DONE]")

    def disconnect(self, client: httpx.Client, rng: random.Random) -> None:
        body = {"messages": _messages(rng), "max_tokens": self.args.max_tokens, "temperature": 0}
        timeout = httpx.Timeout(30.0, read=rng.uniform(0.002, 0.03))
        self.tally.sending()
        try:
            r = client.post(CHAT_PATH, json=body, timeout=timeout)
        except httpx.ReadTimeout:
            self.tally.status("disconnect", "client_left")
            self.tally.outcome("left_before_answer")
            return
        self.tally.status("disconnect", r.status_code)
        if r.status_code == 200:
            self.tally.outcome("answered_before_leaving")
        else:
            self._refused("disconnect", r)

    def bad(self, client: httpx.Client, rng: random.Random) -> None:
        method, path, body = rng.choice(_bad_requests())
        self.tally.sending()
        if isinstance(body, bytes):
            r = client.request(method, path, content=body, headers={"content-type": "application/json"})
        else:
            r = client.request(method, path, json=body)
        self.tally.status("bad", r.status_code)
        if not 400 <= r.status_code < 500:
            self.tally.fail("bad_request_not_4xx", f"{method} {path} {body!r:.100} -> {r.status_code} {r.text[:200]}")

    def burst(self, rng: random.Random) -> bool:
        """Capacity + 8 streams at once from fresh connections; False when another burst ran too recently."""
        if not self.burst_lock.acquire(blocking=False):
            return False
        try:
            if time.monotonic() < self.next_burst:
                return False
            self.next_burst = time.monotonic() + self.args.burst_every
            n = self.capacity + 8
            seeds = [rng.randint(0, 2**31) for _ in range(n)]
            start = threading.Barrier(n)
            limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
            with httpx.Client(base_url=self.url, timeout=60, limits=limits) as client:
                def one(i: int) -> None:
                    try:
                        start.wait(timeout=30)
                        self.stream(client, random.Random(seeds[i]), kind="burst", max_tokens=self.args.max_tokens)
                    except Exception as exc:  # noqa: BLE001 - every failure is tallied
                        self.tally.fail("client_error", f"burst: {type(exc).__name__}: {exc}")

                threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            return True
        finally:
            self.burst_lock.release()

    def _refused(self, kind: str, r: httpx.Response) -> None:
        if r.status_code == 503:
            busy = "retry-after" in r.headers
            self.tally.outcome("busy_503" if busy else "unavailable_503")
            if not busy:
                self.tally.fail("503_not_busy", f"{kind}: {r.text[:200]}")
        elif r.status_code >= 500:
            self.tally.fail("5xx", f"{kind}: {r.status_code} {r.text[:200]}")
        else:
            self.tally.fail("unexpected_status", f"{kind}: {r.status_code} {r.text[:200]}")

    # -- clients ---------------------------------------------------------------------------------
    def client(self, index: int, pause: Pause, deadline: float) -> None:
        rng = random.Random(1000 + index)
        kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
        state = {"client": httpx.Client(base_url=self.url, timeout=60)}

        def close_connections() -> None:
            state["client"].close()
            state["client"] = httpx.Client(base_url=self.url, timeout=60)

        first = index == 0  # one burst first: the worker threads reach their high-water mark in the warm-up
        try:
            while time.monotonic() < deadline and not self.stop.is_set():
                pause.checkpoint(close_connections)
                kind = "burst" if first else rng.choices(kinds, weights)[0]
                first = False
                client = state["client"]
                try:
                    if kind == "burst":
                        if not self.burst(rng):
                            kind = "chat"
                            self.chat(client, rng)
                    elif kind == "chat":
                        self.chat(client, rng)
                    elif kind == "stream":
                        self.stream(client, rng)
                    elif kind == "cancel":
                        self.stream(client, rng, kind="cancel", cancel=True)
                    elif kind == "disconnect":
                        self.disconnect(client, rng)
                    else:
                        self.bad(client, rng)
                except Exception as exc:  # noqa: BLE001 - every failure is tallied
                    self.tally.fail("client_error", f"{kind}: {type(exc).__name__}: {exc}")
                    close_connections()
                with self.tally.lock:
                    self.tally.kinds[kind] += 1
        finally:
            state["client"].close()
            pause.leave()


# -- sampling ---------------------------------------------------------------------------------------
def scrape(url: str) -> dict[str, float]:
    """The gauges the soak watches, summed over models: native contexts, in flight, queue, active."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    wanted = {"aner_native_contexts": "native_contexts", "aner_http_in_flight": "in_flight",
              "aner_queue_length": "queue_length", "aner_active_sequences": "active_sequences"}
    out = {v: 0.0 for v in wanted.values()}
    requests: collections.Counter[str] = collections.Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                out[wanted[s.name]] += s.value
            elif s.name == "aner_http_requests_total":
                requests[f"{s.labels['route']} {s.labels['code']}"] += int(s.value)
    out["server_requests"] = dict(requests)  # type: ignore[assignment]
    return out


def sample(proc: psutil.Process, url: str, t0: float) -> dict[str, Any]:
    # The server closes the clients' sockets and finishes abandoned requests asynchronously: wait for quiet.
    deadline = time.monotonic() + 10
    while True:
        gauges = scrape(url)
        quiet = gauges["in_flight"] == 0 and gauges["queue_length"] == 0 and gauges["active_sequences"] == 0
        sockets = len(proc.net_connections(kind="inet"))
        if (quiet and sockets <= 2) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    with proc.oneshot():
        mem, threads, fds = proc.memory_info(), proc.num_threads(), proc.num_fds()
    requests = gauges.pop("server_requests")
    return {"t_s": round(time.monotonic() - t0, 1), "rss_bytes": mem.rss, "threads": threads, "fds": fds,
            "sockets": sockets, "idle": quiet, **{k: int(v) for k, v in gauges.items()},
            "server_requests": requests}


def growth(samples: list[dict[str, Any]], warmup_s: float, duration_s: float) -> dict[str, dict[str, float]]:
    """Per resource: baseline (largest warm-up sample), final (largest of the last 10%), relative growth."""
    warm = [s for s in samples if s["t_s"] <= warmup_s] or samples[:1]
    after = [s for s in samples if s["t_s"] > warmup_s]
    tail_from = duration_s * 0.9
    tail = [s for s in after if s["t_s"] >= tail_from]
    if len(tail) < 3:
        tail = after[-3:]
    out = {}
    for key in RESOURCES:
        base = max(s[key] for s in warm)
        final = max(s[key] for s in tail) if tail else float("nan")
        rel = (final - base) / base if base else (0.0 if final == 0 else float("inf"))
        out[key] = {"baseline": base, "final": final, "growth": rel,
                    "min_after_warmup": min((s[key] for s in after), default=float("nan")),
                    "max_after_warmup": max((s[key] for s in after), default=float("nan"))}
    return out


# -- the server ---------------------------------------------------------------------------------
def write_fixture(directory: Path) -> Path:
    """The suite's tiny llama-family GGUF (ChatML template), written the way ``tests/conftest.py`` does."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from fixtures.models import write_tiny_model

    return write_tiny_model(directory / "soak-llama.gguf", "llama")


def run(args: argparse.Namespace) -> dict[str, Any]:
    duration = args.minutes * 60
    warmup = min(max(0.2 * duration, 60.0), 0.5 * duration)
    with tempfile.TemporaryDirectory(prefix="aner-soak-") as tmp:
        if args.model is None:
            args.model = write_fixture(Path(tmp))
            args.model_choice = ModelChoice("fixture", "tiny llama fixture", str(args.model), None)
        else:
            args.model_choice = resolve(str(args.model))
            args.model, args.chat_template = args.model_choice.path, args.model_choice.chat_template
        args.model_sha256 = sha256_file(str(args.model))
        print(header(args.model_choice, fingerprint=args.model_sha256), flush=True)
        log_path = Path(tmp) / "server.log"
        with open(log_path, "w") as log:
            server, url = start_server(args, args.max_sequences, stderr=log)
            proc = psutil.Process(server.pid)
            try:
                with httpx.Client(base_url=url, timeout=30) as c:
                    served = c.get("/v1/models").json()["data"][0]["id"]
                    capacity = int(next(s.value for f in text_string_to_metric_families(c.get("/metrics").text)
                                        for s in f.samples if s.name == "aner_http_capacity"))
                soak = Soak(url, args, capacity)
                soak.tally.sending(1)  # /v1/models above (scrapes are not tallied)
                pause = Pause(args.clients)
                t0 = time.monotonic()
                deadline = t0 + duration
                samples = [sample(proc, url, t0)]
                workers = [threading.Thread(target=soak.client, args=(i, pause, deadline), daemon=True)
                           for i in range(args.clients)]
                for w in workers:
                    w.start()
                next_at = t0 + args.interval
                while time.monotonic() < deadline:
                    time.sleep(max(0.0, min(next_at, deadline) - time.monotonic()))
                    if time.monotonic() >= deadline:
                        break
                    if not pause.hold(timeout=120):
                        soak.tally.fail("pause_timeout", "clients did not pause within 120 s")
                    try:
                        samples.append(sample(proc, url, t0))
                    finally:
                        pause.release()
                    if args.verbose:
                        s = samples[-1]
                        print(f"  t={s['t_s']:7.1f}s rss={s['rss_bytes'] / 2**20:7.1f} MiB threads={s['threads']} "
                              f"fds={s['fds']} contexts={s['native_contexts']} "
                              f"requests={sum(soak.tally.kinds.values())}", flush=True)
                    next_at += args.interval
                soak.stop.set()
                for w in workers:
                    w.join(timeout=180)
                    if w.is_alive():
                        soak.tally.fail("client_hung", "a client thread did not finish within 180 s")
                samples.append(sample(proc, url, t0))
                elapsed = time.monotonic() - t0
            finally:
                server.send_signal(signal.SIGTERM)
                try:
                    exit_code = server.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    server.kill()
                    exit_code = server.wait(timeout=30)
                    soak.tally.fail("server_shutdown", "the server did not exit within 60 s of SIGTERM")
        server_log = log_path.read_text(errors="replace")
    return report_of(args, soak, samples, elapsed, warmup, served, capacity, exit_code, server_log)


def report_of(args: argparse.Namespace, soak: Soak, samples: list[dict[str, Any]], elapsed: float, warmup: float,
              served: str, capacity: int, exit_code: int, server_log: str) -> dict[str, Any]:
    tally = soak.tally
    growths = growth(samples, warmup, elapsed)
    histogram: collections.Counter[str] = collections.Counter()
    for counts in tally.statuses.values():
        histogram.update(counts)
    server_requests = samples[-1]["server_requests"]
    scrapes = sum(v for k, v in server_requests.items() if k.startswith("/metrics "))
    server_total = sum(server_requests.values()) - scrapes  # what the clients sent (scrapes are not tallied)
    failures = dict(tally.failures)
    if exit_code != 0:
        failures["server_exit"] = exit_code
    not_idle = [s["t_s"] for s in samples if not s["idle"]]
    if not_idle:
        failures["not_idle_at_sample"] = len(not_idle)
    if server_total != tally.sent:
        failures["server_count_mismatch"] = server_total - tally.sent
    over = {k: g["growth"] for k, g in growths.items() if not g["growth"] < args.max_growth}
    if over:
        failures["growth"] = over
    client_5xx = {code: n for code, n in histogram.items() if code.isdigit() and int(code) >= 500 and code != "503"}
    return {
        "manifest": harness.manifest(
            None, script="benchmarks/soak.py", served_model=served, model_path=str(args.model),
            **manifest_fields(args.model_choice, fingerprint=args.model_sha256),
            server=f"aner-nb serve --max-sequences {args.max_sequences} --context {args.context} "
                   f"--max-tokens {args.max_tokens} --threads {args.threads}",
            capacity=capacity, clients=args.clients, minutes=args.minutes, interval_s=args.interval,
            warmup_s=warmup, max_growth=args.max_growth, mix=WEIGHTS,
            burst_size=capacity + 8, nice=os.nice(0),
        ),
        "elapsed_s": round(elapsed, 1),
        "requests": {"total": sum(tally.kinds.values()), "http_sent": tally.sent, "by_kind": dict(tally.kinds)},
        "status_by_kind": {k: dict(v) for k, v in tally.statuses.items()},
        "status_histogram": dict(histogram),
        "outcomes": dict(tally.outcomes),
        "server_requests": server_requests,
        "server_requests_total": server_total,
        "client_5xx_other_than_503": client_5xx,
        "growth": growths,
        "samples": samples,
        "server_exit_code": exit_code,
        # Logged errors are reported, not judged: the verdict is what clients saw and what the process holds.
        "server_log_errors": sum(1 for line in server_log.splitlines() if " ERROR " in line),
        "server_log_tail": server_log[-4000:],
        "failures": failures,
        "failure_examples": tally.examples,
        "ok": not failures and not client_5xx,
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"soak: {result['elapsed_s']:.0f} s, {result['requests']['total']} operations "
             f"({result['requests']['http_sent']} HTTP requests), warm-up {result['manifest']['warmup_s']:.0f} s, "
             f"{len(result['samples'])} samples"]
    lines.append("  kind        count  statuses")
    for kind in KINDS:
        statuses = ", ".join(f"{c}: {n}" for c, n in sorted(result["status_by_kind"][kind].items()))
        lines.append(f"  {kind:<10} {result['requests']['by_kind'].get(kind, 0):6d}  {statuses}")
    lines.append("  resource          baseline       final   growth")
    for key, g in result["growth"].items():
        lines.append(f"  {key:<15} {g['baseline']:>10,.0f} {g['final']:>11,.0f} {g['growth']:>+8.2%}")
    lines.append(f"  outcomes: {result['outcomes']}; server log ERROR lines: {result['server_log_errors']}")
    lines.append(f"  failures: {result['failures'] or 'none'}; verdict: {'OK' if result['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="load duration (default 30; CI: 3)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--model", default=None, metavar="smollm2|gemma|PATH",
                        help="the model to serve: smollm2, gemma or a GGUF path (default: a tiny fixture model)")
    parser.add_argument("--max-sequences", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32, help="server cap; requests ask 2..cap")
    parser.add_argument("--threads", type=int, default=1, help="engine threads (default 1: the clients need CPU)")
    parser.add_argument("--burst-every", type=float, default=5.0, help="seconds between bursts at least")
    parser.add_argument("--max-growth", type=float, default=0.05)
    parser.add_argument("--json", default=None, help="write the manifest and every sample here")
    parser.add_argument("--verbose", action="store_true", help="print each sample")
    args = parser.parse_args(argv)
    result = run(args)
    print(table(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
