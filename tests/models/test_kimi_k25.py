"""Kimi K2.5 (MoonViT + DeepSeek-V3 text) on a tiny random checkpoint that transformers 5.23 itself saved
(`Kimi_K25ForConditionalGeneration.save_pretrained`), against that model in fp32: image features, logits of
a prompt holding an image, and cached greedy decoding after it."""

from __future__ import annotations

import pytest
import torch

from localmoe.models import family_for_model_type
from localmoe.testing.families.deepseek_v32 import TOKENIZER
from localmoe.testing.parity import load_ours, load_reference, max_diff, random_tokens
from localmoe.testing.tokenizer import VOCAB_SIZE, write_tokenizer

transformers = pytest.importorskip("transformers")
k25 = pytest.importorskip("transformers.models.kimi_k25.configuration_kimi_k25")

IMAGE_TOKEN, START, END = 600, 598, 599  # below the tokenizer's special tail (636..639)
VISION = {"patch_size": 14, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 4, "num_attention_heads": 2,
          "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 48, "merge_kernel_size": [2, 2],
          "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}
TEXT = {"model_type": "deepseek_v3", "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 2, "topk_group": 1, "num_nextn_predict_layers": 0}
GRIDS = [(4, 6), (8, 8)]  # patches: 6 and 16 placeholder tokens; the second resamples no position grid


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = k25.Kimi_K25Config(vision_config=VISION, text_config=TEXT, projection_hidden_size=VISION["hidden_size"],
                             image_token_id=IMAGE_TOKEN, video_token_id=601, vision_start_token_id=START,
                             vision_end_token_id=END, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Kimi_K25ForConditionalGeneration(cfg)
    with torch.no_grad():  # non-trivial norms, biases and correction bias
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp("kimi_k25")
    model.save_pretrained(path)
    write_tokenizer(path, TOKENIZER, 4096)
    return path


@pytest.fixture(scope="module")
def models(checkpoint):
    return load_ours(checkpoint), load_reference(transformers.Kimi_K25ForConditionalGeneration, checkpoint,
                                                 attn_implementation="eager")


def image_inputs():
    torch.manual_seed(1)
    patches = torch.randn(sum(h * w for h, w in GRIDS), 3, 14, 14)
    return patches, torch.tensor([[1, h, w] for h, w in GRIDS])


def prompt_with_images() -> torch.Tensor:
    words = random_tokens(20, 3, START)[0]
    tokens = [*words[:5].tolist(), START, *[IMAGE_TOKEN] * 6, END, *words[5:12].tolist(), START, *[IMAGE_TOKEN] * 16,
              END, *words[12:].tolist()]
    return torch.tensor([tokens])


def test_spec_has_the_tower_and_the_deepseek_text(models):
    spec = models[0].spec
    assert (spec.model_type, spec.image_token_id, spec.layer_kinds) == ("kimi_k25", IMAGE_TOKEN, ("mla",) * 3)
    assert (spec.vision.hidden_size, spec.vision.num_layers, spec.vision.text_hidden_size) == (32, 2, 64)
    hf = family_for_model_type("kimi_k25").hf_tensors
    assert hf.resolve("language_model.model.layers.2.mlp.gate.weight")[0] == "layers.2.mlp.router.weight"
    assert hf.resolve("vision_tower.encoder.blocks.1.wqkv.bias")[0] == "vision_tower.encoder.blocks.1.wqkv.bias"


def test_image_features_match_transformers(models):
    ours, reference = models
    patches, grid_thw = image_inputs()
    with torch.no_grad():
        expected = reference.model.get_image_features(patches, grid_thw).pooler_output
    got = ours.model.vision(patches, GRIDS)
    for g, e in zip(got, expected, strict=True):
        err, _ = max_diff(g, e)
        assert g.shape == e.shape and err <= 1e-5 * (e.max() - e.min()).item()


def test_logits_with_images_and_greedy_decode_match_transformers(models):
    ours, reference = models
    patches, grid_thw = image_inputs()
    prompt = prompt_with_images()
    with torch.no_grad():
        out = reference(input_ids=prompt, pixel_values=patches, image_grid_thw=grid_thw, use_cache=True)
    embeds = torch.cat(ours.model.vision(patches, GRIDS))
    steps = 8
    cache = ours.model.new_cache(1, prompt.shape[1] + steps)
    got = ours.model.forward(prompt, cache, all_logits=True, image_embeds=embeds)
    span = (out.logits.max() - out.logits.min()).item()
    assert max_diff(got, out.logits)[0] <= 1e-4 * span
    # the image changes the answer: the same prompt with other pixels gives other logits
    other = ours.model.forward(prompt, ours.model.new_cache(1, prompt.shape[1]), image_embeds=embeds.flip(0))
    assert max_diff(other[:, -1], got[:, -1])[0] > 1e-3 * span
    past, ours_next = out.past_key_values, got[:, -1].argmax(-1, keepdim=True)
    ref_next = out.logits[:, -1].argmax(-1, keepdim=True)
    for step in range(steps):
        assert ours_next.item() == ref_next.item(), f"greedy token differs at decode step {step}"
        with torch.no_grad():
            out = reference(input_ids=ref_next, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = ours.model.forward(ours_next, cache)
        assert max_diff(logits[:, -1], out.logits[:, -1])[0] <= 1e-4 * span
        ours_next, ref_next = logits[:, -1].argmax(-1, keepdim=True), out.logits[:, -1].argmax(-1, keepdim=True)


def test_placeholder_count_must_match_the_images(models):
    ours = models[0]
    embeds = torch.cat(ours.model.vision(*image_inputs()[:1], GRIDS))
    with pytest.raises(Exception, match="22 embeddings"):
        ours.model.forward(prompt_with_images()[:, :10], ours.model.new_cache(1, 10), image_embeds=embeds)


def released_layout(checkpoint, dest):
    """The checkpoint with the released names (`language_model.model.layers.*`, `vision_tower.patch_embed.*`,
    `mm_projector.pre_norm.*`) where transformers' save_pretrained spelled them otherwise."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, dest)
    weights = load_file(dest / "model.safetensors")
    renames = (("language_model.model.blocks.", "language_model.model.layers."),
               ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."), ("model.mm_projector.", "mm_projector."))
    for old, new in renames:
        weights = {new + k[len(old):] if k.startswith(old) else k: v for k, v in weights.items()}
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_packed_store_keeps_the_tower_dense_beside_the_paged_experts(models, checkpoint, tmp_path):
    from localmoe.convert import convert

    released = released_layout(checkpoint, tmp_path / "released")
    assert torch.equal(load_ours(released).model.vision(*image_inputs()[:1], GRIDS)[0],
                       models[0].model.vision(*image_inputs()[:1], GRIDS)[0])
    convert(released, tmp_path / "store", experts="keep")
    packed = load_ours(tmp_path / "store")
    ours = models[0]
    assert packed.spec.vision == ours.spec.vision and packed.spec.image_token_id == IMAGE_TOKEN
    assert packed.model.weight_bytes() < ours.model.weight_bytes()  # the experts stay in the store
    patches, _ = image_inputs()
    embeds = torch.cat(packed.model.vision(patches, GRIDS))
    assert torch.equal(embeds, torch.cat(ours.model.vision(patches, GRIDS)))
    prompt = prompt_with_images()
    got = packed.model.forward(prompt, packed.model.new_cache(1, prompt.shape[1]), all_logits=True, image_embeds=embeds)
    want = ours.model.forward(prompt, ours.model.new_cache(1, prompt.shape[1]), all_logits=True, image_embeds=embeds)
    assert torch.equal(got, want)


def test_generated_checkpoint_matches_transformers_with_an_image(tmp_path):
    """`python -m localmoe.testing kimi_k25` writes the released layout, which transformers reads too."""
    from localmoe.testing import write_checkpoint

    path = write_checkpoint("kimi_k25", tmp_path / "gen", "tiny", seed=0)
    ours = load_ours(path)
    reference = load_reference(transformers.Kimi_K25ForConditionalGeneration, path, attn_implementation="eager")
    pad = ours.spec.image_token_id
    assert ours.tokenizer.encode("<|media_pad|>", add_special_tokens=False) == [pad]
    patches, grid_thw = image_inputs()
    prompt = prompt_with_images()
    prompt[prompt == IMAGE_TOKEN] = pad
    with torch.no_grad():
        want = reference(input_ids=prompt, pixel_values=patches, image_grid_thw=grid_thw).logits
        features = reference.model.get_image_features(patches, grid_thw).pooler_output
    embeds = ours.model.vision(patches, GRIDS)
    for g, e in zip(embeds, features, strict=True):
        assert max_diff(g, e)[0] <= 1e-5 * (e.max() - e.min()).item()
    got = ours.model.forward(prompt, ours.model.new_cache(1, prompt.shape[1]), all_logits=True,
                             image_embeds=torch.cat(embeds))
    assert max_diff(got, want)[0] <= 1e-4 * (want.max() - want.min()).item()
    assert torch.equal(got[0].argmax(-1), want[0].argmax(-1))
