"""``%llm models``, ``info``, ``kv``, ``embed`` and ``bench``: looking at models and handles, and comparing two.

The tables are the pure functions of :mod:`aner_nb.magics.tables` (and
:func:`aner_nb.llm.models`), so each has a one-call Python equivalent.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

from .. import llm
from ..llm import KV_CACHE_TYPES
from .base import TARGET, MagicsBase, library_errors
from .parser import argument, check_name, int_arg, subcommand
from .tables import bench_outputs, bench_table, handle_info, handle_kind, kv_table

__all__ = ["InspectionMagics", "BENCH_PROMPT"]

# %llm bench without --prompt: one short prompt, so a quick A/B needs no arguments.
BENCH_PROMPT = "Write one sentence about why the sky is blue."


class InspectionMagics(MagicsBase):
    """Handlers that show models, handles and benchmarks."""

    @subcommand(
        "models",
        usage="%llm models",
        description="A DataFrame of the GGUF files found in the stores (the packaged demo models, $ANER_NB_MODELS "
        "and ~/models, the Hugging Face cache, LM Studio, Ollama), read from their headers; %llm load NAME "
        "takes a name from it.",
        python="llm.models()",
    )
    def _llm_models(self, args: Any) -> Any:
        with library_errors("%llm models"):
            return llm.models()

    @subcommand(
        "info",
        usage="%llm info [NAME]",
        description="Metadata, load summary, memory summary and KV estimate of one handle, as a DataFrame.",
        python="from aner_nb.magics import handle_info; handle_info(NAME)  "
        "# NAME.memory_summary(), NAME.load_summary()",
    )
    @TARGET
    def _llm_info(self, args: Any) -> Any:
        return self._on_handle("info", args.target, lambda h: handle_info(h, model=self.handles.parent_of(h)))

    @subcommand(
        "kv",
        usage="%llm kv [NAME] [--context N] [--kv-cache-type T] [--slots N]",
        description="KV-cache bytes for N resident contexts of this model (every KV type unless --kv-cache-type).",
        python="from aner_nb.magics import kv_table; kv_table(NAME, context=N, kv_cache_type=T, slots=S)  "
        "# llm.kv_estimate(context, layers, kv_heads, head_dim_k, head_dim_v, T) * S",
    )
    @TARGET
    @argument("--context", type=int_arg, metavar="N", help="context tokens (default: the handle's)")
    @argument("--kv-cache-type", choices=KV_CACHE_TYPES, help="one KV type (default: all of them)")
    @argument("--slots", type=int_arg, metavar="N", default=1,
              help="resident contexts of this size: active requests + idle pool + sessions (default 1)")
    def _llm_kv(self, args: Any) -> Any:
        return self._on_handle(
            "kv", args.target, lambda h: kv_table(h, context=args.context, kv_cache_type=args.kv_cache_type,
                                                  slots=args.slots)
        )

    @subcommand(
        "embed",
        usage="%llm embed NAME [TEXT ...] [--from VAR] [--pooling P] [--no-normalize] [--as VAR]",
        description="Sentence embeddings of the TEXTs (quote each), or of the str or list of str in --from VAR, "
        "as a float32 array of one row per text; it goes to --as VAR and _. Pooling: the model's own, else mean.",
        python="VAR = NAME.embed([TEXT, ...], pooling=P, normalize=True)",
    )
    @argument("target", metavar="NAME", help="the handle (a lease)")
    @argument("texts", metavar="TEXT", nargs="*", help="a text to embed (repeatable)")
    @argument("--from", dest="source", metavar="VAR", help="embed this variable's str or list of str")
    @argument("--pooling", choices=("mean", "cls", "last"), help="default: the model's own, else mean")
    @argument("--no-normalize", dest="normalize", action="store_false", help="keep the vectors' lengths")
    @argument("--as", dest="var", metavar="VAR", help="also store the array in this variable")
    def _llm_embed(self, args: Any) -> None:
        prog = "%llm embed"
        if args.var is not None:
            check_name(args.var, prog, "--as")
        texts: Any = list(args.texts)
        if args.source is not None:
            if texts:
                raise UsageError(f"{prog}: give TEXTs or --from VAR, not both")
            if args.source not in self.ns:
                raise UsageError(f"{prog}: --from {args.source}: no such variable")
            texts = self.ns[args.source]
        elif not texts:
            raise UsageError(f"{prog}: give at least one TEXT (quoted) or --from VAR")
        handle = self._handle(args.target, prog)
        with library_errors(prog):
            vectors = handle.embed(texts, pooling=args.pooling, normalize=args.normalize)
        norm = "normalized" if args.normalize else "not normalized"
        stored = f" -> {args.var} and _" if args.var else " -> _"
        print(f"{prog} {args.target}: array of shape {vectors.shape}, float32, "
              f"{args.pooling or 'the model pooling'}, {norm}{stored}")
        self._result(vectors, args.var)

    @subcommand(
        "bench",
        usage="%llm bench [A] B [--prompt TEXT ...] [--max-tokens N] [--rounds N] [--warmup N] [--as VAR]",
        description="Paired benchmark of two handles: the same prompts on both, ABBA order, warm-up rounds dropped, "
        "a progress bar over the requests. Shows medians with min/max and the ratio to A (first_token_ms, "
        "decode_tokens_per_s, total_ms) and, per prompt, whether B's output is identical to A's; the BenchResult "
        "goes to VAR and _. With one name, A is the default handle.",
        python="from aner_nb import bench; from aner_nb.magics import bench_table, bench_outputs; "
        "VAR = bench.run_sides([bench.lease_side('A', A), bench.lease_side('B', B)], "
        "[bench.Case('p1', TEXT, max_tokens=N)], rounds=N, warmup=N, baseline='A', manifest_=bench.manifest(B), "
        "progress=None); "
        "bench_table(VAR); bench_outputs(VAR)",
    )
    @argument("a", metavar="A", help="the baseline handle (a lease)")
    @argument("b", metavar="B", nargs="?", help="the handle compared with A (a lease)")
    @argument("--prompt", dest="prompts", action="append", metavar="TEXT",
              help="a prompt (repeatable; {var} is replaced by the variable's value; "
              "default: one short built-in prompt)")
    @argument("--max-tokens", type=int_arg, metavar="N", default=64, help="tokens per request (default 64)")
    @argument("--rounds", type=int_arg, metavar="N", default=3, help="measured rounds (default 3)")
    @argument("--warmup", type=int_arg, metavar="N", default=1, help="warm-up rounds, dropped (default 1)")
    @argument("--as", dest="var", metavar="VAR", help="also store the BenchResult in this variable")
    def _llm_bench(self, args: Any) -> None:
        prog = "%llm bench"
        prompts = self._bench_arguments(args, prog)
        leases = [self._bench_lease(name, prog) for name in (args.a, args.b)]
        from .. import bench

        cases = [bench.Case(f"p{i}", text, max_tokens=args.max_tokens) for i, text in enumerate(prompts, 1)]
        sides = [bench.lease_side(args.a, leases[0]), bench.lease_side(args.b, leases[1])]
        threads = _report_threads(bench, prog, {args.a: leases[0], args.b: leases[1]})
        with library_errors(prog):
            result = bench.run_sides(sides, cases, rounds=args.rounds, warmup=args.warmup, baseline=args.a,
                                     manifest_=bench.manifest(leases[1], baseline_settings=threads[args.a].as_dict()),
                                     progress=None)
        del leases, sides
        from IPython.display import display

        display(bench_table(result))
        display(bench_outputs(result))
        self._result(result, args.var)

    def _bench_arguments(self, args: Any, prog: str) -> list[str]:
        """Check ``%llm bench``'s arguments (one name: B against the default handle); returns the prompts."""
        if args.b is None:  # one name: it is B, compared with the default handle
            args.a, args.b = self._default_name(prog, "B"), args.a
            print(f"{prog} {args.a} {args.b}  ({args.a} is the default handle)")
        if args.a == args.b:
            raise UsageError(f"{prog}: A and B are both {args.a!r}; name two different handles")
        for flag, value, least in (("--rounds", args.rounds, 1), ("--warmup", args.warmup, 0),
                                   ("--max-tokens", args.max_tokens, 1)):
            if value < least:
                raise UsageError(f"{prog}: {flag} must be >= {least}, got {value}")
        if args.var is not None:
            check_name(args.var, prog, "--as")
        prompts = args.prompts if args.prompts else [BENCH_PROMPT]  # {var} was expanded by IPython already
        if any(not p.strip() for p in prompts):
            raise UsageError(f"{prog}: --prompt must not be empty")
        return prompts

    def _bench_lease(self, name: str, prog: str) -> Any:
        handle = self._handle(name, prog)
        if handle.kind == "session":
            raise UsageError(f"{prog}: {name!r} is a {handle_kind(handle)}; bench compares leases")
        if handle.closed:
            raise UsageError(f"{prog}: {name!r} is closed")
        return handle


def _report_threads(bench: Any, prog: str, leases: dict[str, Any]) -> dict[str, Any]:
    """Print both leases' thread counts (and warn when they differ); returns their engine settings
    (:class:`aner_nb.bench.LeaseSettings` by name).

    llama.cpp decodes one-token steps on n_threads and every batch on n_threads_batch: a
    comparison is fair only at equal counts, so both are printed and a difference is named.
    """
    threads = {name: bench.lease_settings(lease) for name, lease in leases.items()}
    counts = {name: (t.n_threads, t.n_threads_batch) for name, t in threads.items()}
    print("threads (decode/batch): " + ", ".join(f"{n} {d}/{b}" for n, (d, b) in counts.items()))
    if len(set(counts.values())) > 1:
        print(f"{prog}: the two leases run with different threads; the ratios compare thread counts too "
              "(derive both with with_optimizer(threads=T, prefill_threads=T))")
    return threads
