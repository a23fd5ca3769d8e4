"""Shared fixtures."""

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (the embedded default), fetched on first use."""
    from localmoe.default_model import default_model_path

    return default_model_path()
