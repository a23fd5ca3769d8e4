"""Fixtures: a folder of real documents with planted facts, and the embedded model behind a Service."""

from __future__ import annotations

import pytest

from tests.documents.builders import write_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    return folder, write_corpus(folder)


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    """The embedded SmolLM2-135M through the chat Service (started; stopped at the end)."""
    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.runtime.service import ServerConfig, Service

    loaded = load_model(None, EngineConfig(threads=2), progress=False)
    svc = Service(loaded, ServerConfig(sessions_path=tmp_path_factory.mktemp("sessions") / "s.db",
                                       documents_roots=(tmp_path_factory.getbasetemp().resolve(),)))
    svc.start()
    yield svc
    svc.stop()
