"""Prompt integrity: which parts of a rendered prompt are the template's own text.

A message's content is caller text; only the template's literal text may hold special tokens.
The template is rendered a second time with every untrusted content replaced by a sentinel
(Supplementary Private Use Area code points, which no tokenizer gives meaning), so the rendered
text splits into template pieces and content slots (:func:`template_layout`);
:func:`locate_contents` then finds those slots in the real render.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .errors import ChatTemplateError

if TYPE_CHECKING:
    from .chat import ChatTemplate

__all__ = ["locate_contents", "template_layout"]

_SENTINEL_OPEN, _SENTINEL_CLOSE, _SENTINEL_DIGIT0 = "\U000f0000", "\U000f0001", 0xF0010
_SENTINEL = re.compile("\U000f0000([\U000f0010-\U000f0019]+)\U000f0001")
_SENTINEL_CHARS = re.compile("[\U000f0000-\U000f0019]")
# Locating contents in the real render: most candidate split points tried before giving up.
_MAX_LOCATE_STEPS = 4096


def _sentinel(index: int) -> str:
    return _SENTINEL_OPEN + "".join(chr(_SENTINEL_DIGIT0 + int(d)) for d in str(index)) + _SENTINEL_CLOSE


def template_layout(
    template: ChatTemplate, messages: Sequence[Mapping[str, Any]], *, trusted: frozenset[int] = frozenset(),
    tools: "Sequence[Mapping[str, Any]] | None" = None, variables: "Sequence[tuple[str, Any]]" = (),
) -> tuple[str | int, ...] | None:
    """The prompt as template text (``str``) and content slots (``int``: the message index).

    Messages in ``trusted`` keep their content (it counts as template text), and so do empty
    contents (nothing to protect; a template may test a content for emptiness, as tool-calling
    assistant turns' are). ``tools`` and ``variables`` are rendered as in the real render. ``None``
    when the layout cannot be known: a content holds a sentinel character, the template rejects or
    transforms the sentinels (cuts one, prints its length...).
    """
    untrusted = [i for i in range(len(messages)) if i not in trusted and messages[i]["content"]]
    if any(_SENTINEL_CHARS.search(messages[i]["content"]) for i in untrusted):
        return None
    masked = [dict(m) for m in messages]
    for i in untrusted:
        masked[i]["content"] = _sentinel(i)
    try:
        text = template.render(masked, add_generation_prompt=True, tools=tools, variables=variables)
    except ChatTemplateError:
        return None
    parts: list[str | int] = []
    at = 0
    for match in _SENTINEL.finditer(text):
        index = int("".join(str(ord(c) - _SENTINEL_DIGIT0) for c in match.group(1)))
        if index not in untrusted:
            return None
        parts += [text[at:match.start()], index]
        at = match.end()
    parts.append(text[at:])
    if any(isinstance(p, str) and _SENTINEL_CHARS.search(p) for p in parts):
        return None  # a sentinel was cut or altered by the template
    return tuple(parts)


def locate_contents(
    text: str, layout: Sequence[str | int], contents: Sequence[str]
) -> list[tuple[str, int | None]] | None:
    """Split the real render ``text`` along ``layout``: ``(piece, message index or None)``.

    Template pieces must match exactly; each content slot must be a substring of its message's
    content (a template may trim it, or keep the part after ``</think>``). The longest content
    piece is tried first, since a content may itself contain the template's next text. ``None``
    when no split fits within a bounded number of steps.
    """
    if not layout or not isinstance(layout[0], str) or not text.startswith(layout[0]):
        return None
    if len(layout) == 1:
        return [(layout[0], None)] if text == layout[0] else None

    # Depth-first over the content slots (odd k), iteratively: a conversation may have thousands.
    # A frame is [k, start of the slot, candidate ends left, chosen end].
    first = len(layout[0])
    stack: list[list[Any]] = [[1, first, _slot_ends(text, layout, contents, 1, first), -1]]
    steps = 0
    while stack:
        frame = stack[-1]
        k, at, candidates = frame[0], frame[1], frame[2]
        if not candidates:
            stack.pop()
            continue
        end = candidates.pop(0)
        steps += 1
        if steps > _MAX_LOCATE_STEPS:
            return None
        follow = layout[k + 1]
        assert isinstance(follow, str)
        if text[at:end] not in contents[layout[k]] or not text.startswith(follow, end):  # type: ignore[index]
            continue
        frame[3] = end
        after = end + len(follow)
        if k + 2 < len(layout):
            stack.append([k + 2, after, _slot_ends(text, layout, contents, k + 2, after), -1])
            continue
        if after != len(text):
            continue
        return _pieces(text, layout, stack)
    return None


def _slot_ends(text: str, layout: Sequence[str | int], contents: Sequence[str], k: int, at: int) -> list[int]:
    """Where the content of slot ``k`` starting at ``at`` may end, longest first."""
    follow = layout[k + 1]
    assert isinstance(follow, str)
    limit = min(len(text), at + len(contents[layout[k]]))  # type: ignore[index]
    if not follow:
        return [limit]
    out, start = [], text.rfind(follow, at, limit + len(follow))
    while start >= at:
        out.append(start)
        start = text.rfind(follow, at, start + len(follow) - 1) if start > at else -1
    return out


def _pieces(text: str, layout: Sequence[str | int], stack: list[list[Any]]) -> list[tuple[str, int | None]]:
    """The split the depth-first search found: each frame's chosen end closes its content slot."""
    out: list[tuple[str, int | None]] = [(layout[0], None)]  # type: ignore[list-item]
    for slot, start, _, chosen in stack:
        piece = layout[slot + 1]
        assert isinstance(piece, str)
        out += [(text[start:chosen], layout[slot]), (piece, None)]  # type: ignore[list-item]
    return out
