"""``python -m aner_nb demo``: load the demo model, answer one prompt, print the measurements."""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from . import llm
from .demo_model import DEMO_CHAT_TEMPLATE, demo_model_path

DEFAULT_PROMPT = "What are the three primary colors of paint?"


def run_demo(prompt: str = DEFAULT_PROMPT, *, max_tokens: int = 48, context: int = 2048, out=None) -> llm.Response:
    """Load, generate, print; returns the Response so callers (tests, notebooks) can check it."""
    out = out or sys.stdout
    path = demo_model_path()
    with llm.load(path, context=context, chat_template=DEMO_CHAT_TEMPLATE) as model:
        print(f"model  : {model!r}", file=out)
        print(f"prompt : {prompt}", file=out)
        print("answer : ", end="", file=out, flush=True)
        stream = model.stream(prompt, max_tokens=max_tokens)
        for piece in stream:
            print(piece, end="", file=out, flush=True)
        print("\n", file=out)
        response = stream.response
        assert response is not None
        frame = response.to_frame().T.rename(columns={0: "value"})
        print("timings (ns, counts; <NA> = not measured):", file=out)
        print(frame.to_string(), file=out)
        print(f"\ntokens/s (decode): {response.tokens_per_second():.1f}\n", file=out)
        load = pd.Series(model.load_summary().as_dict(), name="value").to_frame()
        print("load:", file=out)
        print(load.to_string(), file=out)
        print("\nmemory:", file=out)
        print(model.memory_summary().to_frame().to_string(), file=out)
    return response


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aner_nb demo", description=__doc__)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--context", type=int, default=2048)
    args = parser.parse_args(argv)
    run_demo(args.prompt, max_tokens=args.max_tokens, context=args.context)
    return 0
