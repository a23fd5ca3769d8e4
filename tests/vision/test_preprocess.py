"""Image decoding checks and the MoonViT preprocessing (Kimi_K25ImageProcessor's rules)."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from localmoe.vision import images
from localmoe.vision.moonvit import Processor


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_small_image_is_padded_not_resized():
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, size=(30, 50, 3), dtype=np.uint8)
    proc = Processor()
    patches, grid = proc(Image.fromarray(arr))
    assert grid == (4, 4) and proc.tokens(30, 50) == 4  # 30x50 padded to 56x56: 4x4 patches of 14
    assert patches.shape == (16, 3, 14, 14)
    # rebuild the padded canvas from the raster-order patches
    canvas = patches.reshape(4, 4, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 56, 56)
    expected = torch.from_numpy(arr).permute(2, 0, 1).float() / 255 * 2 - 1
    assert torch.allclose(canvas[:, :30, :50], expected, atol=1e-6)
    assert (canvas[:, 30:, :] == -1).all() and (canvas[:, :, 50:] == -1).all()  # black padding, normalised


def test_large_image_is_scaled_to_the_patch_budget():
    proc = Processor(max_patches=64, max_side_patches=16)
    (h, w), (ph, pw) = proc.sizes(1000, 300)
    assert h <= 16 * 14 and (h // 14) * (w // 14) <= 64 and abs(h / w - 1000 / 300) < 0.02
    assert ph % 28 == 0 and pw % 28 == 0 and 0 <= ph - h < 28 and 0 <= pw - w < 28
    patches, grid = proc(Image.new("RGB", (300, 1000), (255, 0, 0)))
    assert grid == (ph // 14, pw // 14) and patches.shape[0] == grid[0] * grid[1]
    assert proc.sizes(20, 20) == ((20, 20), (28, 28))  # never scaled up


def test_open_image_accepts_rgba_and_palette():
    rgba = Image.new("RGBA", (4, 3), (0, 0, 0, 0))
    assert images.open_image(png(rgba)).getpixel((0, 0)) == (255, 255, 255)  # transparent -> white
    assert images.open_image(png(Image.new("P", (2, 2)))).mode == "RGB"


@pytest.mark.parametrize("data, match", [
    (b"not an image at all", "not a readable image"),
    (b"", "not a readable image"),
    ("truncated", "not a readable image"),
    ("huge", "too large"),
], ids=["text", "empty", "truncated", "huge"])
def test_bad_images_are_refused_by_name(data, match):
    if data == "truncated":
        data = png(Image.new("RGB", (64, 64), (1, 2, 3)))[:60]
    elif data == "huge":
        data = png(Image.new("1", (20000, 1)))
    with pytest.raises(images.ImageError, match=match) as err:
        images.open_image(data, name="upload.png")
    assert "upload.png" in str(err.value)


def test_image_hash_is_content_addressed():
    a, b = png(Image.new("RGB", (2, 2), (1, 1, 1))), png(Image.new("RGB", (2, 2), (2, 2, 2)))
    assert images.image_hash(a) == images.image_hash(bytes(a)) != images.image_hash(b)


def test_qwen3vl_patches_are_merge_block_ordered_and_repeated_in_time():
    from localmoe.vision.qwen3vl import Processor as QwenProcessor

    proc = QwenProcessor(patch_size=4, min_pixels=64, max_pixels=4096)
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, size=(16, 24, 3), dtype=np.uint8)  # already a multiple of 8: not resized
    patches, grid = proc(Image.fromarray(arr))
    assert grid == (4, 6) and proc.tokens(16, 24) == 6 and patches.shape == (24, 3 * 2 * 4 * 4)
    x = torch.from_numpy(arr).permute(2, 0, 1).float() / 255 * 2 - 1
    # the 4th patch is block (0, 0)'s bottom-right patch: rows 4..7, columns 4..7; both time slots equal
    p = patches[3].view(3, 2, 4, 4)
    assert torch.allclose(p[:, 0], x[:, 4:8, 4:8], atol=1e-6) and torch.equal(p[:, 0], p[:, 1])
    # the 5th patch starts block (0, 1): rows 0..3, columns 8..11
    assert torch.allclose(patches[4].view(3, 2, 4, 4)[:, 0], x[:, 0:4, 8:12], atol=1e-6)
    assert proc.sizes(10, 10) == (8, 8) and proc.sizes(100, 100) == (64, 64)  # area kept in [64, 4096]
    with pytest.raises(images.ImageError, match="aspect ratio"):
        proc.sizes(1, 300)


@pytest.mark.parametrize("size", [(37, 53), (300, 90), (8, 8)], ids=["upscaled", "downscaled", "tiny"])
def test_qwen3vl_patches_match_transformers_image_processor(size):
    """Our Qwen3-VL preprocessing against transformers' own Qwen2-VL image processor (PIL backend), which
    Qwen3-VL's processor uses: the same resize, normalisation and patch order, bit for bit."""
    from localmoe.vision.qwen3vl import Processor as QwenProcessor

    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    reference = pil.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                             size={"shortest_edge": 1024, "longest_edge": 8192},
                                             image_mean=[0.5] * 3, image_std=[0.5] * 3)
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, size=(*size, 3), dtype=np.uint8))
    want = reference(images=[image], return_tensors="pt")
    patches, grid = QwenProcessor(patch_size=4, min_pixels=1024, max_pixels=8192)(image)
    assert [1, *grid] == want["image_grid_thw"][0].tolist()
    assert torch.equal(patches, want["pixel_values"])
