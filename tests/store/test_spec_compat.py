"""Packed stores written before ModelSpec held one sub-config per layer kind (its flat `kda_*`, `mla_*`,
`index_*`, `gdn_*`, `hc_*` fields, as `data/specs_before_sub_configs.json` holds them for every generated
family's tiny checkpoint) still open, with the spec the family parses today."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localmoe.checkpoint import open_checkpoint
from localmoe.convert import convert
from localmoe.engine.specs import spec_from_dict
from localmoe.models import family_for_model_type
from localmoe.store.manifest import MANIFEST
from localmoe.testing import write_checkpoint

BEFORE = json.loads((Path(__file__).parent / "data" / "specs_before_sub_configs.json").read_text())


def _parsed(family: str, path: Path):
    write_checkpoint(family, path, size="tiny")
    config = json.loads((path / "config.json").read_text())
    return family_for_model_type(config["model_type"]).spec_from_hf(config)


@pytest.mark.parametrize("family", sorted(BEFORE))
def test_a_flat_spec_reads_as_today(family, tmp_path):
    spec = _parsed(family, tmp_path)
    assert spec_from_dict(BEFORE[family]) == spec
    assert spec_from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_a_store_written_before_opens(tmp_path):
    """A converted Kimi K3 store (KDA, MLA, latent MoE, attention residuals) with its manifest's spec put back in
    the flat form: open_checkpoint reads the same spec and the model loads."""
    from localmoe.load import load_model

    src, dst = tmp_path / "src", tmp_path / "store"
    spec = _parsed("kimi_k3", src)
    convert(src, dst)
    manifest = json.loads((dst / MANIFEST).read_text())
    manifest["model_spec"] = BEFORE["kimi_k3"]
    (dst / MANIFEST).write_text(json.dumps(manifest))
    assert open_checkpoint(dst).spec == spec
    assert load_model(dst, progress=False).model.spec.attn_res.block_size == BEFORE["kimi_k3"]["attn_res_block_size"]
