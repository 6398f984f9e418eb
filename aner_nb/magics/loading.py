"""``%llm load``, the builders (``optimize``, ``batch``, ``adapter``, ``pool``), ``list``, ``use``, ``close``.

Making handles and letting them go. Without ``--as`` a new handle gets a
name derived from the model (or from its source handle); the line printed
says which (:mod:`aner_nb.magics.naming`).
"""

from __future__ import annotations

import os
from typing import Any

from IPython.core.error import UsageError

from ..llm import KV_CACHE_TYPES, load
from ..llm.profiles import CPU_EXTRA_BUFFERS, FLASH_ATTENTION
from .base import NEW_HANDLE, SOURCE, MagicsBase, library_errors
from .naming import identifier
from .parser import argument, arguments, check_name, int_arg, subcommand
from .tables import is_handle

__all__ = ["LoadingMagics", "OPTIMIZER"]

# %llm optimize's options: with_optimizer's keyword arguments, each --key-with-dashes N.
OPTIMIZER = ("threads", "prefill_threads", "batch_tokens", "micro_batch_tokens",
             "prefix_cache_entries", "prefix_cache_tokens", "speculative_tokens")

# The prefix tiers' options, on %llm optimize and %llm batch: --prefix-cache-ram-bytes N,
# --prefix-cache-dir DIR, --prefix-cache-disk-bytes N (with_optimizer / with_batching keywords).
TIER_OPTIONS = ("prefix_cache_ram_bytes", "prefix_cache_dir", "prefix_cache_disk_bytes")
_TIER_USAGE = "[--prefix-cache-ram-bytes N] [--prefix-cache-dir DIR] [--prefix-cache-disk-bytes N]"
_TIER_PYTHON = "prefix_cache_ram_bytes=N, prefix_cache_dir=DIR, prefix_cache_disk_bytes=N"


def _tier_arguments(p: Any) -> list[Any]:
    return [
        p.add_argument("--prefix-cache-ram-bytes", type=int_arg, metavar="N",
                       help="keep prefixes evicted from live KV in host RAM, at most N bytes (default 0: off)"),
        p.add_argument("--prefix-cache-dir", metavar="DIR",
                       help="keep retained prefixes in DIR too, so a restarted kernel restores them (default: off)"),
        p.add_argument("--prefix-cache-disk-bytes", type=int_arg, metavar="N",
                       help="at most N bytes in --prefix-cache-dir (default 4 GiB)"),
    ]


def _tier_settings(args: Any) -> dict[str, Any]:
    out = {k: getattr(args, k) for k in TIER_OPTIONS if getattr(args, k) is not None}
    if "prefix_cache_dir" in out:
        out["prefix_cache_dir"] = os.path.expanduser(out["prefix_cache_dir"])
    return out


_LOAD_OPTIONS = ("context", "device", "kv_cache_type", "flash_attention", "chat_template", "cpu_extra_buffers")


def _derives(sub: str, method: str, option: str, suffix: str, *, description: str) -> Any:
    """The handler of ``%llm SUB SRC [--as NAME] --OPTION N``: ``NAME = SRC.METHOD(N)``, with its grammar."""
    flag = f"--{option.replace('_', '-')}"

    @subcommand(sub, usage=f"%llm {sub} SRC [--as NAME] {flag} N", description=description,
                python=f"NAME = SRC.{method}(N)")
    @SOURCE
    @NEW_HANDLE
    @argument(flag, type=int_arg, metavar="N", required=True)
    def handler(self: "LoadingMagics", args: Any) -> None:
        self._derive(sub, args.src, args.name, suffix, method, getattr(args, option))

    return handler


def _auto(name: str, given: str | None) -> str:
    """The note after a name the magic chose."""
    return "" if given is not None else f"\n(no --as: the handle is named {name}; choose one with --as NAME)"


class LoadingMagics(MagicsBase):
    """Handlers that make, list, choose and close handles."""

    @subcommand(
        "load",
        usage="%llm load PATH [--as NAME] [--context N] [--device D] [--kv-cache-type T] "
        "[--flash-attention P] [--chat-template T] [--cpu-extra-buffers B] [--no-warmup]",
        description="Admit, hash, load and warm up a GGUF model (a path, or a name %llm models lists), with "
        "progress bars; the line it prints times each phase. Without --as the handle is named after the model. "
        "Re-running with the same NAME closes the previous NAME first.",
        python="NAME = llm.load(PATH, context=N, device=D, kv_cache_type=T, flash_attention=P, chat_template=T, "
        "cpu_extra_buffers=B, warmup=True, progress=None)",
    )
    @argument("path", metavar="PATH", help="a single-file GGUF text model, or a model name (%%llm models)")
    @NEW_HANDLE
    @argument("--context", type=int_arg, metavar="N", help="context tokens (default 4096)")
    @argument("--device", metavar="D", help="auto, cpu, cuda, cuda:0, metal (default auto)")
    @argument("--kv-cache-type", choices=KV_CACHE_TYPES, help="KV cache type (default f16)")
    @argument("--flash-attention", choices=FLASH_ATTENTION, help="flash attention (default auto)")
    @argument("--chat-template", metavar="T", help="a built-in template name (e.g. gemma) or a Jinja string")
    @argument("--cpu-extra-buffers", choices=CPU_EXTRA_BUFFERS,
              help="AMX/repack weight buffers (default auto: probed once per CPU and build)")
    @argument("--no-warmup", dest="warmup", action="store_false",
              help="skip the warm-up decode (the first request then pays the page-in in its prefill)")
    def _llm_load(self, args: Any) -> None:
        key = ("load", args.path)
        if args.name is not None:
            name = check_name(args.name, "%llm load")
        else:
            name = self.claims.choose(identifier(args.path), key, self.ns)
        kwargs = {k: getattr(args, k) for k in _LOAD_OPTIONS if getattr(args, k) is not None}
        previous = self.ns.get(name)
        if is_handle(previous):
            self.handles.close(previous)  # first, so two copies of the weights never coexist
        del previous
        with library_errors("%llm load"):
            handle = load(os.path.expanduser(args.path), warmup=args.warmup, **kwargs)
        self._bind_new(name, handle, claim=key if args.name is None else None)
        print(f"{name} = {handle!r}  ({_load_phases(handle.load_summary())}){_auto(name, args.name)}")

    def _derive(self, sub: str, src_name: str, name: str | None, suffix: str, method: str,
                *args: Any, **kwargs: Any) -> None:
        """``NAME = SRC.METHOD(*args, **kwargs)``; without a name, ``SRC_SUFFIX`` (made unique)."""
        if name is not None:
            check_name(name, f"%llm {sub}")
        src = self._handle(src_name, f"%llm {sub}")
        key = (sub, src_name, suffix)
        chosen = name if name is not None else self.claims.choose(f"{src_name}_{suffix}", key, self.ns)
        with library_errors(f"%llm {sub}"):  # a session or batching lease rejects builders itself
            derived = getattr(src, method)(*args, **kwargs)
        self._bind_new(chosen, derived, claim=key if name is None else None)
        print(f"{chosen} = {derived!r}{_auto(chosen, name)}")

    @subcommand(
        "optimize",
        usage="%llm optimize SRC [--as NAME] [--threads N] [--prefill-threads N] [--batch-tokens N] "
        "[--micro-batch-tokens N] [--prefix-cache-entries N] [--prefix-cache-tokens N] [--speculative-tokens N] "
        + _TIER_USAGE,
        description="Derive a latency-profile lease (threads, batch sizes, prefix cache, prompt lookup) "
        "on the same weights (default NAME: SRC_latency).",
        python="NAME = SRC.with_optimizer(threads=N, prefill_threads=N, batch_tokens=N, micro_batch_tokens=N, "
        "prefix_cache_entries=N, prefix_cache_tokens=N, speculative_tokens=N, " + _TIER_PYTHON + ")",
    )
    @SOURCE
    @NEW_HANDLE
    @arguments(lambda p: [p.add_argument(f"--{k.replace('_', '-')}", type=int_arg, metavar="N") for k in OPTIMIZER])
    @arguments(_tier_arguments)
    def _llm_optimize(self, args: Any) -> None:
        settings = {k: getattr(args, k) for k in OPTIMIZER if getattr(args, k) is not None}
        settings.update(_tier_settings(args))
        self._derive("optimize", args.src, args.name, "latency", "with_optimizer", **settings)

    @subcommand(
        "batch",
        usage="%llm batch SRC [--as NAME] --max-sequences N [--prefix-cache-entries N] [--prefix-cache-tokens N] "
        "[--speculative-tokens N] " + _TIER_USAGE,
        description="Derive a continuous-batching (throughput) lease serving up to N sequences at once "
        "(default NAME: SRC_batch); with --prefix-cache-entries, evaluated prompt prefixes (a shared system "
        "prompt) are kept and copied into later requests instead of evaluated again; with --speculative-tokens, "
        "plain greedy requests verify prompt-lookup proposals where the measured row costs say they pay.",
        python="NAME = SRC.with_batching(N, prefix_cache_entries=N, prefix_cache_tokens=N, speculative_tokens=N, "
        + _TIER_PYTHON + ")",
    )
    @SOURCE
    @NEW_HANDLE
    @argument("--max-sequences", type=int_arg, metavar="N", required=True)
    @argument("--prefix-cache-entries", type=int_arg, metavar="N")
    @argument("--prefix-cache-tokens", type=int_arg, metavar="N")
    @argument("--speculative-tokens", type=int_arg, metavar="N")
    @arguments(_tier_arguments)
    def _llm_batch(self, args: Any) -> None:
        settings = {k: getattr(args, k) for k in ("prefix_cache_entries", "prefix_cache_tokens", "speculative_tokens")
                    if getattr(args, k) is not None}
        settings.update(_tier_settings(args))
        self._derive("batch", args.src, args.name, "batch", "with_batching", args.max_sequences, **settings)

    @subcommand(
        "adapter",
        usage="%llm adapter SRC MANIFEST [--as NAME]",
        description="Derive a lease with the LoRA adapter described by MANIFEST (default NAME: SRC_<manifest stem>).",
        python="NAME = SRC.with_adapter(MANIFEST)",
    )
    @SOURCE
    @argument("manifest", metavar="MANIFEST", help="the adapter manifest file")
    @NEW_HANDLE
    def _llm_adapter(self, args: Any) -> None:
        suffix = identifier(args.manifest, "adapter").rstrip("_")
        self._derive("adapter", args.src, args.name, suffix, "with_adapter", os.path.expanduser(args.manifest))

    _llm_pool = _derives(
        "pool", "with_context_pool", "max_idle", "pool",
        description="Derive a lease that keeps up to N (0..4) idle contexts between requests (default NAME: SRC_pool).",
    )

    @subcommand(
        "list",
        usage="%llm list",
        description="A DataFrame of the live handles: name, kind, architecture, profile, device, context, "
        "fingerprint, state.",
        python="from aner_nb.magics import handle_table; handle_table(globals())",
    )
    def _llm_list(self, args: Any) -> Any:
        return self.handles.table()

    @subcommand(
        "use",
        usage="%llm use [NAME | --none]",
        description="Make NAME the default handle: %%generate, %%chat and %llm info / kv / bench without a NAME use "
        "it, and say so in their output. Without NAME, show the default.",
        python="%config LLMMagics.default_handle = 'NAME'   # in Python, call the handle itself: NAME.generate(...)",
    )
    @argument("target", metavar="NAME", nargs="?")
    @argument("--none", dest="clear", action="store_true", help="forget the default handle")
    def _llm_use(self, args: Any) -> None:
        if args.clear and args.target is not None:
            raise UsageError("%llm use: give NAME or --none, not both")
        if args.target is not None:
            self._handle(args.target, "%llm use")
            self.default_handle = args.target
        elif args.clear:
            self.default_handle = ""
        if self.default_handle:
            print(f"default handle: {self.default_handle}")
            return
        latest = self.handles.latest() if self.default_to_latest else None
        print(f"no default handle; the latest handle answers: {latest}" if latest else
              "no default handle: name one in each cell, or %llm use NAME")

    @subcommand(
        "close",
        usage="%llm close NAME [NAME ...] | --all",
        description="Close handles (and the %%chat sessions and %llm chat boxes opened on them); weights are freed "
        "when no lease uses them.",
        python="NAME.close()",
    )
    @argument("targets", metavar="NAME", nargs="*")
    @argument("--all", action="store_true", help="close every handle the extension tracks")
    def _llm_close(self, args: Any) -> None:
        if args.all == bool(args.targets):
            raise UsageError("%llm close: name the handles to close, or give --all (not both)")
        if args.all:
            print(f"closed {self.handles.close_all()} handle(s)")
            return
        targets = [self._handle(name, "%llm close") for name in args.targets]  # a typo closes nothing
        for handle in targets:
            self.handles.close(handle)
        print(f"closed {', '.join(args.targets)}")


def _load_phases(summary: Any) -> str:
    """The load line's timings: the total, then each phase (the first hash pass ran alongside the load)."""

    def sec(ns: int) -> str:
        return f"{ns / 1e9:.2f} s"

    warm = f"warm-up {sec(summary.warmup_duration)}" if summary.warmup_duration >= 0 else "warm-up skipped"
    return (f"loaded and SHA-256 verified in {sec(summary.total_duration)}: hash {sec(summary.hash_duration)} "
            f"alongside load {sec(summary.load_duration)}, verify {sec(summary.verify_duration)}, {warm}")
