"""Which real model a benchmark loads: ``--model smollm2``, ``--model gemma`` or a GGUF path.

- ``smollm2``: SmolLM2-135M-Instruct, the default demo model (llama
  architecture, full attention, 49,152-token vocabulary, its ChatML template
  embedded). The default of every benchmark whose claim holds for any model.
- ``gemma``: Gemma 3 270M (gemma3, sliding-window attention on five of six
  layers, 262,144-token vocabulary, a base model loaded with the built-in
  ``gemma`` template). The default where a benchmark's claim is about
  sliding-window attention or a large vocabulary's costs (each says why in its
  docstring); the sections of ``RESULTS.md`` measured before this option
  existed ran on it, and each names its model.
- a path: any admitted GGUF file, with its embedded template.

A benchmark's ``--chat-template``, where it has one, replaces the template.

Every benchmark prints :func:`header` first and records :func:`manifest_fields`
(the choice, the model's name and SHA-256) in its JSON manifest next to what
``aner_nb.bench.manifest`` records of the lease.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SMOLLM2 = "smollm2"
GEMMA = "gemma"
CHOICES = (SMOLLM2, GEMMA)


@dataclass(frozen=True)
class ModelChoice:
    """A resolved ``--model``: what was asked for, the file and the template to load it with."""

    choice: str  # "smollm2", "gemma" or "path"
    label: str  # the model's short name (the file name for a path)
    path: str
    chat_template: str | None  # None: the model's embedded template

    def load(self, **options: Any):
        """``llm.load`` of this model with its template (``options``: context, flash_attention...)."""
        from aner_nb import llm

        return llm.load(self.path, chat_template=self.chat_template, **options)


def add_model_option(parser: argparse.ArgumentParser, default: str, why: str = "") -> None:
    """``--model`` on ``parser``: smollm2, gemma or a GGUF path, defaulting to ``default``."""
    reason = f" ({why})" if why else ""
    parser.add_argument("--model", default=default, metavar="smollm2|gemma|PATH",
                        help=f"the model to measure: {SMOLLM2} (SmolLM2-135M-Instruct), {GEMMA} (Gemma 3 270M) "
                             f"or a GGUF path; default {default}{reason}")


def resolve(value: str, chat_template: str | None = None) -> ModelChoice:
    """The model ``--model value`` names; ``chat_template`` (``--chat-template``) replaces its template."""
    key = value.strip().lower()
    if key == SMOLLM2:
        from aner_nb.demo_model import SMOLLM2 as model, demo_model_path

        return ModelChoice(SMOLLM2, model.name, str(demo_model_path()), chat_template or model.chat_template)
    if key == GEMMA:
        from aner_nb.demo_model import GEMMA3, GEMMA_CHAT_TEMPLATE, gemma_model_path

        return ModelChoice(GEMMA, GEMMA3.name, str(gemma_model_path()), chat_template or GEMMA_CHAT_TEMPLATE)
    path = Path(value).expanduser().resolve()
    if not path.is_file():
        raise SystemExit(f"--model {value!r}: neither {SMOLLM2!r}, {GEMMA!r} nor a GGUF file")
    return ModelChoice("path", path.name, str(path), chat_template)


def header(choice: ModelChoice, lease: Any = None, fingerprint: str | None = None) -> str:
    """The line a benchmark prints first: which model (choice, name, file) and its SHA-256."""
    digest = fingerprint or (lease.fingerprint if lease is not None else None)
    name = f"{lease.name!r} {lease.architecture}" if lease is not None else choice.label
    return f"model ({choice.choice}): {name}, file {Path(choice.path).name}, sha256 {digest or '?'}"


def manifest_fields(choice: ModelChoice, lease: Any = None, fingerprint: str | None = None) -> dict[str, Any]:
    """What a JSON manifest records of the model choice (``bench.manifest`` adds the lease's settings)."""
    return {"model_choice": {
        "choice": choice.choice, "label": choice.label, "file": Path(choice.path).name,
        "sha256": fingerprint or (lease.fingerprint if lease is not None else None),
        "chat_template": choice.chat_template or "embedded",
    }}
