"""Row prompts: a template such as ``"Classify: {text}"`` filled from one row's columns.

The reference grammar is the cell magics' (``aner_nb.magics.prompt``): ``{name}``
is a column, ``{{name}}`` is a literal ``{name}``, and nothing else inside
braces is looked up, so the braces of JSON or code in a prompt stay as
written. Unlike a cell, where an unknown name stays as typed, a row template
naming a column the frame does not have is a typed error before any row runs:
a misspelt column would otherwise send the braces to the model on every row.
Values are inserted with ``str()``; a missing value (``None``/NaN) becomes the
empty string.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from .errors import InvalidRequestError

__all__ = ["template_fields", "check_template", "fill_template"]

_REF = re.compile(r"\{\{(?P<literal>[A-Za-z_][A-Za-z0-9_]*)\}\}|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)\}")


def template_fields(template: str) -> tuple[str, ...]:
    """The column names ``template`` reads, in order of first use (literals ``{{x}}`` excluded)."""
    seen: dict[str, None] = {}
    for match in _REF.finditer(template):
        if match.group("name") is not None:
            seen.setdefault(match.group("name"), None)
    return tuple(seen)


def check_template(template: Any, columns: Sequence[str], *, param: str = "prompt") -> tuple[str, ...]:
    """The fields of ``template``, or a typed error naming the missing columns and the ones there are."""
    if not isinstance(template, str) or not template.strip():
        raise InvalidRequestError(f"{param} must be a non-empty template string, got {template!r}", param=param)
    fields = template_fields(template)
    missing = [f for f in fields if f not in columns]
    if missing:
        have = ", ".join(map(str, columns)) or "none"
        raise InvalidRequestError(
            f"{param} names column(s) {', '.join(missing)} that the data does not have (its columns: {have}); "
            "write {{name}} for literal braces", param=param,
        )
    return fields


def _text(value: Any) -> str:
    import pandas as pd  # the rows come from pandas; a server process need not load it

    if value is None or (pd.api.types.is_scalar(value) and pd.isna(value)):
        return ""
    return str(value)


def fill_template(template: str, row: Mapping[str, Any]) -> str:
    """``template`` with each ``{column}`` replaced by the row's value (checked first by :func:`check_template`)."""

    def sub(match: "re.Match[str]") -> str:
        literal, name = match.group("literal", "name")
        if literal is not None:
            return "{" + literal + "}"
        return _text(row[name])

    return _REF.sub(sub, template)
