"""Images in a prompt: the placeholder rows reach the model through chunked prefill (the `Decoder`), are
encoded once per image content, and `localmoe run --image` shows them to a vision model."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from localmoe.cli import cli
from localmoe.engine.sampler import SamplingParams
from localmoe.testing import write_checkpoint
from localmoe.testing.parity import load_ours


def png(seed: int, size=(60, 40)) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint("kimi_k25", tmp_path_factory.mktemp("k25"), "tiny", seed=0)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_ours(checkpoint)


def test_chunked_prefill_through_two_images_equals_one_forward(loaded):
    from localmoe.engine.generate import Decoder

    data = [png(1), png(2, (30, 30))]
    prompt, images = _decoder_prompt(loaded, data)
    rows = [loaded.image_encoder.encode(d) for d in data]
    assert prompt.count(loaded.spec.image_token_id) == sum(r.shape[0] for r in rows) == 6 + 4  # 40x60 px: 4x6 patches; 30x30 px padded to 56x56: 4x4
    model = loaded.model
    want = model.forward(torch.tensor([prompt]), model.new_cache(1, 128), image_embeds=torch.cat(rows))[:, -1]
    dec = Decoder(model, prompt, SamplingParams(temperature=0), 128, prefill_chunk=4, images=images)
    while (got := dec.logits()) is None:  # chunks of 4 split the first image
        pass
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_stream_with_images_encodes_each_image_once(loaded):
    from localmoe.runtime.local import LocalModel

    greedy, loaded = SamplingParams(temperature=0), LocalModel(loaded)
    first = loaded.generate("what is it?", greedy, max_tokens=6, images=[png(3)])
    before = loaded.image_encoder.encoded
    again = loaded.generate("what is it?", greedy, max_tokens=6, images=[png(3)])
    other = loaded.generate("what is it?", greedy, max_tokens=6, images=[png(4)])
    assert again.content == first.content and loaded.image_encoder.encoded == before + 1  # png(3) from the cache
    assert first.prompt_tokens == other.prompt_tokens  # same size: same placeholders


def test_run_image_option(checkpoint, tmp_path):
    (tmp_path / "a.png").write_bytes(png(5))
    (tmp_path / "bad.png").write_bytes(b"not an image")
    runner = CliRunner()
    ok = runner.invoke(cli, ["run", "--model", str(checkpoint), "--image", str(tmp_path / "a.png"), "--max-tokens",
                             "3", "--stats", "hi"])
    assert ok.exit_code == 0, ok.output
    assert "[images: 1 (1 encoded)" in ok.output
    bad = runner.invoke(cli, ["run", "--model", str(checkpoint), "--image", str(tmp_path / "bad.png"), "hi"])
    assert bad.exit_code == 1 and "bad.png: not a readable image" in bad.output


def _decoder_prompt(loaded, refs):
    from localmoe.chat.format import ChatMessage
    from localmoe.chat.images import ImageRef
    from localmoe.runtime.images import prompt_images, size_images

    messages = size_images(loaded, [ChatMessage("user", "look: and now",
                                                images=[ImageRef.of(d, 6 + 4 * k) for k, d in enumerate(refs)])])
    prompt = loaded.chat_format.render(messages)
    return prompt, prompt_images(loaded, messages, prompt)


def test_decoder_images_follow_chunks_and_prefix_cache_keys(loaded):
    """A Decoder places each image's rows at its placeholders through chunked prefill, encodes an image only when a
    chunk needs it (the prefix cache may hold its positions already), and never reuses one image's cached positions
    for another image of the same size."""
    from localmoe.engine.generate import Decoder
    from localmoe.engine.prefix_cache import PrefixCache

    model, enc = loaded.model, loaded.image_encoder
    a, b = png(11), png(12)  # same size: same placeholder count and prompt tokens
    prompt_a, images_a = _decoder_prompt(loaded, [a])
    prompt_b, images_b = _decoder_prompt(loaded, [b])
    assert prompt_a == prompt_b
    rows = torch.cat([enc.encode(a)])
    want = model.forward(torch.tensor([prompt_a]), model.new_cache(1, 128), image_embeds=rows)[:, -1]
    greedy = SamplingParams(temperature=0)

    def last_logits(dec):
        while (out := dec.logits()) is None:
            pass
        return out

    got = last_logits(Decoder(model, prompt_a, greedy, 128, prefill_chunk=4, images=images_a))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())

    cache = PrefixCache()
    first = Decoder(model, prompt_a, greedy, prefill_chunk=4, prefix_cache=cache, images=images_a)
    last_logits(first)
    first.release()
    other = Decoder(model, prompt_b, greedy, prefill_chunk=4, prefix_cache=cache, images=images_b)
    start = prompt_b.index(model.spec.image_token_id)
    assert other.reused == start - start % 4  # reuse stops at image b's first placeholder
    want_b = model.forward(torch.tensor([prompt_b]), model.new_cache(1, 128), image_embeds=enc.encode(b))[:, -1]
    got_b = last_logits(other)
    assert torch.allclose(got_b, want_b, rtol=1e-5, atol=1e-5 * want_b.abs().max().item())
    assert not torch.allclose(got_b, got)  # the images differ, so do the logits
    other.release()

    encoded = enc.encoded
    enc.cache.clear()  # an image whose positions the prefix cache holds is not encoded again
    again = Decoder(model, prompt_b, greedy, prefill_chunk=4, prefix_cache=cache, images=images_b)
    assert again.reused == (len(prompt_b) - 1) // 4 * 4 > prompt_b.index(model.spec.image_token_id)
    assert torch.allclose(last_logits(again), want_b, rtol=1e-5, atol=1e-5 * want_b.abs().max().item())
    assert enc.encoded == encoded
