"""Qwen3-VL-MoE (Qwen3-VL tower + Qwen3-MoE text with MRoPE and deep-stack features) on a tiny random
checkpoint that transformers 5.23 itself saved (`Qwen3VLMoeForConditionalGeneration.save_pretrained`),
against that model in fp32: image features, logits of a prompt holding two images, cached greedy decoding
after it (MRoPE delta); our Decoder (chunks splitting an image, the prefix cache, batched decode) against our
one forward; the packed store (tower dense, experts paged) against the resident model."""

from __future__ import annotations

import pytest
import torch

from localmoe.engine.images import PromptImage
from localmoe.models import family_for_model_type
from localmoe.testing.families.qwen3_next import TOKENIZER
from localmoe.testing.parity import load_ours, load_reference, max_diff, random_tokens
from localmoe.testing.tokenizer import VOCAB_SIZE, write_tokenizer

transformers = pytest.importorskip("transformers")
qcfg = pytest.importorskip("transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe")

IMAGE_TOKEN, START, END = 600, 598, 599  # below the tokenizer's special tail
VISION = {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 4,
          "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64, "num_position_embeddings": 16,
          "deepstack_visual_indexes": [0, 2]}
# moe_intermediate_size 24: neither stacked expert tensor is square, so its layout is told by its shape
TEXT = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
        "num_experts_per_tok": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                      "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
GRIDS = [(4, 6), (8, 8)]  # patches; placeholders 2x3 and 4x4 (the second at the position table's own size)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = qcfg.Qwen3VLMoeConfig(vision_config=VISION, text_config=TEXT, image_token_id=IMAGE_TOKEN,
                                video_token_id=601, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    model = transformers.Qwen3VLMoeForConditionalGeneration(cfg)
    with torch.no_grad():  # non-trivial norms and biases
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp("qwen3_vl_moe")
    model.save_pretrained(path)
    write_tokenizer(path, TOKENIZER, 4096)
    return path


@pytest.fixture(scope="module")
def models(checkpoint):
    return load_ours(checkpoint), load_reference(transformers.Qwen3VLMoeForConditionalGeneration, checkpoint,
                                                 attn_implementation="eager")


def image_inputs():
    torch.manual_seed(1)
    return torch.randn(sum(h * w for h, w in GRIDS), 3 * 2 * 4 * 4), torch.tensor([[1, h, w] for h, w in GRIDS])


def prompt_with_images() -> torch.Tensor:
    words = random_tokens(20, 3, START)[0]
    tokens = [*words[:5].tolist(), START, *[IMAGE_TOKEN] * 6, END, *words[5:12].tolist(), START, *[IMAGE_TOKEN] * 16,
              END, *words[12:].tolist()]
    return torch.tensor([tokens])


def reference_forward(reference, prompt, patches, grid_thw, **kw):
    with torch.no_grad():
        return reference(input_ids=prompt, pixel_values=patches, image_grid_thw=grid_thw,
                         mm_token_type_ids=(prompt == IMAGE_TOKEN).int(), **kw)


def our_images(model, patches, prompt):
    """The prompt's images for our engine: rows [n, 1 + deep, D] and the PromptImages of the Decoder."""
    from localmoe.engine.images import PromptImages

    rows = [torch.stack([emb, *deep], dim=1) for emb, deep in model.vision(patches, GRIDS)]
    images = [PromptImage(f"img{k}", r.shape[0], lambda r=r: r, (h // 2, w // 2))
              for k, (r, (h, w)) in enumerate(zip(rows, GRIDS))]
    return torch.cat(rows), images, PromptImages(prompt[0].tolist(), images, IMAGE_TOKEN)


def test_spec_has_the_tower_mrope_and_the_qwen3_moe_text(models):
    spec = models[0].spec
    assert (spec.model_type, spec.image_token_id, spec.mrope_section) == ("qwen3_vl_moe", IMAGE_TOKEN, (2, 3, 3))
    assert (spec.vision.depth, spec.vision.deepstack_visual_indexes, spec.num_experts) == (3, (0, 2), 4)
    assert not spec.tie_word_embeddings and spec.qk_norm
    hf = family_for_model_type("qwen3_vl_moe").hf_tensors
    assert hf.resolve("model.language_model.layers.2.mlp.gate.weight")[0] == "layers.2.mlp.router.weight"
    assert hf.resolve("model.visual.deepstack_merger_list.1.norm.bias")[0] == "visual.deepstack_merger_list.1.norm.bias"


def test_mrope_positions_match_get_rope_index(models):
    _, reference = models
    prompt = prompt_with_images()
    _, _, ours = our_images(models[0].model, image_inputs()[0], prompt)
    want, delta = reference.model.get_rope_index(prompt, (prompt == IMAGE_TOKEN).int(), image_grid_thw=image_inputs()[1])
    assert torch.equal(ours.mrope(0, prompt.shape[1]), want[:, 0])
    assert int(ours.mrope(0, prompt.shape[1]).max()) + 1 - prompt.shape[1] == int(delta) < 0


def test_image_features_match_transformers(models):
    ours, reference = models
    patches, grid_thw = image_inputs()
    with torch.no_grad():
        expected = reference.model.get_image_features(patches, grid_thw)
    for i, (emb, deep) in enumerate(ours.model.vision(patches, GRIDS)):
        want = [expected.pooler_output[i], *(d[i] for d in expected.deepstack_features)]
        for g, e in zip([emb, *deep], want, strict=True):
            assert g.shape == e.shape and max_diff(g, e)[0] <= 1e-5 * (e.max() - e.min()).item()


def test_logits_with_images_and_greedy_decode_match_transformers(models):
    ours, reference = models
    patches, grid_thw = image_inputs()
    prompt = prompt_with_images()
    out = reference_forward(reference, prompt, patches, grid_thw, use_cache=True)
    rows, _, images = our_images(ours.model, patches, prompt)
    steps = 8
    cache = ours.model.new_cache(1, prompt.shape[1] + steps)
    got = ours.model.forward(prompt, cache, all_logits=True, image_embeds=rows, mrope=images.mrope(0, prompt.shape[1]))
    span = (out.logits.max() - out.logits.min()).item()
    assert max_diff(got, out.logits)[0] <= 1e-4 * span
    # the deep-stack features and the positions each matter
    flat = ours.model.forward(prompt, ours.model.new_cache(1, prompt.shape[1]), image_embeds=rows[:, 0],
                              mrope=images.mrope(0, prompt.shape[1]))
    plain = ours.model.forward(prompt, ours.model.new_cache(1, prompt.shape[1]), image_embeds=rows)
    for other in (flat, plain):
        assert max_diff(other[:, -1], got[:, -1])[0] > 1e-3 * span
    past, ours_next = out.past_key_values, got[:, -1].argmax(-1, keepdim=True)
    ref_next = out.logits[:, -1].argmax(-1, keepdim=True)
    for step in range(steps):  # decode positions continue from the images' largest (transformers' rope_deltas)
        assert ours_next.item() == ref_next.item(), f"greedy token differs at decode step {step}"
        with torch.no_grad():
            out = reference(input_ids=ref_next, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = ours.model.forward(ours_next, cache)
        assert max_diff(logits[:, -1], out.logits[:, -1])[0] <= 1e-4 * span
        ours_next, ref_next = logits[:, -1].argmax(-1, keepdim=True), out.logits[:, -1].argmax(-1, keepdim=True)


def _greedy(decoders, steps, preempt_at: int | None = None):
    """Greedy tokens of each Decoder: its prompt alone, then `steps` decode steps of all of them as one batch
    (`preempt_at`: before that step every sequence frees its cache and replays it, prompt and images again)."""
    from localmoe.engine.generate import decode_together

    tokens = [[] for _ in decoders]
    for i, d in enumerate(decoders):
        while (logits := d.logits()) is None:
            pass
        tokens[i].append(d.sample(logits))
        d.feed([tokens[i][-1]])
    for step in range(steps):
        if step == preempt_at:  # the replay runs the prompt's chunks, then each decoded token; its last gives logits
            for d in decoders:
                d.preempt()
            out = []
            for d in decoders:
                while (logits := d.logits()) is None:
                    pass
                out.append(logits)
        else:
            out = decode_together(decoders)
        for i, (d, logits) in enumerate(zip(decoders, out)):
            tokens[i].append(d.sample(logits))
            d.feed([tokens[i][-1]])
    return tokens


def test_decoder_chunks_prefix_cache_and_batched_decode_match_transformers(models):
    """Chunks of 4 split both images; a second sequence reuses the first's cached prefix (its images' positions) and
    decodes batched beside a text-only one; a third is preempted mid-decode and replays its prompt with the images:
    each gives transformers' greedy tokens."""
    from localmoe.engine.generate import Decoder
    from localmoe.engine.prefix_cache import PrefixCache
    from localmoe.engine.sampler import SamplingParams

    ours, reference = models
    patches, grid_thw = image_inputs()
    prompt = prompt_with_images()
    steps = 6
    with torch.no_grad():
        want = reference.generate(input_ids=prompt, pixel_values=patches, image_grid_thw=grid_thw,
                                  mm_token_type_ids=(prompt == IMAGE_TOKEN).int(), max_new_tokens=steps + 1,
                                  do_sample=False)[0, prompt.shape[1]:].tolist()
        text = prompt[:, :5]
        want_text = reference.generate(input_ids=text, max_new_tokens=steps + 1, do_sample=False)[0, 5:].tolist()
    _, image_list, _ = our_images(ours.model, patches, prompt)
    greedy, cache = SamplingParams(temperature=0), PrefixCache()
    first = Decoder(ours.model, prompt[0].tolist(), greedy, prefill_chunk=4, prefix_cache=cache, images=image_list)
    assert _greedy([first], steps) == [want]
    first.release()
    again = Decoder(ours.model, prompt[0].tolist(), greedy, prefill_chunk=4, prefix_cache=cache, images=image_list)
    assert again.reused > prompt[0].tolist().index(IMAGE_TOKEN)  # the cached positions hold both images
    alone = Decoder(ours.model, text[0].tolist(), greedy, prefill_chunk=4)
    assert _greedy([again, alone], steps) == [want, want_text]
    preempted = Decoder(ours.model, prompt[0].tolist(), greedy, prefill_chunk=4, images=image_list)
    assert _greedy([preempted], steps, preempt_at=3) == [want] and preempted.preemptions == 1


def released_layout(checkpoint, dest):
    """The checkpoint with the stacked experts as Qwen releases them ([E, D, 2I], [E, I, D])."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, dest)
    weights = load_file(dest / "model.safetensors")
    weights = {k: v.transpose(1, 2).contiguous() if k.endswith(("gate_up_proj", "down_proj")) else v
               for k, v in weights.items()}
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_packed_store_keeps_the_tower_dense_beside_the_paged_experts(models, checkpoint, tmp_path):
    from localmoe.convert import convert

    ours = models[0]
    released = released_layout(checkpoint, tmp_path / "released")
    patches, _ = image_inputs()
    prompt = prompt_with_images()
    rows, _, images = our_images(ours.model, patches, prompt)
    positions = images.mrope(0, prompt.shape[1])

    def logits(model):
        return model.forward(prompt, model.new_cache(1, prompt.shape[1]), all_logits=True, image_embeds=rows,
                             mrope=positions)

    want = logits(ours.model)
    assert torch.equal(logits(load_ours(released).model), want)  # the released expert layout reads the same
    for source in (checkpoint, released):
        store = tmp_path / f"store-{source.name}"
        convert(source, store, experts="keep")
        packed = load_ours(store)
        assert packed.spec.vision == ours.spec.vision and packed.spec.mrope_section == (2, 3, 3)
        assert packed.model.weight_bytes() < ours.model.weight_bytes()  # the experts stay in the store
        assert torch.equal(packed.model.vision(patches, GRIDS)[1][0], ours.model.vision(patches, GRIDS)[1][0])
        assert torch.equal(logits(packed.model), want)


def test_generated_checkpoint_matches_transformers_with_an_image(tmp_path):
    """`python -m localmoe.testing qwen3_vl_moe` writes the released layout, which transformers reads too."""
    from localmoe.testing import write_checkpoint

    path = write_checkpoint("qwen3_vl_moe", tmp_path / "gen", "tiny", seed=0)
    ours = load_ours(path)
    reference = load_reference(transformers.Qwen3VLMoeForConditionalGeneration, path, attn_implementation="eager")
    pad = ours.spec.image_token_id
    assert ours.tokenizer.encode("<|image_pad|>", add_special_tokens=False) == [pad]
    cfg = ours.spec.vision
    grids = [(4, 6)]
    patches = torch.randn(24, cfg.patch_dim, generator=torch.Generator().manual_seed(2))
    words = random_tokens(12, 4, 500)[0].tolist()
    prompt = torch.tensor([words[:4] + [pad] * 6 + words[4:]])
    with torch.no_grad():
        want = reference(input_ids=prompt, pixel_values=patches, image_grid_thw=torch.tensor([[1, 4, 6]]),
                         mm_token_type_ids=(prompt == pad).int()).logits
    emb, deep = ours.model.vision(patches, grids)[0]
    from localmoe.engine.images import PromptImages

    images = PromptImages(prompt[0].tolist(), [PromptImage("a", 6, lambda: None, (2, 3))], pad)
    got = ours.model.forward(prompt, ours.model.new_cache(1, prompt.shape[1]), all_logits=True,
                             image_embeds=torch.stack([emb, *deep], dim=1), mrope=images.mrope(0, prompt.shape[1]))
    assert max_diff(got, want)[0] <= 1e-4 * (want.max() - want.min()).item()
    assert torch.equal(got[0].argmax(-1), want[0].argmax(-1))


def test_an_image_file_through_the_runtime_gives_transformers_greedy_tokens(tmp_path):
    """A PNG through our whole path (size_images, the chat template's placeholders, our preprocessing with the
    checkpoint's preprocessor_config.json, our tower, the Decoder's chunks with MRoPE) against transformers' own
    image processor (given the same file's settings) and generate on the same prompt."""
    import io
    import json

    import numpy as np
    from PIL import Image

    from localmoe.chat.format import ChatMessage
    from localmoe.chat.images import ImageRef
    from localmoe.engine.generate import Decoder
    from localmoe.engine.sampler import SamplingParams
    from localmoe.runtime.images import prompt_images, size_images
    from localmoe.testing import write_checkpoint

    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    path = write_checkpoint("qwen3_vl_moe", tmp_path / "gen", "tiny", seed=0)
    ours = load_ours(path)
    reference = load_reference(transformers.Qwen3VLMoeForConditionalGeneration, path, attn_implementation="eager")
    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, size=(40, 60, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    messages = size_images(ours, [ChatMessage("user", "what is in it?", images=[ImageRef.of(buf.getvalue())])])
    prompt = ours.chat_format.render(messages)
    images = prompt_images(ours, messages, prompt)
    settings = json.loads((path / "preprocessor_config.json").read_text())  # what the image processor reads
    processor = pil.Qwen2VLImageProcessorPil(**{k: settings[k] for k in ("patch_size", "temporal_patch_size",
                                                                         "merge_size", "size", "image_mean",
                                                                         "image_std")})
    pixels = processor(images=[image], return_tensors="pt")  # scaled up to 4096 pixels: 56x80
    rows, cols = (pixels["image_grid_thw"][0, 1:] // 2).tolist()
    assert images[0].grid == (rows, cols) and prompt.count(ours.spec.image_token_id) == rows * cols
    steps = 6
    decoder = Decoder(ours.model, prompt, SamplingParams(temperature=0), prefill_chunk=100, images=images)
    got = []
    for _ in range(steps):
        while (logits := decoder.logits()) is None:
            pass
        got.append(decoder.sample(logits))
        decoder.feed([got[-1]])
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = reference.generate(input_ids=ids, pixel_values=pixels["pixel_values"],
                                  image_grid_thw=pixels["image_grid_thw"], do_sample=False, max_new_tokens=steps,
                                  mm_token_type_ids=(ids == ours.spec.image_token_id).int())[0, len(prompt):]
    assert got == want.tolist()


def test_the_processor_settings_come_from_the_checkpoint_and_its_store(tmp_path):
    """preprocessor_config.json sets the pixel budget (here the tiny checkpoint's 4096..65536), also from the packed
    store converted from it; a checkpoint without one gets the released Qwen3-VL budget."""
    from localmoe.convert import convert
    from localmoe.testing import write_checkpoint

    path = write_checkpoint("qwen3_vl_moe", tmp_path / "gen", "tiny", seed=0)
    convert(path, tmp_path / "store", experts="keep")
    for source in (path, tmp_path / "store"):
        processor = load_ours(source).image_encoder.processor
        assert (processor.min_pixels, processor.max_pixels, processor.patch_size) == (4096, 65536, 4)
    (path / "preprocessor_config.json").unlink()
    processor = load_ours(path).image_encoder.processor
    assert (processor.min_pixels, processor.max_pixels, processor.patch_size) == (65536, 16777216, 4)


def test_inspect_names_the_tower(tmp_path):
    from localmoe.describe import describe_model, format_description
    from localmoe.testing import write_checkpoint

    d = describe_model(write_checkpoint("qwen3_vl_moe", tmp_path / "gen", "tiny", seed=0))
    assert d["vision"] == {"tower": "Qwen3-VL", "blocks": 3, "hidden_size": 32, "patch_size": 4,
                           "image_token_id": 638, "deepstack_blocks": [0, 2], "mrope_section": [2, 3, 3]}
    assert ("vision         Qwen3-VL tower: 3 blocks x 32, 4-px patches, deep-stack after blocks 0, 2; image token 638; "
            "MRoPE 2/3/3") in format_description(d)
