"""``aner_nb.dask.map_frame`` on a real ``distributed.LocalCluster`` of two worker processes.

The oracle is the local ``map`` on one process (greedy): the distributed
result must equal it row for row, also when a worker is killed mid-run and
Dask re-runs its partition elsewhere.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import dask.dataframe as dd
import distributed
import pandas as pd
import pytest

from aner_nb import llm
from aner_nb.dask import map_frame as dask_map
from aner_nb.llm import _engine
from aner_nb.llm.frame_map import map_frame

ROWS = pd.DataFrame({"text": [f"ticket {i}: the app {w}" for i, w in enumerate(
    ["crashes", "is slow", "logs me out", "shows nothing", "charges twice", "forgets me", "hangs", "works"])]})


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_engine.THREADS_ENV, "1")  # the worker processes inherit it: one engine thread each
        # Dask starts its workers with multiprocessing's spawn, which reads __main__.__spec__; the IPython
        # shell of earlier tests in this process leaves a __main__ without one (a notebook kernel has it).
        if not hasattr(sys.modules["__main__"], "__spec__"):
            mp.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                      worker_dashboard_address=None) as c, distributed.Client(c) as client:
            yield c, client


def local(llama_path, prompt: str, **options) -> pd.DataFrame:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_engine.THREADS_ENV, "1")
        with llm.load(llama_path, context=1024, progress=False) as model, model.with_batching(2) as lease:
            return map_frame(lease, ROWS, prompt, **options)


def test_the_cluster_returns_exactly_the_local_result(cluster, llama_path):
    _, client = cluster
    ddf = dd.from_pandas(ROWS, npartitions=4)
    lazy = dask_map(ddf, llama_path, "Classify: {text}", max_sequences=2, client=client,
                    load_options={"context": 1024}, max_tokens=10)
    got = lazy.compute().sort_index()
    expected = local(llama_path, "Classify: {text}", max_tokens=10)
    pd.testing.assert_frame_equal(got.drop(columns=["first_token_ms", "total_ms"]),
                                  expected.drop(columns=["first_token_ms", "total_ms"]), check_dtype=False)
    assert (got["error"] == "").all()


def test_a_worker_with_another_file_refuses_it(cluster, llama_path):
    _, client = cluster
    ddf = dd.from_pandas(ROWS, npartitions=2)
    with pytest.raises(Exception, match="sha256"):
        dask_map(ddf, llama_path, "x {text}", sha256="0" * 64, client=client, load_options={"context": 1024},
                 max_tokens=2).compute()


def test_a_worker_killed_mid_run_still_yields_every_row_once(cluster, llama_path, tmp_path):
    _, client = cluster
    folder = tmp_path / "parts"
    options = dict(max_tokens=150, grammar='root ::= "a " root')
    ddf = dd.from_pandas(ROWS, npartitions=2)
    future = client.compute(dask_map(ddf, llama_path, "Go on: {text}", max_sequences=2, client=client,
                                     checkpoint_dir=folder, load_options={"context": 1024}, **options))
    deadline = time.monotonic() + 300
    while not any(p.read_text().count("\n") >= 1 for p in folder.glob("part-*.jsonl")):
        assert time.monotonic() < deadline and not future.done(), "no row finished before the run ended"
        time.sleep(0.01)
    busy = [w for w, keys in client.processing().items() if keys]
    assert busy and not future.done(), "every partition ended before a worker could be killed"
    pids = client.run(os.getpid)
    os.kill(pids[busy[0]], signal.SIGKILL)  # mid-partition: Dask re-runs it on a new worker (the nanny's)
    got = future.result(timeout=600).sort_index()
    assert got.index.equals(ROWS.index) and (got["error"] == "").all()
    keys = [(e["row"], e["key"]) for p in folder.glob("part-*.jsonl")
            for e in map(json.loads, p.read_text().splitlines())]
    assert len(keys) == len(set(keys)) == len(ROWS)  # every row once: none generated twice
    expected = local(llama_path, "Go on: {text}", **options)
    assert list(got["answer"]) == list(expected["answer"])
