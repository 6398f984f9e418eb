"""Each magic's grammar sits on its handler (IPython's ``magic_arguments`` habit): declaration, parsing, help."""

from __future__ import annotations

import argparse

import pytest
from IPython.core.error import UsageError

from aner_nb.magics.magics import CELL_GRAMMARS, COMMANDS, OVERVIEW, SUBCOMMANDS, LLMMagics
from aner_nb.magics.parser import HelpShown, argument, arguments, grammar_of, int_arg, parse_llm, subcommand


def _demo():
    @subcommand("demo", usage="%llm demo NAME [--n N]", description="A demo.", python="demo(NAME, n=N)")
    @argument("target", metavar="NAME")
    @argument("--n", type=int_arg, metavar="N", default=1, help="how many")
    @arguments(lambda p: p.add_argument("--flag", action="store_true"))
    def handler(self, args):
        return args

    return handler


def test_a_grammar_is_declared_on_its_handler_top_to_bottom(capsys):
    grammar = grammar_of(_demo())
    assert grammar.prog == "%llm demo" and grammar.name == "demo"
    assert grammar.parse(["x", "--n", "3", "--flag"]) == argparse.Namespace(target="x", n=3, flag=True)
    text = grammar.format_help()
    assert text.startswith("usage: %llm demo NAME [--n N]\n\nA demo.")
    assert text.index("NAME") < text.index("--n N") < text.index("--flag")
    assert text.rstrip().endswith("Python equivalent:\n  demo(NAME, n=N)")
    with pytest.raises(UsageError, match=r"^%llm demo: argument --n: invalid int value: 'x' \(see `%llm demo -h`\)$"):
        grammar.parse(["x", "--n", "x"])
    with pytest.raises(HelpShown):
        grammar.parse(["-h"])
    assert "Python equivalent" in capsys.readouterr().out


def test_parse_llm_dispatches_on_the_declared_subcommands():
    commands = {"demo": grammar_of(_demo())}
    assert parse_llm("demo y", commands) == ("demo", argparse.Namespace(target="y", n=1, flag=False))
    assert parse_llm("", commands) == parse_llm("-h", commands) == ("help", argparse.Namespace(topic=None))
    with pytest.raises(UsageError, match="unknown subcommand 'dem'; did you mean 'demo'\\? use one of: demo$"):
        parse_llm("dem y", commands)
    with pytest.raises(UsageError, match="check the quotes"):
        parse_llm('demo "y', commands)


def test_every_magic_of_llmmagics_carries_its_grammar():
    assert SUBCOMMANDS == (
        "models", "load", "optimize", "batch", "adapter", "pool", "list", "use", "chat", "save", "info", "kv", "embed",
        "close",
        "serve", "stop", "bench", "help",
    )  # the order of the methods is the order %llm help lists them
    for name, grammar in COMMANDS.items():
        assert grammar.prog == f"%llm {name}" and grammar_of(vars(LLMMagics)[f"_llm_{name}"]) is grammar
        assert f"    Python: {grammar.python}" in OVERVIEW
    assert list(CELL_GRAMMARS) == ["generate", "chat"]
    for name, grammar in CELL_GRAMMARS.items():
        assert grammar_of(vars(LLMMagics)[name]) is grammar and vars(LLMMagics)[name].__doc__ == grammar.format_help()
    assert LLMMagics.llm.__doc__ == OVERVIEW
