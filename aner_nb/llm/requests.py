"""Request preparation: the one place a request is checked, formatted and turned into a job.

Every lease kind (ordinary, latency, adapter, batching, session) prepares a
request here before it runs it: the options become :class:`RequestSettings`
(each bound checked once, errors naming the option in ``param``), messages
are normalised and rendered with the chat template, the prompt is
tokenized, and prompt plus ``max_tokens`` must fit the lease's context.
A request option is declared once, in :mod:`aner_nb.llm.options`;
:class:`RequestSettings`, :data:`RequestOptions`, :data:`REQUEST_OPTIONS` and
:data:`SAMPLING_OPTIONS` are derived from that declaration.

The engine settings a lease's contexts get (:func:`context_params`) and the
timings part describing them (:func:`profile_timings`) live here too, so
every lease kind derives them by the same rule.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ._engine import ContextParams, default_threads
from .prefix_pool import common_prefix_length
from .chat import locate_contents, template_layout, validate_messages
from .errors import ConfigurationError, ContextOverflowError, InvalidRequestError
from .options import REGISTRY, Registry, RequestSettings
from .profiles import Profile
from .reuse import BLOCKED, reuse_attention
from .runner import Job
from .sampling import request_grammar
from .chat_input import chat_input
from .output import OutputFormat
from .timings import ProfileTimings
from .valid_text import check_text

if TYPE_CHECKING:
    from .adapters import SharedAdapter
    from .weights import SharedWeights

__all__ = [
    "RequestOptions",
    "REQUEST_OPTIONS",
    "Prepared",
    "RawText",
    "as_messages",
    "as_raw_text",
    "request_settings",
    "prompt_token_ids",
    "prepare",
    "new_job",
    "engine_threads",
    "context_params",
    "profile_timings",
    "template_opening",
]

REQUEST_OPTIONS = REGISTRY.names
# Options that change which token is chosen (a speculative lease accepts none of them).
SAMPLING_OPTIONS = REGISTRY.sampling
# The keyword options every request method takes (see aner_nb.llm.options for bounds).
RequestOptions = REGISTRY.typed_dict


@dataclass(frozen=True)
class RawText:
    """A prompt evaluated as given: no chat template (``complete()``, for base models)."""

    text: str


@dataclass(frozen=True)
class Prepared:
    """A validated request: its settings, its messages and the exact prompt tokens to evaluate."""

    request: RequestSettings
    messages: "tuple[dict[str, str], ...] | RawText"
    tokens: tuple[int, ...]
    t_call: int  # perf_counter_ns when the caller entered the request method
    grammar: str | None = None  # the GBNF the output must match, from grammar= or json_schema= (or tool_choice)
    output: OutputFormat = OutputFormat()  # how the answer's text splits into content, reasoning and tool calls


def as_messages(prompt: Any, *, strict_str: bool = False) -> tuple[dict[str, str], ...]:
    """A prompt string as one user message, or a checked message list (``strict_str``: strings only)."""
    if isinstance(prompt, str):
        return validate_messages([{"role": "user", "content": prompt}])
    if strict_str:
        raise InvalidRequestError(
            f"prompt must be a string, got {type(prompt).__name__}; use chat(messages) for a message list",
            param="prompt",
        )
    return validate_messages(prompt)


def request_settings(
    options: Mapping[str, Any], settings: "RequestSettings | None" = None, *, registry: Registry = REGISTRY
) -> RequestSettings:
    """The checked settings of one request: ``settings`` as given, or built from the keyword ``options``.

    An unknown option is refused by name; ``settings`` and keyword options together are refused.
    """
    if settings is None:
        return registry.settings_from(options)
    if not isinstance(settings, registry.settings):
        raise InvalidRequestError(
            f"settings must be a RequestSettings, got {type(settings).__name__}", param="settings"
        )
    if options:
        name = next(iter(options))
        raise InvalidRequestError(
            f"pass either settings= or keyword options, not both (got settings= and {name}=)", param=name
        )
    return settings


def as_raw_text(text: Any) -> RawText:
    if not isinstance(text, str):
        raise InvalidRequestError(f"a completion prompt must be a string, got {type(text).__name__}", param="prompt")
    check_text(text, "prompt")
    return RawText(text)


def prompt_token_ids(
    weights: "SharedWeights",
    prompt: "Sequence[Mapping[str, Any]] | RawText",
    *,
    allow_special_tokens: bool = False,
    trusted: "frozenset[int]" = frozenset(),
    tools: "Sequence[Mapping[str, Any]] | None" = None,
    variables: "Sequence[tuple[str, Any]]" = (),
) -> list[int]:
    """The tokens a prompt evaluates (``tools`` and ``variables``: the template's, see ``chat_input``).

    Messages are rendered with the chat template, which writes BOS itself when the model family
    wants one, so no special tokens are added on top. Only the template's own text may become
    special (control) tokens: special-token text inside a message's content (``<|im_end|>``
    typed by a user) is tokenized as plain text, unless ``allow_special_tokens`` (every message)
    or ``trusted`` (those message indices; a session's turns sent with the option) says the
    caller wrote it on purpose. When no content contributes a control token the ids are exactly
    those of tokenizing the whole render (llama-cpp-python's rule); otherwise the render is split
    into template and content pieces, tokenized separately and concatenated, and a content that
    cannot be located in the render while it holds special-token text is refused.

    Raw text (``complete()``) is the caller's whole prompt: special-token text is parsed and the
    model's own BOS/EOS rule applies, as llama.cpp's ``/completion``.
    """
    native = weights.native
    if isinstance(prompt, RawText):
        return native.tokenize(prompt.text, add_special=True, parse_special=True)
    template = weights.template
    text = template.render(prompt, add_generation_prompt=True, tools=tools, variables=variables)
    whole = native.tokenize(text, add_special=False, parse_special=True)
    if allow_special_tokens or len(trusted) >= len(prompt):
        return whole
    special = native.parsed_special
    layout = template_layout(template, prompt, trusted=trusted, tools=tools, variables=variables)
    if layout is not None:
        # Fast path: the whole render has exactly the template pieces' control tokens, in order.
        ours = [t for piece in layout if isinstance(piece, str) for t in native.tokenize(piece) if special(t)]
        marked = {t for t in set(whole) if special(t)}  # each distinct id asked once, not each of 1-100k positions
        if [t for t in whole if t in marked] == ours:
            return whole
        pieces = locate_contents(text, layout, [m["content"] for m in prompt])
        if pieces is not None:
            out: list[int] = []
            for piece, index in pieces:
                if piece:
                    out += native.tokenize(piece, add_special=False, parse_special=index is None)
            return out
    # The contents cannot be told apart from the template's text: refuse any that holds special-token text.
    for i, message in enumerate(prompt):
        content = message["content"]
        if i not in trusted and native.tokenize(content, parse_special=True) != native.tokenize(content, parse_special=False):
            raise InvalidRequestError(
                f"messages[{i}].content contains special-token text (such as the template's turn markers) and "
                "this chat template's output cannot be split into its own text and the messages' contents, so "
                "it cannot be kept as plain text; remove the marker text, or pass allow_special_tokens=True "
                "if you wrote it on purpose",
                param=f"messages[{i}].content",
            )
    return whole


def prepare(
    weights: "SharedWeights",
    messages: "tuple[dict[str, str], ...] | RawText",
    request: "RequestSettings | Mapping[str, Any]",
    *,
    context: int,
    greedy_only: bool = False,
    context_note: str = "",
    trusted: "frozenset[int]" = frozenset(),
) -> Prepared:
    """Check ``request`` against the model, format and tokenize the messages, and check that prompt plus output
    fit ``context``. The settings were checked when they were built (``request_settings``; keyword options given
    as a mapping are built here); only the checks that need the model or the lease remain here.

    ``greedy_only`` refuses anything but plain greedy decoding (a speculative
    lease verifies proposals against the argmax of the raw logits);
    ``context_note`` explains a lease-specific context limit in the overflow
    message; ``trusted`` message indices may hold special tokens (see
    :func:`prompt_token_ids`).
    """
    t_call = time.perf_counter_ns()
    if not isinstance(request, RequestSettings):
        request = request_settings(request)
    if request.top_k > weights.native.n_vocab:
        raise InvalidRequestError(
            f"top_k must be in 0..{weights.native.n_vocab} (the vocabulary size), got {request.top_k}", param="top_k"
        )
    out_of_vocab = [token for token, _ in request.logit_bias if token >= weights.native.n_vocab]
    if out_of_vocab:
        raise InvalidRequestError(
            f"logit_bias names token {out_of_vocab[0]}, outside the vocabulary (ids 0..{weights.native.n_vocab - 1})",
            param="logit_bias",
        )
    if greedy_only:
        _check_plain_greedy(request)
    grammar = request_grammar(weights.native, request)
    output = OutputFormat()
    if isinstance(messages, RawText):
        if request.tools or request.chat_template_kwargs:
            name = "tools" if request.tools else "chat_template_kwargs"
            raise InvalidRequestError(f"{name} needs a chat request; a raw completion has no chat template",
                                      param=name)
        tokens = prompt_token_ids(weights, messages, allow_special_tokens=request.allow_special_tokens)
    else:
        chat = chat_input(weights, messages, request, trusted)
        grammar = chat.grammar if chat.grammar is not None else grammar
        output = chat.output
        tokens = prompt_token_ids(weights, chat.messages, allow_special_tokens=request.allow_special_tokens,
                                  trusted=chat.trusted, tools=chat.tools, variables=chat.variables)
    if not tokens:
        raise ContextOverflowError(
            "the formatted prompt is empty; a request needs at least one prompt token", param="messages"
        )
    room = context - len(tokens)
    if request.max_tokens_fit and 0 < room < request.max_tokens:  # generate what fits, as OpenAI servers do
        request = dataclasses.replace(request, max_tokens=room)
    if len(tokens) + request.max_tokens > context:
        advice = f"lower max_tokens to at most {room}" if room > 0 else "shorten the prompt"
        raise ContextOverflowError(
            f"prompt of {len(tokens)} tokens plus max_tokens={request.max_tokens} is "
            f"{len(tokens) + request.max_tokens}, above the context of {context}; {advice} "
            f"(nothing is truncated){context_note}",
            param="max_tokens" if room > 0 else "messages",
        )
    return Prepared(request, messages, tuple(tokens), t_call, grammar, output)


def _check_plain_greedy(request: RequestSettings) -> None:
    defaults = RequestSettings()
    changed = [name for name in SAMPLING_OPTIONS if getattr(request, name) != getattr(defaults, name)]
    if changed:
        name = changed[0]
        raise InvalidRequestError(
            f"{name}={getattr(request, name)!r} is not allowed on a speculative lease: prompt-lookup verification "
            "compares proposals with plain greedy choices; leave sampling options at their defaults, or use a "
            "lease without speculative_tokens",
            param=name,
        )


def new_job(prepared: Prepared, params: ContextParams, profile: Profile, model_name: str) -> Job:
    """The job of a prepared request, carrying the profile's timings part."""
    job = Job(
        prompt_tokens=prepared.tokens, request=prepared.request, t_call=prepared.t_call, model_name=model_name,
        grammar=prepared.grammar, output=prepared.output,
    )
    job.add(profile_timings(params, profile))
    return job


def engine_threads(profile: Profile) -> tuple[int, int]:
    """``(n_threads, n_threads_batch)`` a profile's contexts get: its own, or the engine default for 0."""
    threads, prefill = default_threads()
    opt = profile.optimizer
    return opt.threads or threads, opt.prefill_threads or prefill


def context_params(
    weights: "SharedWeights",
    profile: Profile,
    *,
    n_seq_max: int = 1,
    swa_full: bool = False,
    adapter: "SharedAdapter | None" = None,
    kv_unified: bool = True,
    n_ctx: int | None = None,
    reuses_prefixes: bool = False,
) -> ContextParams:
    """The explicit context parameters of a lease's contexts, including the adapter they apply.

    ``n_ctx`` overrides the loaded context (a batching lease with shared
    prefixes needs more cells than its request sequences share).
    ``reuses_prefixes``: the contexts serve a prefix cache, so the attention
    kernel and the prefill's calls are the ones that make reuse exact
    (:func:`~aner_nb.llm.reuse.reuse_attention`, ``runner.prefill_chunks``).

    A profile naming an adapter needs that adapter here, so no caller can
    silently create adapter-less contexts for it.
    """
    if profile.adapter != (adapter.sha256 if adapter is not None else None):
        raise ConfigurationError(
            f"this profile applies adapter {profile.adapter!r} but the contexts were asked for "
            f"{adapter.sha256 if adapter is not None else None!r}; an adapter profile's contexts must apply its adapter"
        )
    opt = profile.optimizer
    threads, prefill = engine_threads(profile)
    settings = weights.settings
    return ContextParams(
        n_ctx=settings.context if n_ctx is None else n_ctx,
        n_batch=opt.batch_tokens,
        n_ubatch=opt.micro_batch_tokens,
        n_seq_max=n_seq_max,
        n_threads=threads,
        n_threads_batch=prefill,
        kv_cache_type=settings.kv_cache_type,
        flash_attention=(
            reuse_attention(settings.flash_attention, kv_cache_type=settings.kv_cache_type, on_cpu=weights.device == "cpu")
            if reuses_prefixes else settings.flash_attention
        ),
        swa_full=swa_full,
        kv_unified=kv_unified,
        # one sequence of a sliding-window model in a full SWA cache: its saved states hold every cell
        saves_all_cells=swa_full and n_seq_max == 1 and kv_unified and int(getattr(weights.native, "n_swa", 0) or 0) > 0,
        offload=weights.device != "cpu",
        adapter=adapter.native if adapter is not None else None,
        # an adapter's weights are not among the facts the model's own shape was read from
        prefix_reuse=(weights.reuse_shape_for(n_seq_max) if adapter is None else BLOCKED) if reuses_prefixes else None,
    )


def template_opening(weights: "SharedWeights") -> int:
    """Tokens every prompt of this template starts with (BOS, the first turn's header).

    A prefix-cache match no longer than this is template-only and worth no entry.
    """
    render, tokenize = weights.template.render, weights.native.tokenize
    a = tokenize(render([{"role": "user", "content": "a"}]))
    b = tokenize(render([{"role": "user", "content": "b"}]))
    return common_prefix_length(a, b)


def profile_timings(params: ContextParams, profile: Profile) -> ProfileTimings:
    """The timings part that describes the configuration the request ran with."""
    opt = profile.optimizer
    return ProfileTimings(
        threads=params.n_threads,
        prefill_threads=params.n_threads_batch,
        batch_tokens=params.n_batch,
        micro_batch_tokens=params.n_ubatch,
        speculative_tokens=opt.draft_tokens,  # what the request ran with (0 when it fell back)
        prefix_cache_capacity=opt.prefix_cache_entries,
    )
