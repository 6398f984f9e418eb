"""What ``map`` returns: one :class:`RowResult` per row, as a DataFrame aligned to the input's index.

The columns are :data:`RESULT_COLUMNS`: ``answer``, ``finish_reason``,
``prompt_tokens``, ``completion_tokens``, ``first_token_ms``, ``total_ms``
and ``error`` (the empty string where the row succeeded). Counts are
nullable integers and durations nullable floats, so a failed row's missing
values stay missing instead of turning the column into floats.

With a JSON schema, :func:`expand_schema_columns` turns each answer's object
into typed columns, one per top-level property: integers as ``Int64``,
numbers as ``Float64``, booleans as ``boolean``, an enum of strings as a
categorical of exactly those values, other strings as ``string``, and
anything else (objects, arrays) as Python objects.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .errors import InvalidRequestError

if TYPE_CHECKING:
    import pandas as pd

    from .response import Response

__all__ = ["RowResult", "RESULT_COLUMNS", "result_frame", "expand_schema_columns"]

_NS_PER_MS = 1e6


@dataclass(frozen=True)
class RowResult:
    """One row's outcome: the answer and its counts, or the error that ended it."""

    answer: "str | None" = None
    finish_reason: "str | None" = None
    prompt_tokens: "int | None" = None
    completion_tokens: "int | None" = None
    first_token_ms: "float | None" = None
    total_ms: "float | None" = None
    error: str = ""

    @classmethod
    def of(cls, response: "Response") -> "RowResult":
        t = response.timings
        return cls(
            answer=response.text, finish_reason=response.finish_reason,
            prompt_tokens=response.usage.prompt_tokens, completion_tokens=response.usage.completion_tokens,
            first_token_ms=t.first_token_duration / _NS_PER_MS if t.first_token_duration >= 0 else None,
            total_ms=t.total_duration / _NS_PER_MS if t.total_duration >= 0 else None,
        )

    @classmethod
    def failed(cls, error: BaseException | str) -> "RowResult":
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return cls(error=text)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "RowResult | None":
        """A checkpointed row, or None when a value has the wrong type or range (the line is not trusted)."""
        for name, (kind, _) in _COLUMNS.items():
            value = data.get(name)
            if value is None and name != "error":
                continue
            if isinstance(value, bool) or not isinstance(value, kind):
                return None
            # counts and durations: what the column's dtype holds (Int64, a finite Float64), never negative
            if isinstance(value, int) and not 0 <= value <= _INT64_MAX:
                return None
            if isinstance(value, float) and not (math.isfinite(value) and value >= 0):
                return None
        return cls(**{name: data[name] for name in _COLUMNS})

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def ok(self) -> bool:
        return not self.error


# Each result column: the JSON values a checkpoint may hold for it, and its pandas dtype.
_COLUMNS: dict[str, tuple[Any, str]] = {
    "answer": (str, "string"), "finish_reason": (str, "string"), "prompt_tokens": (int, "Int64"),
    "completion_tokens": (int, "Int64"), "first_token_ms": ((int, float), "Float64"),
    "total_ms": ((int, float), "Float64"), "error": (str, "string"),
}
_INT64_MAX = 2**63 - 1
RESULT_COLUMNS = tuple(f.name for f in dataclasses.fields(RowResult))
assert RESULT_COLUMNS == tuple(_COLUMNS), "one entry per RowResult field, in order"


def result_frame(index: "pd.Index", results: Sequence[RowResult]) -> "pd.DataFrame":
    """The results as a DataFrame on ``index`` (one result per label, in order)."""
    import pandas as pd

    columns = {
        name: pd.array([getattr(r, name) for r in results], dtype=dtype) for name, (_, dtype) in _COLUMNS.items()
    }
    return pd.DataFrame(columns, index=index)


def _column_dtype(schema: Any) -> Any:
    import pandas as pd

    if not isinstance(schema, Mapping):
        return object
    kind = schema.get("type")
    if isinstance(schema.get("enum"), list) and schema["enum"] and all(isinstance(v, str) for v in schema["enum"]):
        return pd.CategoricalDtype(categories=list(dict.fromkeys(schema["enum"])))
    return {"integer": "Int64", "number": "Float64", "boolean": "boolean", "string": "string"}.get(kind, object)


def expand_schema_columns(frame: "pd.DataFrame", json_schema: Mapping[str, Any]) -> "pd.DataFrame":
    """``frame`` with one typed column per top-level property of ``json_schema``, parsed from ``answer``.

    A row without a parsed object (it failed, or its answer was cut at
    ``max_tokens``) has missing values in these columns. A property whose name
    is already a result column is refused (rename it in the schema).
    """
    import pandas as pd

    properties = json_schema.get("properties") if isinstance(json_schema, Mapping) else None
    if not isinstance(properties, Mapping) or not properties:
        raise InvalidRequestError("expand=True needs a json_schema with an object's top-level 'properties'",
                                  param="expand")
    clash = [name for name in properties if name in RESULT_COLUMNS]
    if clash:
        raise InvalidRequestError(
            f"schema properties {', '.join(clash)} clash with map's own columns ({', '.join(RESULT_COLUMNS)})",
            param="json_schema",
        )
    objects = [_parsed(a) for a in frame["answer"]]
    out = frame.copy()
    for name, schema in properties.items():
        values = [o.get(name) if o is not None else None for o in objects]
        try:
            out[name] = pd.Series(values, index=frame.index, dtype=_column_dtype(schema))
        except (TypeError, ValueError):  # a value of another type (a schema without "type" on a property)
            out[name] = pd.Series(values, index=frame.index, dtype=object)
    return out


def _parsed(answer: Any) -> "dict[str, Any] | None":
    if not isinstance(answer, str):
        return None
    try:
        value = json.loads(answer)
    except ValueError:
        return None  # cut at max_tokens: the grammar's object never closed
    except RecursionError:
        return None  # nested deeper than the parser recurses (a checkpoint's answer is not trusted)
    return value if isinstance(value, dict) else None
