"""``map`` over a Dask DataFrame: partitions run on Dask distributed workers, each with its own model.

:func:`map_frame` registers a worker plugin (:class:`ModelPlugin`) that loads
the model on every worker once, from a path and its SHA-256 (a worker whose
file has another hash refuses it; no model object is ever pickled), and holds
a batching lease on it. Each partition then runs as
:meth:`aner_nb.llm.Lease.map` on that worker's lease, so the result equals the
local ``map`` for greedy settings. With ``checkpoint_dir`` every partition
appends its finished rows to its own ``part-NNNNN.jsonl`` there: when Dask
re-runs a lost worker's partition on another worker, the rows it had already
finished are read back instead of generated twice (the directory must be
shared by the workers: one machine, or a network filesystem).

Works with a ``LocalCluster`` (one machine, ``processes=True``: each worker
process loads its own copy of the weights) and with a scheduler address
(``Client("tcp://host:8786")``); see docs/deploy.md.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Mapping

import dask.dataframe as dd
from dask.dataframe.utils import make_meta
from distributed import Client, WorkerPlugin, get_client, get_worker

from .llm import load
from .llm.artifact import sha256_file
from .llm.errors import ArtifactChangedError, ConfigurationError
from .llm.map_result import expand_schema_columns, result_frame

__all__ = ["map_frame", "ModelPlugin"]

class ModelPlugin(WorkerPlugin):
    """Loads one model on a worker (checked against its SHA-256) and keeps a batching lease on it."""

    def __init__(self, path: str, sha256: str, *, max_sequences: int, load_options: Mapping[str, Any]) -> None:
        self.path, self.sha256 = path, sha256
        self.max_sequences = max_sequences
        self.load_options = dict(load_options)
        self.base: Any = None  # the loaded model, and the batching lease on it (set on the worker)
        self.lease: Any = None

    @property
    def name(self) -> str:
        """One plugin per (file, hash, settings): registering the same again keeps the loaded model."""
        token = repr((self.path, self.sha256, self.max_sequences, sorted(self.load_options.items())))
        return "aner-nb-model-" + hashlib.sha256(token.encode()).hexdigest()[:16]

    def setup(self, worker: Any) -> None:
        model = load(self.path, progress=False, **self.load_options)
        if model.fingerprint != self.sha256:
            got = model.fingerprint
            model.close()
            raise ArtifactChangedError(
                f"{self.path} on worker {worker.address} has sha256 {got[:16]}..., not the {self.sha256[:16]}... "
                "map_frame was given; every worker needs the same file"
            )
        self.base = model
        self.lease = model.with_batching(self.max_sequences)

    def teardown(self, worker: Any) -> None:
        if self.lease is not None:
            self.lease.close()
            self.base.close()
            self.lease = None

def _run_partition(part: Any, plugin_name: str, prompt: str, checkpoint_dir: str | None, options: Mapping[str, Any],
                   partition_info: Mapping[str, Any] | None = None) -> Any:
    """One partition on this worker's lease (runs on the worker)."""
    plugin = get_worker().plugins[plugin_name]
    checkpoint = None
    if checkpoint_dir is not None and partition_info is not None:
        checkpoint = os.path.join(checkpoint_dir, f"part-{int(partition_info['number']):05d}.jsonl")
    return plugin.lease.map(part, prompt, checkpoint=checkpoint, progress=False, **options)

def _meta(ddf: Any, options: Mapping[str, Any]) -> Any:
    """The (empty) frame Dask needs to know the result's columns and types without running anything."""
    empty = result_frame(make_meta(ddf).index[:0], [])
    if options.get("expand"):
        empty = expand_schema_columns(empty, options["json_schema"])
    return empty

def map_frame(
    ddf: Any,
    model_path: "str | os.PathLike[str]",
    prompt: str,
    *,
    sha256: str | None = None,
    max_sequences: int = 4,
    checkpoint_dir: "str | os.PathLike[str] | None" = None,
    client: Client | None = None,
    load_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> Any:
    """A lazy Dask DataFrame: ``prompt`` run over every row of ``ddf`` on the workers (``.compute()`` runs it).

    ``sha256`` defaults to the hash of ``model_path`` here; every worker loads
    ``model_path`` (with ``load_options``: ``context``, ``kv_cache_type``...) and
    must find the same hash. ``options`` are :meth:`Lease.map`'s (``json_schema``,
    ``expand``, ``system``, request options such as ``max_tokens``).
    """
    if not isinstance(ddf, dd.DataFrame):
        raise ConfigurationError(f"map_frame takes a dask DataFrame, got {type(ddf).__name__}", param="ddf")
    if "checkpoint" in options:
        raise ConfigurationError("pass checkpoint_dir= (one checkpoint file per partition), not checkpoint=",
                                 param="checkpoint")
    path = str(Path(model_path).resolve())
    digest = sha256 if sha256 is not None else sha256_file(path, progress=False)
    plugin = ModelPlugin(path, digest, max_sequences=max_sequences, load_options=load_options or {})
    client = client if client is not None else get_client()
    client.register_plugin(plugin, name=plugin.name)
    folder = str(Path(checkpoint_dir).resolve()) if checkpoint_dir is not None else None
    if folder is not None:
        Path(folder).mkdir(parents=True, exist_ok=True)
    return ddf.map_partitions(_run_partition, plugin.name, prompt, folder, dict(options), meta=_meta(ddf, options))

