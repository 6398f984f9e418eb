"""Which leases the HTTP service serves, decided by the lease protocol (``kind``, ``supports``), not by names."""

from __future__ import annotations

import pytest

from aner_nb import api, llm
from aner_nb.api.runtime import Mount
from aner_nb.llm.errors import ConfigurationError


@pytest.fixture(scope="module")
def base(llama_path):
    model = llm.load(llama_path, context=512)
    yield model
    model.close()


def test_a_session_is_refused_by_its_kind(base):
    with base.session() as session:
        assert isinstance(session, llm.Lease) and session.kind == "session"
        with pytest.raises(ConfigurationError, match="session"):
            api.app("t").llm(path="/chat", model=session)


def test_capacity_and_scheduler_stats_follow_continuous_batching(base):
    ordinary = Mount(path="/a", model=base, name="a", max_concurrent=None)
    assert not base.supports("continuous_batching")
    assert ordinary.capacity == 1 and ordinary.stats() is None
    with base.with_batching(2) as batching:
        mount = Mount(path="/b", model=batching, name="b", max_concurrent=None)
        assert mount.capacity == batching.stats().max_sequences + batching.stats().queue_limit
        assert mount.stats().max_sequences == 2
        mount.shutdown()
        assert mount.stats() is None and mount.model.closed  # the mount let go of the lease
