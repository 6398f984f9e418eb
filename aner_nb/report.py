"""``python -m aner_nb report``: run a tutorial notebook headless and leave an HTML report.

The notebook (``notebooks/01_quickstart.ipynb`` by default) is executed top to
bottom in a fresh kernel of *this* Python (whatever kernelspecs the machine
has), with the widget state stored, then written next to the executed
notebook as HTML::

    reports/01_quickstart.ipynb   the executed notebook (outputs and widget state)
    reports/01_quickstart.html    the report: open it in a browser

Widgets in the HTML are rendered by the ipywidgets HTML manager, which the page
loads from a CDN. Every dashboard of ``aner_nb.widgets`` also carries a static
HTML view; the report shows that view under each widget and hides it once the
live widget has rendered, so the page is complete offline too.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_NOTEBOOK", "KernelDiedError", "find_notebook", "execute_notebook", "export_html", "run_report", "main",
]

DEFAULT_NOTEBOOK = "01_quickstart.ipynb"
_KERNEL_NAME = "aner-nb-current-python"

# The lab template, plus each widget's static fallback (hidden once the live widget renders).
_TEMPLATE = r"""
{%- extends 'index.html.j2' -%}
{%- block data_widget_view scoped %}
{{ super() }}
{%- if 'text/html' in output.data %}
<div class="aner-static-fallback jp-RenderedHTMLCommon jp-RenderedHTML jp-OutputArea-output">
{{ output.data['text/html'] }}
</div>
<script type="text/javascript">
(function () {
  var fallback = document.currentScript.previousElementSibling;
  var view = fallback && fallback.previousElementSibling;
  if (!view || typeof MutationObserver === 'undefined') { return; }
  var observer = new MutationObserver(function () {
    if (view.querySelector('.lm-Widget, .p-Widget, .jupyter-widgets-view')) {
      fallback.style.display = 'none';
      observer.disconnect();
    }
  });
  observer.observe(view, {childList: true, subtree: true});
})();
</script>
{%- endif %}
{%- endblock data_widget_view %}
"""


class KernelDiedError(RuntimeError):
    """The notebook's kernel process ended while a cell ran; names the cell and the signal."""


def find_notebook(name: str = DEFAULT_NOTEBOOK) -> Path:
    """``name`` as a path, else under ``./notebooks``, else under the source checkout's ``notebooks/``."""
    direct = Path(name)
    candidates = [direct, Path.cwd() / "notebooks" / name, Path(__file__).resolve().parents[1] / "notebooks" / name]
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise FileNotFoundError(
        f"notebook {name!r} not found (looked at {', '.join(str(c) for c in candidates)}); "
        "run from a checkout of the repository or pass --notebook PATH"
    )


def _kernel_manager_class() -> Any:
    """An async kernel manager whose kernel is this interpreter, independent of installed kernelspecs.

    Async, so nbclient never blocks its event loop on a read from a kernel that
    died (the blocking client waits on iopub forever and no liveness check runs).
    """
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class _ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
            if kernel_name == _KERNEL_NAME:
                return KernelSpec(
                    argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    display_name=f"Python {sys.version_info.major}.{sys.version_info.minor} ({sys.executable})",
                    language="python",
                    resource_dir="",
                )
            return super().get_kernel_spec(kernel_name)

    class ThisPythonKernelManager(AsyncKernelManager):
        @default("kernel_spec_manager")
        def _default_kernel_spec_manager(self) -> KernelSpecManager:
            return _ThisPython()

    return ThisPythonKernelManager


def _exit_description(km: Any) -> str:
    """How the kernel process ended: "SIGILL (signal 4)", "exit status 1", or "" if unknown."""
    import signal

    process = getattr(getattr(km, "provisioner", None), "process", None)
    code = process.poll() if process is not None else None
    if code is None:
        return ""
    if code < 0:
        try:
            return f"{signal.Signals(-code).name} (signal {-code})"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _client(nb: Any, **kwargs: Any) -> Any:
    """An nbclient ``NotebookClient`` that notices a dead kernel process within about a second.

    nbclient polls the kernel's heartbeat once a second; a kernel killed by a
    signal is also caught by asking the process itself (``is_alive``, a
    ``waitpid``), and how it ended is kept for the error message.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError
    from nbclient.util import ensure_async

    class WatchedClient(NotebookClient):
        kernel_exit = ""

        async def _async_check_alive(self) -> None:
            if self.km is not None and not await ensure_async(self.km.is_alive()):
                self.kernel_exit = _exit_description(self.km)
                raise DeadKernelError("Kernel died")
            await super()._async_check_alive()

    return WatchedClient(nb, kernel_manager_class=_kernel_manager_class(), kernel_name=_KERNEL_NAME, **kwargs)


def execute_notebook(path: Path, *, timeout: int = 900) -> Any:
    """Run every cell of ``path`` in a fresh kernel (cwd: the notebook's folder); returns the notebook.

    Raises :class:`KernelDiedError` naming the cell and the signal when the kernel dies.
    """
    import nbformat
    from nbclient.exceptions import DeadKernelError

    nb = nbformat.read(path, as_version=4)
    running: dict[str, Any] = {}

    def on_cell_execute(cell: Any, cell_index: int) -> None:
        running.update(cell=cell, index=cell_index)

    client = _client(
        nb,
        timeout=timeout,
        store_widget_state=True,
        resources={"metadata": {"path": str(path.parent)}},
        on_cell_execute=on_cell_execute,
    )
    try:
        client.execute()
    except DeadKernelError as exc:
        how = client.kernel_exit or "an unknown cause"
        cell = running.get("cell")
        first_line = cell.source.strip().splitlines()[0][:80] if cell is not None and cell.source.strip() else ""
        where = f"cell {running['index'] + 1} ({first_line!r})" if cell is not None else "start-up"
        raise KernelDiedError(f"{path.name}: the kernel died by {how} while running {where}") from exc
    return nb


def export_html(nb: Any) -> str:
    """The notebook as a standalone HTML page with widget state and static fallbacks."""
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(
        template_name="lab",
        extra_loaders=[DictLoader({"aner_report.html.j2": _TEMPLATE})],
        template_file="aner_report.html.j2",
    )
    body, _ = exporter.from_notebook_node(nb)
    return body


def run_report(notebook: str = DEFAULT_NOTEBOOK, output_dir: str = "reports", *, timeout: int = 900, out: Any = None) -> Path:
    """Execute ``notebook`` headless, write the executed notebook and its HTML; returns the HTML path."""
    import nbformat

    out = out or sys.stdout
    source = find_notebook(notebook)
    target = Path(output_dir)
    target.mkdir(parents=True, exist_ok=True)
    print(f"executing {source} ...", file=out, flush=True)
    t0 = time.perf_counter()
    nb = execute_notebook(source, timeout=timeout)
    elapsed = time.perf_counter() - t0
    executed = target / source.name
    nbformat.write(nb, executed)
    html_path = (target / source.name).with_suffix(".html")
    html_path.write_text(export_html(nb), encoding="utf-8")
    widgets = len(nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {}))
    print(f"executed in {elapsed:.1f} s; {widgets} widget model(s) saved with the report", file=out)
    print(f"notebook: {executed.resolve()}", file=out)
    print(f"report  : {html_path.resolve()}", file=out, flush=True)
    return html_path.resolve()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aner_nb report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--notebook", default=DEFAULT_NOTEBOOK,
                        help=f"a notebook path, or a name under notebooks/ (default {DEFAULT_NOTEBOOK})")
    parser.add_argument("--output-dir", default="reports", help="where the executed notebook and HTML go (default reports/)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds allowed per cell (default 900)")
    args = parser.parse_args(argv)
    try:
        run_report(args.notebook, args.output_dir, timeout=args.timeout)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KernelDiedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
