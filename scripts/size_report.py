"""List the package's long functions and long modules (candidates for a split; nothing is enforced).

Run: ``python scripts/size_report.py [--function-lines 60] [--module-lines 600]``. A function's
length runs from its ``def`` (decorators included) to its last line, nested functions counted
in the function that holds them (and listed on their own when long themselves); a module's
length is its line count.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aner_nb"


def long_functions(limit: int) -> list[tuple[int, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parents: dict[ast.AST, ast.AST] = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = (node.end_lineno or node.lineno) - start + 1
            if length > limit:
                names, up = [node.name], parents.get(node)
                while up is not None:
                    if isinstance(up, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.insert(0, up.name)
                    up = parents.get(up)
                out.append((length, f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {'.'.join(names)}"))
    return sorted(out, reverse=True)


def long_modules(limit: int) -> list[tuple[int, str]]:
    sizes = ((len(p.read_text().splitlines()), str(p.relative_to(PACKAGE.parent))) for p in PACKAGE.rglob("*.py"))
    return sorted((s for s in sizes if s[0] > limit), reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--function-lines", type=int, default=60)
    parser.add_argument("--module-lines", type=int, default=600)
    args = parser.parse_args()
    functions, modules = long_functions(args.function_lines), long_modules(args.module_lines)
    print(f"functions over {args.function_lines} lines ({len(functions)}):")
    for length, where in functions:
        print(f"  {length:5d}  {where}")
    print(f"modules over {args.module_lines} lines ({len(modules)}):")
    for length, where in modules:
        print(f"  {length:5d}  {where}")


if __name__ == "__main__":
    main()
