"""`inspect` on a packed store describes the same model as on its source checkpoint."""

import pytest

from localmoe.convert import convert
from localmoe.describe import describe_model
from localmoe.testing import write_checkpoint


@pytest.mark.parametrize("family", ["kimi_k3", "gpt_oss", "qwen3_next"])
def test_store_description_equals_source(tmp_path, family):
    source = write_checkpoint(family, tmp_path / "src", size="tiny", seed=0)
    convert(source, tmp_path / "store", progress=False)
    a, b = describe_model(source), describe_model(tmp_path / "store")
    for key in ("model_type", "layers", "layer_kinds", "hidden_size", "experts", "parameters_total",
                "parameters_active"):
        assert a[key] == b[key], key
