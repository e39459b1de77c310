"""train.data and train.sources: datasets built here (parquet with bytes or the hub's Image struct, image
folders with metadata.jsonl, a hub cache read offline), pixels against PIL, crops and flips read back from
pictures that encode their coordinates, sharding, shuffling, exact resume and skipped samples."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from sdx import images
from sdx.errors import SdxError
from tests import train_datasets as td
from train import data
from train.data import Columns, Transform, make_loader, open_source


def take(loader, n: int) -> list[dict]:
    it = iter(loader)
    out = [next(it) for _ in range(n)]
    loader.close()
    return out


def loader_for(source, transform, batch_size=2, **kw):
    kw.setdefault("shard_index", 0)
    kw.setdefault("shard_count", 1)
    kw.setdefault("threads", 2)
    return make_loader(source, transform, batch_size=batch_size, seed=kw.pop("seed", transform.seed), **kw)


def expected_pixels(picture: np.ndarray, res: int, top: int, left: int, flip: bool,
                    resample=Image.BILINEAR) -> np.ndarray:
    """What the loader should give, computed with PIL alone: shorter side to res (`resample`), flip, crop."""
    im = Image.fromarray(picture)
    h, w = picture.shape[:2]
    size = (res, int(res * w / h)) if h <= w else (int(res * h / w), res)  # (h, w)
    if (im.height, im.width) != size:
        im = im.resize((size[1], size[0]), resample)
    if flip:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    im = im.crop((left, top, left + res, top + res))
    return np.asarray(im, np.float32) / 127.5 - 1.0


# ------------------------------------------------------------------------------------------- fixtures


SIZES = [(20, 30), (33, 17), (16, 16), (40, 24), (18, 50), (25, 25)]  # (h, w)


@pytest.fixture
def captions_parquet(tmp_path):
    pictures = [td.random_picture(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    texts = [f"caption {i}" for i in range(len(SIZES))]
    path = td.write_parquet(tmp_path / "ds" / "train.parquet",
                            {"image": [td.encode(p) for p in pictures], "text": texts},
                            image_columns=("image",), row_group_size=4)
    return path, pictures, texts


@pytest.fixture
def pairs_parquet(tmp_path):
    """InstructPix2Pix pairs as the hub stores them (Image structs with embedded bytes): coordinate
    pictures, the edited one with another blue tag, so a crop and a flip can be read back from both."""
    sizes = [(16, 40), (48, 16), (16, 16), (16, 28), (16, 24), (30, 16), (16, 36), (24, 16)]
    originals = [{"bytes": td.encode(td.coordinates(h, w, tag=i)), "path": f"o{i}.png"}
                 for i, (h, w) in enumerate(sizes)]
    edited = [{"bytes": td.encode(td.coordinates(h, w, tag=100 + i)), "path": None} for i, (h, w) in enumerate(sizes)]
    path = td.write_parquet(tmp_path / "pairs" / "data" / "train-00000-of-00001.parquet",
                            {"input_image": originals, "edit_prompt": [f"edit {i}" for i in range(len(sizes))],
                             "edited_image": edited},
                            image_columns=("input_image", "edited_image"), as_struct=True, row_group_size=3)
    return path.parent.parent, sizes


# ---------------------------------------------------------------------------------------------- pixels


@pytest.mark.parametrize("center_crop, interpolation, resample", [
    (False, "bilinear", Image.BILINEAR), (True, "bilinear", Image.BILINEAR), (False, "lanczos", Image.LANCZOS),
    (True, "bicubic", Image.BICUBIC), (True, "nearest_exact", Image.NEAREST)])
def test_pixels_match_pil_resize_flip_crop(captions_parquet, center_crop, interpolation, resample):
    """The pictures as PIL alone makes them, with the filter torchvision's Resize takes for the
    --image_interpolation_mode given to a PIL image (bilinear by default)."""
    path, pictures, texts = captions_parquet
    res = 16
    source = open_source(path, Columns.text_to_image())
    t = Transform(resolution=res, center_crop=center_crop, random_flip=True, seed=3, interpolation=interpolation)
    batches = take(loader_for(source, t, batch_size=3, shuffle=False), 2)
    flips = []
    for batch in batches:
        assert batch["pixels"].shape == (3, res, res, 3) and batch["pixels"].dtype == np.float32
        assert batch["original_size"].dtype == np.int32 and batch["index"].dtype == np.int64
        for j in range(3):
            row, p = int(batch["row"][j]), int(batch["index"][j])
            h, w = SIZES[row]
            assert tuple(batch["original_size"][j]) == (h, w)
            assert batch["text"][j] == texts[row]
            top, left = (int(v) for v in batch["crop_top_left"][j])
            rh, rw = (res, int(res * w / h)) if h <= w else (int(res * h / w), res)
            assert 0 <= top <= rh - res and 0 <= left <= rw - res
            u = np.random.default_rng([3, p]).random(4)  # the documented draws: flip, top, left, caption
            if center_crop:
                assert (top, left) == (int(round((rh - res) / 2)), int(round((rw - res) / 2)))
            else:
                assert (top, left) == (int(u[1] * (rh - res + 1)), int(u[2] * (rw - res + 1)))
            flip = bool(u[0] < 0.5)
            flips.append(flip)
            want = expected_pixels(pictures[row], res, top, left, flip, resample)
            np.testing.assert_allclose(batch["pixels"][j], want, atol=1e-6)
            assert not np.allclose(batch["pixels"][j], expected_pixels(pictures[row], res, top, left, not flip,
                                                                       resample)) or np.allclose(want, want[:, ::-1])
            if interpolation != "bilinear" and (h, w) != (res, res):  # the filter shows
                assert not np.allclose(batch["pixels"][j], expected_pixels(pictures[row], res, top, left, flip))
    assert any(flips) and not all(flips)


def test_pixels_are_torchvision_normalised():
    """(x / 255 - 0.5) / 0.5 in float32, what ToTensor + Normalize([0.5], [0.5]) give."""
    import torch

    x = np.arange(256, dtype=np.uint8).reshape(16, 16, 1).repeat(3, -1)
    want = ((torch.from_numpy(x).float().div(255) - 0.5) / 0.5).numpy()
    np.testing.assert_array_equal(data.pixels_to_float(x), want)


def test_crop_and_flip_read_back_from_the_pictures(pairs_parquet):
    """No resize (shorter side = resolution): the crop's pixels carry their source coordinates; both
    images of a pair get the same flip and crop; random crops move, flips happen, and crop_top_left is
    in the flipped image (diffusers PR #6547)."""
    folder, sizes = pairs_parquet
    res = 16
    source = open_source(folder, Columns.pix2pix())
    t = Transform(resolution=res, center_crop=False, random_flip=True, seed=1)
    batches = take(loader_for(source, t, batch_size=4, num_epochs=4), 8)
    seen_flip, seen_lefts, seen_tops = set(), set(), set()
    for b in batches:
        orig = np.rint((b["original_pixels"] + 1) * 127.5).astype(int)
        edit = np.rint((b["edited_pixels"] + 1) * 127.5).astype(int)
        for j in range(len(b["index"])):
            row = int(b["row"][j])
            h, w = sizes[row]
            assert tuple(b["original_size"][j]) == (h, w)
            top, left = (int(v) for v in b["crop_top_left"][j])
            o, e = orig[j], edit[j]
            np.testing.assert_array_equal(o[..., :2], e[..., :2])  # same crop and flip for both
            assert (o[..., 2] == row).all() and (e[..., 2] == 100 + row).all()
            xs, ys = o[0, :, 0], o[:, 0, 1]
            np.testing.assert_array_equal(ys, np.arange(top, top + res))
            flipped = xs[0] > xs[-1]
            seen_flip.add(bool(flipped))
            if flipped:  # column j of the flipped image is x = w - 1 - j
                np.testing.assert_array_equal(xs, w - 1 - np.arange(left, left + res))
            else:
                np.testing.assert_array_equal(xs, np.arange(left, left + res))
            if w > res:
                seen_lefts.add(left)
            if h > res:
                seen_tops.add(top)
    assert seen_flip == {True, False}
    assert len(seen_lefts) > 3 and len(seen_tops) > 3


def test_center_crop_without_flip_is_fixed(pairs_parquet):
    folder, sizes = pairs_parquet
    source = open_source(folder, Columns.pix2pix())
    t = Transform(resolution=16, center_crop=True, random_flip=False, seed=5)
    for b in take(loader_for(source, t, batch_size=4), 2):
        x = np.rint((b["original_pixels"] + 1) * 127.5).astype(int)
        for j, row in enumerate(b["row"]):
            h, w = sizes[int(row)]
            top, left = round((h - 16) / 2), round((w - 16) / 2)
            assert tuple(b["crop_top_left"][j]) == (top, left)
            assert (x[j, 0, 0, 0], x[j, 0, 0, 1]) == (left, top)
            assert x[j, 0, -1, 0] == left + 15  # never flipped


def test_aspect_ratio_is_kept_when_resizing(tmp_path):
    """A 32x64 ramp resized to 16x32: both axes shrink by 2 (a squash to 16x16 would shrink x by 4)."""
    y, x = np.mgrid[0:32, 0:64]
    ramp = np.stack([x * 4, y * 4, np.zeros_like(x)], -1).astype(np.uint8)
    path = td.write_parquet(tmp_path / "r.parquet", {"image": [td.encode(ramp)]}, image_columns=("image",))
    source = open_source(path, Columns.images_only())
    b = take(loader_for(source, Transform(16, center_crop=True), batch_size=1), 1)[0]
    assert tuple(b["crop_top_left"][0]) == (0, 8) and tuple(b["original_size"][0]) == (32, 64)
    px = (b["pixels"][0] + 1) * 127.5
    np.testing.assert_allclose(np.diff(px[8, 2:-2, 0]), 8.0, atol=0.51)  # 4 per source pixel x 2 source pixels
    np.testing.assert_allclose(np.diff(px[2:-2, 8, 1]), 8.0, atol=0.51)
    assert abs(px[8, 0, 0] - 4 * (2 * 8 + 0.5)) <= 1.0  # column 0 of the crop is resized column 8


def test_caption_lists_and_tokenize(tmp_path):
    pic = td.encode(td.random_picture(16, 16, 0))
    path = td.write_parquet(tmp_path / "c.parquet", {"image": [pic] * 4, "text": [["a", "b", "c"]] * 4},
                            image_columns=("image",))
    source = open_source(path, Columns.text_to_image())

    def tokenize(text):
        return {"clip_l": np.full((1, 5), ord(text), np.int32), "clip_g": np.full((1, 5), -ord(text), np.int32)}

    t = Transform(16, seed=2, tokenize=tokenize)
    batches = take(loader_for(source, t, batch_size=4, num_epochs=8), 8)
    texts = [s for b in batches for s in b["text"]]
    assert set(texts) == {"a", "b", "c"}
    for b in batches:
        for j, p in enumerate(b["index"]):
            u = np.random.default_rng([2, int(p)]).random(4)[3]
            assert b["text"][j] == "abc"[int(u * 3)]
        assert b["ids"]["clip_l"].shape == (4, 1, 5) and b["ids"]["clip_l"].dtype == np.int32
        np.testing.assert_array_equal(b["ids"]["clip_l"][:, 0, 0], [ord(s) for s in b["text"]])
        np.testing.assert_array_equal(b["ids"]["clip_g"], -b["ids"]["clip_l"])


# ---------------------------------------------------------------------------------------------- decoding


def _rgb(cell) -> np.ndarray:
    return np.asarray(images.decode(cell))


def test_decode_converts_modes():
    rgb = td.random_picture(6, 5, 1)
    grey = rgb[..., 0]
    np.testing.assert_array_equal(_rgb(td.encode(grey)), np.repeat(grey[..., None], 3, -1))  # L
    la = Image.fromarray(np.stack([grey, np.full_like(grey, 7)], -1), "LA")
    np.testing.assert_array_equal(_rgb(td.encode(la)), np.repeat(grey[..., None], 3, -1))
    rgba = np.concatenate([rgb, np.zeros_like(rgb[..., :1])], -1)  # fully transparent: alpha dropped
    np.testing.assert_array_equal(_rgb(td.encode(rgba)), rgb)
    palette = Image.fromarray(rgb).quantize(8)
    np.testing.assert_array_equal(_rgb(td.encode(palette)), np.asarray(palette.convert("RGB")))
    palette.info["transparency"] = 0
    assert _rgb(td.encode(palette)).shape == (6, 5, 3)
    cmyk = Image.new("CMYK", (5, 6), (0, 255, 255, 0))  # pure red
    np.testing.assert_array_equal(_rgb(td.encode(cmyk, "TIFF"))[0, 0], [255, 0, 0])
    bits = Image.fromarray(grey > 127)
    np.testing.assert_array_equal(_rgb(td.encode(bits))[..., 1], np.where(grey > 127, 255, 0))
    # 16 bits: the high byte, for greyscale (PIL alone would clip at 255) as for RGB
    g16 = np.arange(30, dtype=np.uint16).reshape(6, 5, 1) * 2000
    np.testing.assert_array_equal(_rgb(td.png16(g16)), np.repeat(g16 >> 8, 3, -1))
    np.testing.assert_array_equal(_rgb(td.encode(Image.fromarray(g16[..., 0]), "TIFF")), np.repeat(g16 >> 8, 3, -1))
    c16 = np.arange(90, dtype=np.uint16).reshape(6, 5, 3) * 700
    np.testing.assert_array_equal(_rgb(td.png16(c16)), c16 >> 8)
    a16 = np.concatenate([c16, np.full_like(c16[..., :1], 65535)], -1)
    np.testing.assert_array_equal(_rgb(td.png16(a16)), c16 >> 8)


def test_decode_applies_exif_orientation():
    pic = Image.fromarray(td.coordinates(4, 8))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: shown turned 90 degrees clockwise
    buf = __import__("io").BytesIO()
    pic.save(buf, "PNG", exif=exif)
    out = _rgb(buf.getvalue())
    assert out.shape == (8, 4, 3)
    np.testing.assert_array_equal(out, np.asarray(pic.transpose(Image.ROTATE_270)))


@pytest.mark.parametrize("cell", [td.truncated_png(), td.GARBAGE, b"", None, "/no/such/file.png"])
def test_unreadable_cells(cell):
    with pytest.raises(images.UnreadableImage):
        images.decode(cell)


def test_load_image(tmp_path):
    pic = td.random_picture(20, 30, 4)
    (tmp_path / "v.png").write_bytes(td.encode(pic))
    out = data.load_image(tmp_path / "v.png", 16)
    np.testing.assert_allclose(out, expected_pixels(pic, 16, 0, 4, False), atol=1e-6)
    (tmp_path / "bad.png").write_bytes(td.GARBAGE)
    with pytest.raises(SdxError, match="bad.png: cannot read"):
        data.load_image(tmp_path / "bad.png", 16)


# ---------------------------------------------------------------------------------------------- sources


def test_struct_with_paths_and_bytes(tmp_path):
    """The hub's Image struct: embedded bytes, or bytes null and a path relative to the parquet file."""
    pics = [td.random_picture(16, 16, i) for i in range(3)]
    (tmp_path / "ds" / "images").mkdir(parents=True)
    (tmp_path / "ds" / "images" / "1.png").write_bytes(td.encode(pics[1]))
    (tmp_path / "ds" / "2.png").write_bytes(td.encode(pics[2]))
    cells = [{"bytes": td.encode(pics[0]), "path": "ignored.png"}, {"bytes": None, "path": "images/1.png"},
             {"bytes": None, "path": str(tmp_path / "ds" / "2.png")}]
    path = td.write_parquet(tmp_path / "ds" / "train.parquet", {"image": cells, "text": ["a", "b", "c"]},
                            image_columns=("image",), as_struct=True)
    source = open_source(path, Columns.text_to_image())
    assert len(source) == 3 and source.found == ("image", "text")
    b = take(loader_for(source, Transform(16), batch_size=3, shuffle=False), 1)[0]
    for j in range(3):
        np.testing.assert_allclose(b["pixels"][j], pics[j] / 127.5 - 1, atol=1e-6)
    assert list(b["text"]) == ["a", "b", "c"]


def test_imagefolder_metadata(tmp_path):
    pics = {f"img/{i}.png": td.random_picture(16, 20, i) for i in range(4)}
    rows = [{"file_name": f"img/{i}.png", "text": f"picture {i}", "extra": i} for i in range(4)]
    root = td.write_imagefolder(tmp_path / "folder" / "train", rows, {k: td.encode(v) for k, v in pics.items()})
    # a test split beside it is not read
    td.write_imagefolder(tmp_path / "folder" / "test", [{"file_name": "x.png", "text": "no"}],
                         {"x.png": td.encode(pics["img/0.png"])})
    source = open_source(tmp_path / "folder", Columns.text_to_image())
    assert len(source) == 4 and source.found == ("image", "text", "extra")
    b = take(loader_for(source, Transform(16, center_crop=True), batch_size=4, shuffle=False), 1)[0]
    assert list(b["text"]) == [f"picture {i}" for i in range(4)]
    for i in range(4):
        np.testing.assert_allclose(b["pixels"][i], expected_pixels(pics[f"img/{i}.png"], 16, 0, 2, False), atol=1e-6)
    assert "metadata.jsonl line 1" in source[0].where


def test_imagefolder_pairs_with_file_name_columns(tmp_path):
    images = {f"{k}{i}.png": td.encode(td.coordinates(16, 24, tag=i + (50 if k == "e" else 0)))
              for i in range(3) for k in "oe"}
    rows = [{"input_image_file_name": f"o{i}.png", "edited_image_file_name": f"e{i}.png", "edit_prompt": f"do {i}"}
            for i in range(3)]
    root = td.write_imagefolder(tmp_path / "pairs", rows, images)
    source = open_source(root, Columns.pix2pix())
    assert source.found == ("input_image", "edited_image", "edit_prompt")
    b = take(loader_for(source, Transform(16, random_flip=True), batch_size=3, shuffle=False), 1)[0]
    assert list(b["text"]) == ["do 0", "do 1", "do 2"]
    tags = np.rint((b["edited_pixels"][..., 2] + 1) * 127.5)
    np.testing.assert_array_equal(tags[:, 0, 0], [50, 51, 52])
    np.testing.assert_array_equal(b["original_pixels"][..., :2], b["edited_pixels"][..., :2])


def test_images_only_folder(tmp_path):
    for i in range(3):
        (tmp_path / "imgs" / "sub").mkdir(parents=True, exist_ok=True)
        (tmp_path / "imgs" / "sub" / f"{i}.jpg").write_bytes(td.encode(td.random_picture(16, 16, i), "JPEG"))
    (tmp_path / "imgs" / "notes.txt").write_text("not an image")
    source = open_source(tmp_path / "imgs", Columns.images_only())
    assert len(source) == 3
    b = take(loader_for(source, Transform(16), batch_size=3), 1)[0]
    assert set(b) >= {"pixels", "index", "row"} and "text" not in b
    with pytest.raises(SdxError, match=r"no column 'text' \(--caption_column\); its columns are: image"):
        open_source(tmp_path / "imgs", Columns.text_to_image())


def test_missing_column_lists_the_columns_found(captions_parquet, tmp_path):
    path, _, _ = captions_parquet
    with pytest.raises(SdxError) as info:
        open_source(path, Columns.pix2pix())
    message = str(info.value)
    assert "'input_image' (--original_image_column)" in message and "'edit_prompt' (--edit_prompt_column)" in message
    assert "'edited_image' (--edited_image_column)" in message and message.endswith("its columns are: image, text")
    with pytest.raises(SdxError, match=r"no column 'caption' \(--caption_column\); its columns are: image, text"):
        open_source(path, Columns.text_to_image(caption="caption"))
    root = td.write_imagefolder(tmp_path / "f", [{"file_name": "a.png", "prompt": "x"}],
                                {"a.png": td.encode(td.random_picture(4, 4, 0))})
    with pytest.raises(SdxError, match=r"no column 'text' \(--caption_column\); its columns are: image, prompt"):
        open_source(root, Columns.text_to_image())


def test_text_that_is_not_text(tmp_path):
    pic = td.encode(td.random_picture(16, 16, 0))
    numbers = td.write_parquet(tmp_path / "n.parquet", {"image": [pic], "text": [3]}, image_columns=("image",))
    with pytest.raises(SdxError, match=r"column 'text' has type int64, not text"):
        open_source(numbers, Columns.text_to_image())
    nulls = td.write_parquet(tmp_path / "z.parquet", {"image": [pic, pic], "text": ["a", None]},
                             image_columns=("image",))
    with pytest.raises(SdxError, match=r"column 'text' has 1 empty \(null\) cells"):
        open_source(nulls, Columns.text_to_image())
    empty = td.write_parquet(tmp_path / "e.parquet", {"image": [pic, pic], "text": [["a"], []]},
                             image_columns=("image",))
    source = open_source(empty, Columns.text_to_image())
    with pytest.raises(SdxError, match=r"e.parquet row 1: column 'text' holds list \[\], not text"):
        take(loader_for(source, Transform(16), batch_size=2, shuffle=False), 1)
    root = td.write_imagefolder(tmp_path / "f", [{"file_name": "a.png", "text": 5}], {"a.png": pic})
    with pytest.raises(SdxError, match=r"metadata.jsonl line 1: column 'text' holds int 5"):
        open_source(root, Columns.text_to_image())


def test_hub_dataset_read_offline_from_the_cache(tmp_path, monkeypatch, pairs_parquet):
    from huggingface_hub import constants

    folder, sizes = pairs_parquet
    # a validation split in the snapshot is not read
    td.write_parquet(folder / "data" / "validation-00000-of-00001.parquet",
                     {"input_image": [{"bytes": b"x", "path": None}], "edit_prompt": ["v"],
                      "edited_image": [{"bytes": b"x", "path": None}]},
                     image_columns=("input_image", "edited_image"), as_struct=True)
    (folder / "README.md").write_text("card")
    cache = tmp_path / "hub"
    td.hub_cache(cache, "org/edits", folder)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = open_source("org/edits", Columns.pix2pix(), cache_dir=cache)
    assert len(source) == len(sizes)
    assert "hub dataset org/edits" in source.description
    # the default cache (HF_HUB_CACHE) is used without cache_dir
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    source = open_source("org/edits", Columns.pix2pix(), max_samples=3, seed=1)
    b = take(loader_for(source, Transform(16, center_crop=True), batch_size=3, shuffle=False), 1)[0]
    np.testing.assert_array_equal(b["row"], np.random.default_rng(1).permutation(len(sizes))[:3])
    with pytest.raises(SdxError, match=r"hub dataset 'org/missing'.*HF_HUB_OFFLINE"):
        open_source("org/missing", Columns.pix2pix(), cache_dir=cache)
    with pytest.raises(SdxError, match="no such file or folder"):
        open_source(str(tmp_path / "nothing" / "here"), Columns.pix2pix())


def test_a_missing_local_folder_that_reads_as_a_hub_id_is_reported_as_both(tmp_path, monkeypatch):
    """`--dataset_name data/captions` before the folder is made: not "the hub could not be reached" alone."""
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SdxError) as e:
        open_source("data/captions", Columns.text_to_image(), cache_dir=tmp_path / "hub")
    message = str(e.value)
    print(message)
    assert message.startswith(f"dataset data/captions: there is no such local folder or file ({tmp_path}/data/captions)")
    assert "as a hub dataset id: hub dataset 'data/captions': not in the local cache" in message
    assert "a local folder (parquet files, or images with metadata.jsonl), a .parquet file, or a hub dataset id" in message


def test_max_train_samples_keeps_diffusers_rows(captions_parquet):
    path, _, _ = captions_parquet
    source = open_source(path, Columns.text_to_image(), max_samples=4, seed=7)
    want = np.random.default_rng(7).permutation(len(SIZES))[:4]  # datasets' shuffle(seed).select(range(4))
    assert len(source) == 4 and [source[i].row for i in range(4)] == list(want)
    assert len(open_source(path, Columns.text_to_image(), max_samples=100)) == len(SIZES)


def test_parquet_files_in_order_and_list(tmp_path):
    pic = td.encode(td.random_picture(16, 16, 0))
    a = td.write_parquet(tmp_path / "d" / "b" / "part-1.parquet", {"image": [pic] * 2, "text": ["b0", "b1"]},
                         image_columns=("image",))
    b = td.write_parquet(tmp_path / "d" / "a" / "part-2.parquet", {"image": [pic] * 3, "text": ["a0", "a1", "a2"]},
                         image_columns=("image",), row_group_size=2)
    folder = open_source(tmp_path / "d", Columns.text_to_image())
    assert [folder[i].text for i in range(5)] == ["a0", "a1", "a2", "b0", "b1"]
    assert folder[4].where == "b/part-1.parquet row 1" and folder[2].where == "a/part-2.parquet row 2"
    listed = open_source([a, b], Columns.text_to_image())
    assert [listed[i].text for i in range(5)] == ["b0", "b1", "a0", "a1", "a2"]


# ---------------------------------------------------------------------------------------------- loader


@pytest.fixture
def numbered(tmp_path):
    """24 rows of 16x16 pictures whose blue channel is their row."""
    n = 24
    path = td.write_parquet(tmp_path / "n.parquet",
                            {"image": [td.encode(td.coordinates(16, 16, tag=i)) for i in range(n)],
                             "text": [str(i) for i in range(n)]},
                            image_columns=("image",), row_group_size=5)
    return open_source(path, Columns.text_to_image())


def rows_of(batches) -> list[int]:
    return [int(r) for b in batches for r in b["row"]]


def test_epochs_are_permutations_shuffled_by_seed(numbered):
    t = Transform(16, random_flip=True, seed=0)
    a = rows_of(take(loader_for(numbered, t, batch_size=4, seed=0), 12))  # two epochs
    assert sorted(a[:24]) == list(range(24)) and sorted(a[24:]) == list(range(24))
    assert a[:24] != a[24:] and a[:24] != list(range(24))
    assert rows_of(take(loader_for(numbered, t, batch_size=4, seed=0), 12)) == a  # deterministic
    b = rows_of(take(loader_for(numbered, t, batch_size=4, seed=1), 12))
    assert b[:24] != a[:24] and b[:24] != a[24:] and b[24:] != a[24:]
    assert rows_of(take(loader_for(numbered, t, batch_size=4, shuffle=False), 6)) == list(range(24))
    for batch in take(loader_for(numbered, t, batch_size=4, seed=0), 12):  # pixels follow their row
        tags = np.rint((batch["pixels"][:, 0, 0, 2] + 1) * 127.5)
        np.testing.assert_array_equal(tags, batch["row"])
        assert [int(s) for s in batch["text"]] == list(batch["row"])


def test_index_is_the_stream_position(numbered):
    t = Transform(16)
    batches = take(loader_for(numbered, t, batch_size=4), 9)
    np.testing.assert_array_equal(np.concatenate([b["index"] for b in batches]), np.arange(36))
    loader = loader_for(numbered, t, batch_size=4)
    take(loader, 9)
    assert loader.epoch == 1 and loader.steps_per_epoch == 6


def test_hosts_split_each_epoch(numbered):
    t = Transform(16, seed=4)
    whole = take(loader_for(numbered, t, batch_size=4, seed=4), 12)
    hosts = [take(loader_for(numbered, t, batch_size=2, seed=4, shard_index=h, shard_count=2), 12) for h in range(2)]
    for epoch in range(2):
        parts = [rows_of(hosts[h])[12 * epoch: 12 * (epoch + 1)] for h in range(2)]
        assert not set(parts[0]) & set(parts[1]) and sorted(parts[0] + parts[1]) == list(range(24))
    # host h reads stream indices h, h + 2, ...: together they are the single-host stream, sample for sample
    merged = {int(i): (int(r), b["pixels"][j]) for hb in hosts for b in hb
              for j, (i, r) in enumerate(zip(b["index"], b["row"]))}
    for b in whole:
        for j, (i, r) in enumerate(zip(b["index"], b["row"])):
            assert merged[int(i)][0] == int(r)
            np.testing.assert_array_equal(merged[int(i)][1], b["pixels"][j])
    assert loader_for(numbered, t, batch_size=2, shard_index=1, shard_count=2).steps_per_epoch == 6


def test_finite_epochs_end(numbered):
    loader = loader_for(numbered, Transform(16), batch_size=5, num_epochs=2)
    batches = list(loader)
    assert len(batches) == 9 and sorted(rows_of(batches)[:24]) == list(range(24))


@pytest.fixture
def with_corrupt(tmp_path):
    """20 rows, 4 of them unreadable (truncated PNG, garbage, zero bytes, a missing file)."""
    cells, bad = [], {3: td.truncated_png(), 8: td.GARBAGE, 12: b"", 17: None}
    for i in range(20):
        if i in bad:
            cells.append({"bytes": bad[i], "path": "missing.png" if bad[i] is None else None})
        else:
            cells.append({"bytes": td.encode(td.coordinates(16, 16, tag=i)), "path": None})
    path = td.write_parquet(tmp_path / "c.parquet", {"image": cells, "text": [str(i) for i in range(20)]},
                            image_columns=("image",), as_struct=True, row_group_size=6)
    return open_source(path, Columns.text_to_image()), set(bad)


def test_unreadable_samples_are_skipped_and_counted(with_corrupt):
    source, bad = with_corrupt
    messages = []
    loader = loader_for(source, Transform(16, seed=2), batch_size=4, num_epochs=1, log=messages.append)
    batches = list(loader)
    assert len(batches) == 4 and all(b["pixels"].shape == (4, 16, 16, 3) for b in batches)
    assert sorted(rows_of(batches)) == sorted(set(range(20)) - bad)
    assert loader.skipped == 4 and loader.state()["skipped"] == 4
    assert len(messages) == 4 and all(m.startswith("skipped unreadable sample c.parquet row ") for m in messages)
    assert any("column 'image': zero bytes" in m for m in messages)
    assert any("row 17: column 'image': no such file" in m for m in messages)


def test_all_unreadable_is_an_error(tmp_path):
    path = td.write_parquet(tmp_path / "bad.parquet", {"image": [td.GARBAGE] * 3, "text": ["a"] * 3},
                            image_columns=("image",))
    source = open_source(path, Columns.text_to_image())
    with pytest.raises(SdxError, match="6 samples in a row could not be read"):
        take(loader_for(source, Transform(16), batch_size=1, log=lambda m: None), 1)


@pytest.mark.parametrize("fixture", ["numbered", "with_corrupt"])
def test_resume_equals_an_uninterrupted_run(fixture, request):
    source = request.getfixturevalue(fixture)
    source = source[0] if isinstance(source, tuple) else source
    t = Transform(16, random_flip=True, seed=9)
    straight = loader_for(source, t, batch_size=3, seed=9, log=lambda m: None)
    eight = take(straight, 8)
    first = loader_for(source, t, batch_size=3, seed=9, log=lambda m: None)
    it = iter(first)
    for _ in range(5):
        next(it)
    saved = json.loads(json.dumps(first.state()))  # what a checkpoint keeps
    next(it)  # the run goes on after saving; the saved position stays where it was
    first.close()
    fresh = loader_for(source, t, batch_size=3, seed=9, log=lambda m: None)
    fresh.restore(saved)
    assert fresh.skipped == saved["skipped"]
    rest = take(fresh, 3)
    for a, b in zip(eight[5:], rest):
        assert a.keys() == b.keys()
        for k in ("pixels", "original_size", "crop_top_left", "index", "row"):
            np.testing.assert_array_equal(a[k], b[k])
        assert list(a["text"]) == list(b["text"])
    assert fresh.skipped == straight.skipped and fresh.position == straight.position
    if fixture == "with_corrupt":
        assert straight.skipped > 0


def test_restore_refuses_another_run(numbered):
    t = Transform(16)
    state = loader_for(numbered, t, batch_size=2, seed=0).state()
    with pytest.raises(SdxError, match=r"seed"):
        loader_for(numbered, t, batch_size=2, seed=1).restore(state)
    with pytest.raises(SdxError, match=r"number of hosts"):
        loader_for(numbered, t, batch_size=2, shard_count=2).restore(state)
    with pytest.raises(SdxError, match="not a data-loader state"):
        loader_for(numbered, t, batch_size=2).restore({"position": 3})
    loader_for(numbered, t, batch_size=4).restore(json.dumps(state))  # a batch size change is fine


def test_worker_processes_give_the_same_batches(numbered):
    t = Transform(16, random_flip=True, seed=3)
    inline = take(loader_for(numbered, t, batch_size=4), 3)
    pooled = take(loader_for(numbered, t, batch_size=4, workers=2), 3)
    for a, b in zip(inline, pooled):
        np.testing.assert_array_equal(a["pixels"], b["pixels"])
        np.testing.assert_array_equal(a["index"], b["index"])
