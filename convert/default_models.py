"""The default models: sdx's own SDXL-architecture models, trained by `train/recipe.sh` on the shapes world
(`train.shapes`) and shipped in the package.

- `default`: text-to-image ("a red circle on a blue background"); what `python -m sdx.sample` uses
  when no --model is given.
- `default-edit`: InstructPix2Pix ("make the circle green"), fine-tuned from `default`'s first training pass;
  used when no --model is given and --image is.

They are shipped compactly under sdx/assets/models/ in float16: NAME/sdx.json with only the weight files
that NAME does not share. A weight file missing from NAME/ is the file of that name in default/ (the edit
model shares the text encoders and the VAE), and the tokenizer folders are sdx's built-in CLIP
vocabulary (`sdx.tokenizer.write_builtin_folder`), whose pad tokens NAME/pack.json records. `folder`
assembles a complete sdx folder in the cache on first use; `pack` writes the compact form from two
trained sdx folders (the last step of the recipe):

    python -m convert.default_models pack T2I_FOLDER EDIT_FOLDER [--guidance-scale G] [--edit-guidance-scale G]
        [--out sdx/assets/models]

--guidance-scale and --edit-guidance-scale write the text-to-image and the edit model's own guidance scale into
their sdx.json (`Family.guidance_scale`: what a request that names none gets; measured in docs/default-models.md).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

import sdx
from sdx import io, model_folder
from sdx.errors import ArgumentParser, SdxError, run_command
from sdx.tokenizer import write_builtin_folder

SHIPPED = Path(sdx.__file__).resolve().parent / "assets" / "models"
NAMES = ("default", "default-edit")
BASE = "default"  # where the shared files live
PACK_FILE = "pack.json"
DTYPE = "float16"


def warn_other_size(name: str, sizes: set[tuple[int, int]], trained: int) -> None:
    """One warning line when default model `name` is asked for (height, width) `sizes` other than the `trained`
    square size it knows (its shapes are drawn for that frame: another one stretches or repeats them)."""
    other = sorted(size for size in sizes if size != (trained, trained))
    if name in NAMES and not Path(name).exists() and other:
        asked = "; ".join(f"height {h}, width {w}" for h, w in other)
        print(f"warning: {name} was trained at {trained}x{trained} only; at {asked} its shapes come out stretched "
              f"or repeated (leave out --height and --width, or give {trained})", file=sys.stderr)


def _fingerprint(packed: Path, base: Path) -> str:
    """A short hash of every file the assembled model is made of (its own and the shared ones in `base`),
    so that new weights, even of the same size, get a new cache folder (23 MB: about 0.1 s)."""
    h = hashlib.sha256()
    for path in sorted({p for d in (packed, base) for p in d.iterdir() if p.is_file()}):
        h.update(f"{path.parent.name}/{path.name}\0".encode() + path.read_bytes())
    return h.hexdigest()[:16]


def folder(name: str, cache: Path, *, shipped: Path = SHIPPED) -> Path:
    """The complete sdx folder of default model `name`, assembled under `cache` on first use."""
    packed = shipped / name
    if not (packed / model_folder.SPEC_FILE).is_file():
        raise SdxError(f"the default model {name!r} is not in this installation ({packed} is missing); "
                       "train it with `make default-models`")
    out = cache / f"{name}-{_fingerprint(packed, shipped / BASE)}"
    if model_folder.is_model_folder(out):
        return out
    spec = model_folder.read_spec(packed)
    pads = io.read_json(packed / PACK_FILE, obj=True)["tokenizers"]
    with model_folder.building_folder(out, overwrite=True) as tmp:
        for entry in spec["components"].values():
            if "file" in entry:
                src = packed / entry["file"]
                shutil.copyfile(src if src.is_file() else shipped / BASE / entry["file"], tmp / entry["file"])
            elif "folder" in entry:
                write_builtin_folder(tmp / entry["folder"], pad_token=pads[entry["folder"]])
        shutil.copyfile(packed / model_folder.SPEC_FILE, tmp / model_folder.SPEC_FILE)
    return out


def _pad_tokens(src: Path, spec: dict) -> dict[str, str]:
    """{tokenizer folder: pad token}, after checking each folder is the built-in vocabulary."""
    pads = {}
    for entry in spec["components"].values():
        if "folder" not in entry:
            continue
        tok = src / entry["folder"]
        with tempfile.TemporaryDirectory() as tmp:
            probe = write_builtin_folder(Path(tmp), pad_token="!")
            same = all((tok / f).read_bytes() == (probe / f).read_bytes() for f in ("vocab.json", "merges.txt"))
        if not same:
            raise SdxError(f"{tok}: not sdx's built-in CLIP vocabulary; only that can be packed")
        pads[entry["folder"]] = io.read_json(tok / "special_tokens_map.json", obj=True)["pad_token"]
    return pads


def pack(t2i: Path, edit: Path, out: Path = SHIPPED, *, guidance_scale: float | None = None,
         edit_guidance_scale: float | None = None) -> Path:
    """Write the compact form of the two trained sdx folders under `out` (float16; shared files once), the
    text-to-image model's spec naming `guidance_scale` as its own and the edit model's `edit_guidance_scale`,
    where given."""
    staging = out.parent / f".{out.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    own_guidance = dict(zip(NAMES, (guidance_scale, edit_guidance_scale)))
    for name, src in zip(NAMES, (t2i, edit)):
        model_folder.resave(src, staging / f"{name}.full", dtype=DTYPE)
    base = staging / f"{BASE}.full"
    with model_folder.building_folder(out, overwrite=True) as tmp:
        for name in NAMES:
            full = staging / f"{name}.full"
            spec = model_folder.read_spec(full)
            (tmp / name).mkdir()
            for entry in spec["components"].values():
                shared = name != BASE and (base / entry.get("file", "-")).is_file() and \
                    (base / entry["file"]).read_bytes() == (full / entry["file"]).read_bytes()
                if "file" in entry and not shared:
                    shutil.copyfile(full / entry["file"], tmp / name / entry["file"])
            if own_guidance[name] is not None:
                spec["extra"][model_folder.GUIDANCE_KEY] = own_guidance[name]
            io.atomic_write_json(tmp / name / model_folder.SPEC_FILE, spec)
            io.atomic_write_json(tmp / name / PACK_FILE, {"tokenizers": _pad_tokens(full, spec), "shared_from": BASE})
    shutil.rmtree(staging)
    return out


def packed_size(out: Path = SHIPPED) -> int:
    """Bytes of every file in the compact form under `out` (what the package carries)."""
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m convert.default_models", description="pack the trained default models")
    sub = p.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    s = sub.add_parser("pack", help="write sdx/assets/models from the trained text-to-image and edit folders")
    s.add_argument("t2i", help="the text-to-image sdx folder")
    s.add_argument("edit", help="the InstructPix2Pix sdx folder")
    s.add_argument("--out", default=str(SHIPPED), help=f"where to write (default {SHIPPED})")
    s.add_argument("--guidance-scale", type=float, help="the text-to-image model's own guidance scale (default: none)")
    s.add_argument("--edit-guidance-scale", type=float, help="the edit model's own guidance scale (default: none)")
    return p


def main(argv=None) -> int:
    p = parser()

    def body():
        args = p.parse_args(argv)
        out = pack(Path(args.t2i), Path(args.edit), Path(args.out), guidance_scale=args.guidance_scale,
                   edit_guidance_scale=args.edit_guidance_scale)
        print(f"wrote {out} ({packed_size(out) / 1e6:.1f} MB)", file=sys.stderr)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
