"""The readers of files a user hands to sdx, fuzzed with hypothesis: each input gives a result or one
SdxError (a training image: a skip with its reason), never another exception, a hang or an allocation of
the size a header claims.

Readers: safetensors (`sdx.io.read_safetensors`), diffusers folders' JSON (`model_index.json` and a
component's `config.json`, converted as `python -m convert` does), sdx folders' `sdx.json` (loaded as the
sampler does), scheduler configs under every --scheduler, LoRA files (`convert.lora.lora_deltas`),
pickled checkpoints (`convert.single_file.load_tensors`, torch's weights_only only), images (the
sampler's `--image` reader and the training loader's cell decoder) and training parquet files (rows of
any content, files cut short or corrupted, through `train.data`). The examples are derandomized (the
same inputs on every run): SDX_FUZZ_EXAMPLES per property (120 unless set; a quarter where an input
loads a whole pipeline), about 1,350 inputs in all.
A longer search: `SDX_FUZZ_EXAMPLES=1000 pytest tests/test_fuzz_readers.py`.
"""

from __future__ import annotations

import dataclasses
import io as pyio
import json
import os
import pickle
import re
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from convert import library, lora, single_file, sources
from pipelines.cli import read_image
from pipelines.pipeline import Pipeline
from sdx import io, schedulers
from sdx.errors import SdxError
from sdx.images import UnreadableImage, decode as decode_image
from tests.train_datasets import IMAGE_STRUCT

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("SDX_FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ALLOCATION_LIMIT = 64 * 2**20  # bytes any one read may allocate; every input here is far smaller
# A corrupted image header may claim any size up to PIL's decompression-bomb limit (twice MAX_IMAGE_PIXELS
# pixels, refused above it), and PIL allocates the pixels before it finds the data missing: at most
# 4 bytes a pixel, and the decoder's own buffers.
IMAGE_ALLOCATION_LIMIT = 4 * 2 * Image.MAX_IMAGE_PIXELS + ALLOCATION_LIMIT


def _bounded(read, *args, limit: int = ALLOCATION_LIMIT):
    """read(*args) with Python's and numpy's allocations traced: the result, or the SdxError it raised."""
    tracemalloc.start()
    try:
        return read(*args)
    except SdxError as e:
        return e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < limit, f"{peak} bytes allocated"


# --------------------------------------------------------------------------------------------------
# safetensors

DTYPES = ["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "Q4", "", "f32"]
names = st.text(min_size=0, max_size=12)  # any unicode, lone surrogates included (JSON escapes them)
entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(DTYPES),
    "shape": st.one_of(st.lists(st.integers(-2, 2**40), max_size=4), st.lists(st.integers(0, 4), max_size=3),
                       st.just("3"), st.lists(st.floats(allow_nan=True), max_size=2)),
    "data_offsets": st.one_of(st.tuples(st.integers(-8, 300), st.integers(-8, 300)).map(list),
                              st.lists(st.integers(0, 2**62), max_size=3), st.just([0.5, 4.5]), st.none()),
})


def _safetensors_bytes(header: dict, data: bytes, claimed: int | None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if claimed is None else claimed) + raw + data


@FUZZ
@given(header=st.dictionaries(names, entries, max_size=4),
       metadata=st.one_of(st.none(), st.dictionaries(names, names, max_size=2), st.integers()),
       data=st.binary(max_size=300),
       claimed=st.one_of(st.none(), st.integers(0, 2**64 - 1), st.just(10**12)))
def test_safetensors_headers_that_lie(tmp_path, header, metadata, data, claimed):
    if metadata is not None:
        header = {**header, "__metadata__": metadata}
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(_safetensors_bytes(header, data, claimed))
    out = _bounded(io.read_safetensors, path)
    if not isinstance(out, SdxError):
        assert sum(a.nbytes for a in out.values()) <= len(data)
        for array in out.values():
            np.asarray(array).tobytes()  # every view is readable


@FUZZ
@given(cut=st.integers(0, 10**6), flip=st.integers(0, 10**6), value=st.integers(0, 255))
def test_safetensors_truncated_or_corrupted(tmp_path, cut, flip, value):
    path = tmp_path / "model.safetensors"
    io.write_safetensors(path, {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.float16)})
    raw = bytearray(path.read_bytes())
    raw[flip % len(raw)] = value
    path.write_bytes(bytes(raw[: cut % (len(raw) + 1)]))
    out = _bounded(io.read_safetensors, path)
    if not isinstance(out, SdxError):
        assert {k: v.shape for k, v in out.items()} in ({"a": (3, 4), "b": (5,)},) or sum(
            v.nbytes for v in out.values()) <= len(raw)


@FUZZ
@given(name=st.binary(min_size=1, max_size=8))
def test_safetensors_names_that_are_not_utf8_or_repeat(tmp_path, name):
    raw = b'{"' + name + b'": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "' + name + b'": 3}'
    path = tmp_path / "names.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00")
    out = _bounded(io.read_safetensors, path)
    assert isinstance(out, (SdxError, dict))


# --------------------------------------------------------------------------------------------------
# model folders: model_index.json and config.json


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=3), max_leaves=8)


@pytest.fixture(scope="module")
def sd15(tmp_path_factory) -> Path:
    pytest.importorskip("diffusers")
    from tests.tiny_models import make_tiny_pipeline

    folder = tmp_path_factory.mktemp("fuzz") / "sd15"
    make_tiny_pipeline("sd15", folder)
    return folder


MODEL_JSON = ["model_index.json", "unet/config.json", "vae/config.json", "text_encoder/config.json",
              "scheduler/scheduler_config.json"]
wrong_values = st.one_of(json_values, st.sampled_from([-1, 0, 1, 2**40, 1.5, True, "", [1], [1, 2, 3, 4, 5]]))


def _convert_mutated(sd15: Path, tmp_path: Path, file: str, mutate) -> object:
    """Copy `sd15`, replace `file` by mutate(its JSON), convert the copy to an sdx folder (what
    `python -m convert` and the sampler do): a folder, or one SdxError."""
    folder = tmp_path / "model"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(sd15, folder)
    target = folder / file
    target.write_bytes(mutate(json.loads(target.read_text())))
    return _bounded(lambda: library.convert(folder, tmp_path / "out", overwrite=True))


@FUZZ
@given(file=st.sampled_from(MODEL_JSON), value=json_values, cut=st.one_of(st.none(), st.integers(0, 10**4)))
def test_model_folder_json_cut_short_or_replaced(sd15, tmp_path, file, value, cut):
    def mutate(original: dict) -> bytes:
        text = json.dumps(original if cut is not None else value).encode()
        return text if cut is None else text[: cut % (len(text) + 1)]

    _convert_mutated(sd15, tmp_path, file, mutate)


@FUZZ
@given(file=st.sampled_from(MODEL_JSON), key=st.integers(0, 1000), value=wrong_values)
def test_model_folder_json_fields_of_the_wrong_type(sd15, tmp_path, file, key, value):
    def mutate(original: dict) -> bytes:  # the key-th field (modulo their number) set to value
        return json.dumps({**original, sorted(original)[key % len(original)]: value}).encode()

    _convert_mutated(sd15, tmp_path, file, mutate)


@pytest.mark.parametrize("file, key", [("text_encoder/config.json", "num_hidden_layers"),
                                       ("unet/config.json", "layers_per_block"),
                                       ("unet/config.json", "transformer_layers_per_block"),
                                       ("vae/config.json", "layers_per_block")])
def test_a_layer_count_of_any_size_is_refused_before_building(sd15, tmp_path, file, key):
    """The model is built layer by layer before its weights are matched: a count past MAX_DEPTH would hang."""
    out = _convert_mutated(sd15, tmp_path, file, lambda original: json.dumps({**original, key: 10**9}).encode())
    assert isinstance(out, SdxError) and f"{key}=1000000000 must be a layer count from 1 to 128" in str(out)


@pytest.fixture(scope="module")
def sdx15(sd15, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "sdx15"
    library.convert(sd15, out)
    return out


def _json_paths(tree, path=()):
    """Every path to a value in a JSON tree, the root's () first."""
    yield path
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, child in items:
        yield from _json_paths(child, (*path, key))


def _replaced(tree, path, value):
    if not path:
        return value
    copy = dict(tree) if isinstance(tree, dict) else list(tree)
    copy[path[0]] = _replaced(tree[path[0]], path[1:], value)
    return copy


@settings(FUZZ, max_examples=max(EXAMPLES // 4, 1))  # each example loads a whole pipeline
@given(index=st.integers(0, 10**4), value=wrong_values, cut=st.one_of(st.none(), st.integers(0, 10**5)))
def test_sdx_folder_spec_cut_short_or_of_the_wrong_type(sdx15, tmp_path, index, value, cut):
    """sdx.json cut short, or any one value in it (a component's config field, a file name, ...) replaced:
    the pipeline loads, or one SdxError."""
    spec = json.loads((sdx15 / "sdx.json").read_text())
    if cut is None:
        paths = list(_json_paths(spec))
        text = json.dumps(_replaced(spec, paths[index % len(paths)], value)).encode()
    else:
        text = json.dumps(spec).encode()[: cut % (len(json.dumps(spec)) + 1)]
    folder = tmp_path / "model"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(sdx15, folder)
    (folder / "sdx.json").write_bytes(text)
    out = _bounded(lambda: Pipeline.load(folder))
    assert isinstance(out, (SdxError, Pipeline))


@pytest.mark.parametrize("path, value, message", [
    (("components",), [], "components=[] must be an object"),
    (("components", "vae", "file"), 5, "components.vae: file=5 must be a string"),
    (("components", "unet", "config", "layers_per_block"), [10**9, 1],
     "layers_per_block=[1000000000, 1] must be a non-empty list, each entry a layer count from 1 to 128"),
    (("components", "text_encoder", "config", "hidden_act"), None, "hidden_act=None must be a string"),
])
def test_sdx_folder_spec_errors_name_the_field(sdx15, tmp_path, path, value, message):
    folder = tmp_path / "model"
    shutil.copytree(sdx15, folder)
    (folder / "sdx.json").write_text(json.dumps(_replaced(json.loads((sdx15 / "sdx.json").read_text()), path, value)))
    with pytest.raises(SdxError, match=re.escape(message)):
        Pipeline.load(folder)


SCHEDULER_FIELDS = sorted({f.name for cls, _ in schedulers.SCHEDULERS.values() for f in dataclasses.fields(cls)})


@FUZZ
@given(name=st.sampled_from(sorted(schedulers.SCHEDULERS)), key=st.sampled_from(SCHEDULER_FIELDS),
       value=wrong_values, steps=st.integers(1, 60))
def test_scheduler_config_fields_of_the_wrong_type(sd15, name, key, value, steps):
    """A scheduler_config.json field of any value, under any --scheduler: a schedule, or one SdxError."""
    config = {**json.loads((sd15 / "scheduler" / "scheduler_config.json").read_text()), key: value}
    out = _bounded(lambda: schedulers.from_name(name, config).schedule(steps))
    assert isinstance(out, (SdxError, dict))


# --------------------------------------------------------------------------------------------------
# LoRA files

LORA_KEYS = [
    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_up.weight",
    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight",
    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.alpha",
    "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight",
    "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight",
    "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight",
    "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight",
    "unet.mid_block.resnets.0.conv1.lora.up.weight",
    "lora_unet_nowhere.lora_up.weight",
    "lora_unet_down_blocks_0_attentions_0_proj_in.hada_w1_a",
    "lora_unet_down_blocks_0_attentions_0_proj_in.hada_w1_b",
    "lora_unet_down_blocks_0_attentions_0_proj_in.hada_w2_a",
    "lora_unet_down_blocks_0_attentions_0_proj_in.hada_w2_b",
    "lora_unet_down_blocks_0_attentions_0_proj_in.hada_t1",
    "lora_unet_mid_block_resnets_0_conv1.lokr_w1",
    "lora_unet_mid_block_resnets_0_conv1.lokr_w2_a",
    "lora_unet_mid_block_resnets_0_conv1.lokr_w2_b",
    "lora_unet_mid_block_resnets_0_conv1.lokr_t2",
    "lora_unet_mid_block_resnets_0_conv1.alpha",
    "something_else",
]


@pytest.fixture(scope="module")
def sd15_checkpoint(sd15):
    return sources.read_source(sd15)


@FUZZ
@given(tensors=st.dictionaries(st.sampled_from(LORA_KEYS),
                               st.lists(st.integers(0, 6), min_size=0, max_size=4), min_size=1, max_size=6),
       metadata=st.dictionaries(st.sampled_from(["ss_network_alpha", "ss_network_dim", "other"]), st.text(max_size=6),
                                max_size=2))
def test_lora_files_with_any_keys_and_shapes(sd15_checkpoint, tmp_path, tensors, metadata):
    path = tmp_path / "lora.safetensors"
    io.write_safetensors(path, {k: np.ones(shape, np.float32) for k, shape in tensors.items()}, metadata=metadata)
    out = _bounded(lora.lora_deltas, sd15_checkpoint, path)
    assert isinstance(out, (SdxError, dict))
    if isinstance(out, dict):  # and merging what it read: an SdxError too, never another exception
        ck = dataclasses.replace(sd15_checkpoint, tensors={c: dict(t) for c, t in sd15_checkpoint.tensors.items()})
        assert isinstance(_bounded(lora.merge_lora, ck, path), (SdxError, type(None)))


# --------------------------------------------------------------------------------------------------
# pickled checkpoints: never unpickled beyond torch's weights_only


class _Payload:
    """Unpickling this writes a file: what a malicious .ckpt does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


def test_a_pickle_that_runs_code_is_refused_without_running_it(tmp_path):
    torch = pytest.importorskip("torch")
    marker = tmp_path / "ran"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "payload": _Payload(marker)}, path)
    with pytest.raises(SdxError, match="weights_only"):
        single_file.load_tensors(path)
    assert not marker.exists()
    legacy = tmp_path / "legacy.ckpt"
    legacy.write_bytes(b"\x80\x02" + pickle.dumps(_Payload(marker), protocol=2)[2:])
    with pytest.raises(SdxError):
        single_file.load_tensors(legacy)
    assert not marker.exists()


@FUZZ
@given(cut=st.integers(0, 10**5), flip=st.integers(0, 10**5), value=st.integers(0, 255))
def test_pickled_checkpoints_truncated_or_corrupted(tmp_path, cut, flip, value):
    torch = pytest.importorskip("torch")
    path = tmp_path / "model.ckpt"
    buffer = pyio.BytesIO()
    torch.save({"state_dict": {"model.diffusion_model.w": torch.arange(6.0)}}, buffer)
    raw = bytearray(buffer.getvalue())
    raw[flip % len(raw)] = value
    path.write_bytes(bytes(raw[: cut % (len(raw) + 1)]))
    out = _bounded(single_file.load_tensors, path)
    assert isinstance(out, (SdxError, dict))


# --------------------------------------------------------------------------------------------------
# images


def _encoded(mode: str, fmt: str) -> bytes:
    size = (9, 7)
    picture = {"I;16": Image.new("I;16", size, 40000), "P": Image.new("P", size, 3), "1": Image.new("1", size, 1),
               "CMYK": Image.new("CMYK", size, (10, 20, 30, 40)), "LA": Image.new("LA", size, (100, 50)),
               "RGBA": Image.new("RGBA", size, (1, 2, 3, 0)), "RGB": Image.new("RGB", size, (200, 10, 10))}[mode]
    if mode == "P":
        picture.info["transparency"] = 3
    buffer = pyio.BytesIO()
    picture.save(buffer, format=fmt)
    return buffer.getvalue()


FORMATS = [(m, "PNG") for m in ("I;16", "P", "1", "LA", "RGBA", "RGB")] + [(m, "JPEG") for m in ("CMYK", "RGB")]


def _huge_png() -> bytes:
    """A PNG whose header claims 100,000 x 100,000 pixels (a decompression bomb), with one row of data."""
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 301)) + chunk(b"IEND", b"")


def _read_both(tmp_path: Path, raw: bytes) -> None:
    """The sampler's --image reader and the training decoder: an RGB image or their one error."""
    try:
        assert decode_image(raw).mode == "RGB"
    except UnreadableImage:
        pass
    path = tmp_path / "image.bin"
    path.write_bytes(raw)
    out = _bounded(read_image, str(path), limit=IMAGE_ALLOCATION_LIMIT)
    assert isinstance(out, SdxError) or out.mode == "RGB"


@pytest.mark.parametrize("mode, fmt", FORMATS)
def test_every_image_mode_reads_as_rgb(tmp_path, mode, fmt):
    raw = _encoded(mode, fmt)
    assert decode_image(raw).mode == "RGB" and decode_image(raw).size == (9, 7)
    (tmp_path / "image").write_bytes(raw)
    picture = read_image(str(tmp_path / "image"))
    assert picture.mode == "RGB" and picture.size == (9, 7)


@pytest.mark.parametrize("raw", [b"", _huge_png(), b"\x89PNG\r\n\x1a\n", b"GIF89a", b"PK\x03\x04 not a zip"])
def test_empty_bomb_and_headers_only_are_one_error(tmp_path, raw):
    with pytest.raises(UnreadableImage):
        decode_image(raw)
    path = tmp_path / "image.png"
    path.write_bytes(raw)
    with pytest.raises(SdxError, match="cannot read the image"):
        read_image(str(path))


@FUZZ
@given(which=st.sampled_from(FORMATS), cut=st.integers(0, 10**5), flip=st.integers(0, 10**5),
       value=st.integers(0, 255))
def test_images_truncated_or_corrupted(tmp_path, which, cut, flip, value):
    raw = bytearray(_encoded(*which))
    raw[flip % len(raw)] = value
    _read_both(tmp_path, bytes(raw[: cut % (len(raw) + 1)]))


# --------------------------------------------------------------------------------------------------
# parquet rows for training

image_cells = st.one_of(
    st.none(), st.binary(max_size=64),
    st.sampled_from(FORMATS).map(lambda which: _encoded(*which)),
    st.tuples(st.sampled_from(FORMATS), st.integers(0, 10**4)).map(lambda t: _encoded(*t[0])[: t[1] % 60]),
)
text_columns = st.one_of(
    st.tuples(st.just(pa.string()), st.lists(st.one_of(st.none(), st.text(max_size=20)), min_size=3, max_size=3)),
    st.tuples(st.just(pa.list_(pa.string())),
              st.lists(st.one_of(st.none(), st.lists(st.text(max_size=5), max_size=2)), min_size=3, max_size=3)),
    st.tuples(st.just(pa.int64()), st.lists(st.one_of(st.none(), st.integers(-5, 5)), min_size=3, max_size=3)),
    st.tuples(st.just(pa.binary()), st.lists(st.binary(max_size=5), min_size=3, max_size=3)),
)


def _one_batch(path: Path):
    """Open `path` as a text-to-image dataset and draw one batch of 2 (unreadable rows skipped)."""
    from train.data import Columns, Transform, make_loader, open_source

    loader = make_loader(open_source(path, Columns.text_to_image()), Transform(8), batch_size=2, seed=0,
                         shard_index=0, shard_count=1, threads=1, log=lambda _message: None)
    try:
        return next(iter(loader))
    finally:
        loader.close()


@FUZZ
@given(images=st.lists(image_cells, min_size=3, max_size=3), text=text_columns, as_struct=st.booleans())
def test_parquet_rows_of_any_content(tmp_path, images, text, as_struct):
    """Rows whose image cells are anything (null, garbage, cut short, every mode) and whose caption
    column is of any type: a batch of readable rows, or one SdxError naming the column or the rows."""
    kind, texts = text
    cells = [{"bytes": c, "path": None} if as_struct and c is not None else c for c in images]
    table = pa.table({"image": pa.array(cells, type=IMAGE_STRUCT if as_struct else pa.binary()),
                      "text": pa.array(texts, type=kind)})
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": {"image": {"_type": "Image"}}}})})
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path)
    out = _bounded(_one_batch, path, limit=IMAGE_ALLOCATION_LIMIT)
    if not isinstance(out, SdxError):
        assert out["pixels"].shape == (2, 8, 8, 3) and all(isinstance(t, str) for t in out["text"])


@FUZZ
@given(cut=st.integers(0, 10**5), flip=st.integers(0, 10**5), value=st.integers(0, 255))
def test_parquet_file_truncated_or_corrupted(tmp_path, cut, flip, value):
    table = pa.table({"image": pa.array([_encoded("RGB", "PNG")] * 3, type=pa.binary()), "text": ["a", "b", "c"]})
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    raw = bytearray(buffer.getvalue().to_pybytes())
    raw[flip % len(raw)] = value
    path = tmp_path / "rows.parquet"
    path.write_bytes(bytes(raw[: cut % (len(raw) + 1)]))
    out = _bounded(_one_batch, path)
    assert isinstance(out, (SdxError, dict))
