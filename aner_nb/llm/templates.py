"""The built-in chat templates, and the one each admitted architecture uses when its file has none.

Each is written out after its family's published template (the comment above it names the source
and where it differs); ``chat.resolve_template`` picks one by name.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

__all__ = ["BUILTIN_TEMPLATES", "FAMILY_TEMPLATES", "builtin_names"]

# ChatML (Qwen, many fine-tunes): "<|im_start|>{role}\n{content}<|im_end|>\n"
# per message, then "<|im_start|>assistant\n" to prompt the answer.
_CHATML = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def _system_first_alternating(family: str) -> str:
    """Jinja opening of the formats with no system turn (Gemma, Mistral).

    A leading system message becomes ``first_user_prefix`` (its content and
    "\n\n", for the first user turn); ``loop_messages`` are the rest, which
    must alternate user/assistant, starting with user. A system message
    anywhere else, or one with no user turn after it, is an error.
    """
    return r"""
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
    {%- if not loop_messages -%}
        {{ raise_exception("FAMILY needs a user message after the system message") }}
    {%- endif -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if message['role'] == 'system' -%}
        {{ raise_exception("FAMILY accepts a system message only as the first message") }}
    {%- endif -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}""".replace("FAMILY", family)


# Gemma (2 and 3), text only, as Google's official template: BOS, turns
# "<start_of_turn>{user|model}\n{content|trim}<end_of_turn>\n", a leading
# system message prepended to the first user turn followed by "\n\n", strict
# user/model alternation. Stricter than the official one in two error cases it
# would otherwise render silently: a system message that is not first, or one
# with no user turn after it. An empty ``bos_token`` falls back to "<bos>",
# Gemma's BOS text, because the format requires it.
_GEMMA = r"""{{ bos_token if bos_token else '<bos>' }}""" + _system_first_alternating("Gemma") + r"""
    {%- if message['role'] == 'assistant' -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}"""

# Llama 3 / 3.x Instruct, as Meta's template without tools: BOS, then
# "<|start_header_id|>{role}<|end_header_id|>\n\n{content|trim}<|eot_id|>" per
# message. An empty ``bos_token`` falls back to "<|begin_of_text|>".
_LLAMA3 = (
    "{{- bos_token if bos_token else '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + (message['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif -%}"
)

# Mistral Instruct [INST] format, as the official template of Mistral-7B-Instruct-v0.2 and
# Mixtral-8x7B-Instruct-v0.1: BOS, "[INST] {user} [/INST]", "{assistant}</s>", strict
# alternation. The official template rejects a system message; here a leading one is prepended
# to the first user turn followed by "\n\n", as Mistral's v1 format places it. Empty
# ``bos_token``/``eos_token`` fall back to "<s>"/"</s>".
_MISTRAL = r"""{{ bos_token if bos_token else '<s>' }}""" + _system_first_alternating("Mistral") + r"""
    {%- if message['role'] == 'user' -%}
        {{ '[INST] ' + (first_user_prefix if loop.first else '') + message['content'] + ' [/INST]' }}
    {%- else -%}
        {{ message['content'] + (eos_token if eos_token else '</s>') }}
    {%- endif -%}
{%- endfor -%}"""

# Phi-3, as Microsoft's template (Phi-3-mini, 2024-07 update): "<|{role}|>\n{content}<|end|>\n"
# per message, then "<|assistant|>\n" to prompt the answer; without a generation prompt it ends
# with the EOS text. No BOS. (Phi-3.5's template also drops an empty system message.)
_PHI3 = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- else -%}{{ eos_token }}{%- endif -%}"
)

#: Built-in templates by name (read-only).
BUILTIN_TEMPLATES: Mapping[str, str] = types.MappingProxyType(
    {"chatml": _CHATML, "gemma": _GEMMA, "llama3": _LLAMA3, "mistral": _MISTRAL, "phi3": _PHI3}
)

#: The built-in to pass as ``chat_template=`` for a file of each admitted architecture that has
#: none embedded. A Mistral file (architecture llama too) takes "mistral"; Qwen3's own template is
#: ChatML with thinking tags.
FAMILY_TEMPLATES: Mapping[str, str] = types.MappingProxyType(
    {"llama": "llama3", "qwen2": "chatml", "qwen3": "chatml", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}
)


def builtin_names() -> str:
    """The built-in names, comma separated (for error messages)."""
    return ", ".join(BUILTIN_TEMPLATES)
