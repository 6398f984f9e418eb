"""``model.map``: one request per row of a DataFrame or Series, answers back in columns.

The plan is pure: every row's template is filled and checked, every row's
key computed and the checkpoint read before the first request runs, so a
missing column or a bad option fails the call with nothing spent. Then the
rows that the checkpoint does not already hold run on worker threads: on a
batching lease up to its ``max_sequences`` at once (one thread per sequence,
each holding one stream), on any other lease one at a time. Each finished row
is recorded by its worker, under one lock, as soon as it ends: its result, the
counts and its checkpoint line, so Ctrl-C (which lands in the caller's thread
only) never leaves a row counted but unwritten.

One bad row never loses the run: a request error (a prompt that does not
fit, a constraint the engine refused, a failed decode) becomes that row's
``error`` and the rest go on. Errors that concern the lease, not the row
(it was closed), and any non-library exception end the call. Ctrl-C stops
admitting rows, cancels the ones in flight and returns what finished (the
others have ``error`` ``"not run: interrupted"``), with
``frame.attrs["aner_nb.map"]`` saying so.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from .errors import ClosedError, InvalidRequestError, LLMError
from .map_checkpoint import Checkpoint, row_key, row_label
from .map_result import RESULT_COLUMNS, RowResult, expand_schema_columns, result_frame
from .progress import progress_bar
from .requests import request_settings
from .row_prompts import check_template, fill_template

if TYPE_CHECKING:
    import pandas as pd

    from .options import RequestSettings
    from .protocol import Lease

__all__ = ["map_frame", "MapStats", "INTERRUPTED", "SERIES_COLUMN"]

log = logging.getLogger("aner_nb.map")

INTERRUPTED = "not run: interrupted"
SERIES_COLUMN = "text"  # the column an unnamed Series is read as: prompt="Summarise: {text}"


@dataclass(frozen=True)
class MapStats:
    """What one ``map`` call did: rows in all, taken from the checkpoint, generated now, failed, interrupted."""

    rows: int
    from_checkpoint: int
    generated: int
    failed: int
    interrupted: bool
    checkpoint_lines_skipped: int = 0


@dataclass(frozen=True)
class _Row:
    position: int
    label: str
    messages: tuple[Mapping[str, str], ...]
    key: str


def map_frame(
    lease: "Lease",
    data: Any,
    prompt: str,
    *,
    json_schema: Mapping[str, Any] | None = None,
    expand: bool = False,
    system: str | None = None,
    checkpoint: "str | os.PathLike[str] | None" = None,
    progress: bool | None = None,
    settings: "RequestSettings | None" = None,
    **options: Any,
) -> "pd.DataFrame":
    """Run ``prompt`` (a template over ``data``'s columns) on every row; see :meth:`Lease.map`."""
    frame = _as_frame(data)
    check_template(prompt, [str(c) for c in frame.columns])
    if system is not None and not isinstance(system, str):
        raise InvalidRequestError(f"system must be a string or None, got {type(system).__name__}", param="system")
    if not isinstance(expand, bool):
        raise InvalidRequestError(f"expand must be True or False, got {expand!r}", param="expand")
    if expand and json_schema is None:
        raise InvalidRequestError("expand=True needs json_schema= (its properties become the columns)", param="expand")
    if json_schema is not None:
        options = {**options, "json_schema": json_schema}
    request = request_settings(options, settings)
    if request.max_tokens == 0:
        raise InvalidRequestError("map needs max_tokens >= 1 (0 only checks a request)", param="max_tokens")
    if lease.kind == "session":
        raise InvalidRequestError(
            "map runs each row as its own request; a session would add every row to one conversation "
            "(call map on the lease the session came from)", param="model",
        )
    _check_settings(lease, request)
    rows = _plan(lease, frame, prompt, system, request)
    store = Checkpoint(checkpoint) if checkpoint is not None else None
    results, skipped = _from_checkpoint(store, rows)
    pending = [r for r in rows if results[r.position] is None]
    run = _Run(lease, request, store, progress, len(pending))
    interrupted = run.execute(pending, results)
    done = [r if r is not None else RowResult.failed(INTERRUPTED) for r in results]
    out = result_frame(frame.index, done)
    if expand:
        out = expand_schema_columns(out, request.json_schema)
    out.attrs["aner_nb.map"] = MapStats(
        rows=len(rows), from_checkpoint=len(rows) - len(pending), generated=run.generated,
        failed=sum(1 for r in done if not r.ok and r.error != INTERRUPTED), interrupted=interrupted,
        checkpoint_lines_skipped=skipped,
    )
    return out


def _as_frame(data: Any) -> "pd.DataFrame":
    import pandas as pd

    if isinstance(data, pd.Series):
        return data.to_frame(name=data.name if isinstance(data.name, str) and data.name else SERIES_COLUMN)
    if isinstance(data, pd.DataFrame):
        return data
    raise InvalidRequestError(
        f"map takes a pandas DataFrame or Series, got {type(data).__name__}", param="data"
    )


def _check_settings(lease: "Lease", request: "RequestSettings") -> None:
    """Refuse settings the model cannot run (a schema it cannot enforce...) once, not on every row.

    A validate-only request (``max_tokens=0``: no context, no KV) on a one-word prompt goes through
    the lease's own preparation, so every check that needs the model (the grammar a schema becomes,
    the lease kind's rules) runs before the first row.
    """
    lease.chat([{"role": "user", "content": "x"}], settings=dataclasses.replace(request, max_tokens=0))


def _plan(lease: "Lease", frame: "pd.DataFrame", prompt: str, system: str | None,
          request: "RequestSettings") -> list[_Row]:
    """Every row's messages and key, before anything runs."""
    values = dataclasses.asdict(request)
    adapter = lease.adapter.sha256 if lease.supports("adapter") else None
    head = ({"role": "system", "content": system},) if system is not None else ()
    rows = []
    records = frame.to_dict("records")
    for position, (label, record) in enumerate(zip(frame.index, records)):
        messages = head + ({"role": "user", "content": fill_template(prompt, {str(k): v for k, v in record.items()})},)
        rows.append(_Row(position, row_label(label), messages, row_key(messages, values, lease.fingerprint, adapter)))
    return rows


def _from_checkpoint(store: Checkpoint | None, rows: Sequence[_Row]) -> tuple[list[RowResult | None], int]:
    results: list[RowResult | None] = [None] * len(rows)
    if store is None:
        return results, 0
    loaded = store.load(frozenset(RESULT_COLUMNS))
    for row in rows:
        saved = loaded.rows.get((row.label, row.key))
        if saved is not None:
            results[row.position] = RowResult.from_json(saved)  # None (run again) when a value is mistyped
    return results, loaded.skipped_lines


def _row_error(exc: BaseException) -> bool:
    """Whether ``exc`` ends only its row (a request error), not the whole call."""
    return isinstance(exc, LLMError) and not isinstance(exc, ClosedError)


class _Run:
    """The rows that run now: concurrency, the checkpoint writes and the progress bar.

    Every row runs on a worker thread (one per sequence of a batching lease, one otherwise) and
    is recorded there, under a lock: its result, the count and its checkpoint line. Ctrl-C lands
    only in the caller's thread, which just admits rows and waits, so a row is recorded whole or
    not at all, never counted without its checkpoint line.
    """

    def __init__(self, lease: "Lease", request: "RequestSettings", store: Checkpoint | None,
                 progress: bool | None, total: int) -> None:
        self.lease, self.request, self.store = lease, request, store
        self.width = lease.stats().max_sequences if lease.supports("continuous_batching") else 1
        self.bar = progress_bar(progress if total else False, total=total, desc="map", unit="row")
        self.generated = 0
        self._tokens = 0
        self._start = time.monotonic()
        self._live: set[Any] = set()
        self._stopping = False  # set once admission stopped; rows starting after it are cancelled at once
        self._lock = threading.Lock()

    def execute(self, pending: Sequence[_Row], results: list[RowResult | None]) -> bool:
        """Run ``pending`` into ``results``; True when Ctrl-C cut the run short."""
        try:
            with self.bar:
                return self._admit_and_wait(pending, results)
        finally:
            self.bar.close()

    def _admit_and_wait(self, pending: Sequence[_Row], results: list[RowResult | None]) -> bool:
        queue: Iterator[_Row] = iter(pending)
        futures: dict[concurrent.futures.Future, _Row] = {}
        pool = concurrent.futures.ThreadPoolExecutor(self.width, thread_name_prefix="aner-map")

        def admit() -> None:
            row = next(queue, None)
            if row is not None:
                futures[pool.submit(self._work, row, results)] = row

        try:
            for _ in range(self.width):
                admit()
            while futures:
                done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    del futures[future]
                    future.result()  # a fatal error (not a row's) is raised here
                    admit()
            return False
        except KeyboardInterrupt:
            self._cancel_live()
            for future, row in list(futures.items()):
                error = _raised(future)
                if error is not None:
                    results[row.position] = RowResult.failed(error)
            return True
        except BaseException:
            self._cancel_live()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _work(self, row: _Row, results: list[RowResult | None]) -> None:
        """On a worker: one row's request, then its record."""
        outcome = self._one(row)
        with self._lock:
            self._finish(row, outcome, results)

    def _one(self, row: _Row) -> RowResult:
        """One row's request, start to end, on this thread; request errors become the row's error."""
        try:
            stream = self.lease.stream(list(row.messages), settings=self.request)
        except BaseException as exc:
            if _row_error(exc):
                return RowResult.failed(exc)
            raise
        with self._lock:
            self._live.add(stream)
            if self._stopping:
                stream.cancel()  # Ctrl-C came while this row was starting: it ends at its first step
        try:
            for _ in stream:
                pass
            response = stream.response
            # A stream cancelled before its first step ends without a Response.
            return RowResult.of(response) if response is not None else RowResult.failed(INTERRUPTED)
        except BaseException as exc:
            if _row_error(exc):
                return RowResult.failed(exc)
            stream.cancel()  # a fatal error: this request ends too
            raise
        finally:
            with self._lock:
                self._live.discard(stream)

    def _cancel_live(self) -> None:
        with self._lock:
            self._stopping = True
            live = list(self._live)
        for stream in live:
            stream.cancel()

    def _finish(self, row: _Row, outcome: RowResult, results: list[RowResult | None]) -> None:
        if outcome.finish_reason == "cancelled":
            outcome = RowResult.failed(INTERRUPTED)
        if outcome.error != INTERRUPTED and outcome.ok and self.store is not None:
            self.store.append(row.label, row.key, outcome.as_json())
        results[row.position] = outcome
        if outcome.error == INTERRUPTED:
            return
        self.generated += 1
        self._tokens += outcome.completion_tokens or 0
        elapsed = max(time.monotonic() - self._start, 1e-9)
        self.bar.update(1)
        self.bar.set_postfix_str(f"{self._tokens / elapsed:.1f} tok/s", refresh=False)


def _raised(future: concurrent.futures.Future) -> BaseException | None:
    """The fatal error a row's worker raised once its (cancelled) request ended; None otherwise."""
    try:
        future.result()
    except concurrent.futures.CancelledError:
        return None  # never started: the row stays "not run: interrupted"
    except BaseException as exc:  # noqa: BLE001 - the run is being interrupted; keep the row's error
        return exc
    return None
