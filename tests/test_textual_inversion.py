"""Textual inversion embeddings through `--embedding FILE[:TOKEN]` against diffusers' `load_textual_inversion`:
the token ids (multi-vector words expanded as `maybe_convert_prompt` does) against transformers' tokenizer with
the words added, for both tokenizer layouts, and whole images through `python -m sdx.sample` on tiny random
pipelines (SD 1.5 with the A1111 and diffusers layouts in the prompt and the negative prompt; SDXL with the
clip_l/clip_g layout), from the same initial noise, latents and images compared as in test_pipelines.py
(`tests.tiny_models.assert_parity`), the embeddings' effect against diffusers without them (`assert_effect`); and
the file and option checks.
"""

from __future__ import annotations

import pytest
import torch

from convert import library
from convert.sources import ModelOptions, parse_embedding_arg
from convert.textual_inversion import read_embedding
from sdx import model_folder
from sdx.errors import SdxError
from sdx.sample import main
from tests.test_pipelines import latent_shape, noise_file, reference, sample, tiny  # noqa: F401 (tiny: the fixture)
from tests.tiny_models import assert_effect, assert_parity, make_tiny_pipeline

diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")

STEPS = 3


def _vectors(n: int, width: int, seed: int) -> torch.Tensor:
    return 0.5 * torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def embedding_files(tmp_path, width: int) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (file, vectors): an A1111 two-vector file named after its word, and a diffusers one-vector file."""
    a1111, single = _vectors(2, width, 1), _vectors(1, width, 2)
    safetensors_torch.save_file({"emb_params": a1111}, str(tmp_path / "<cat-toy>.safetensors"))
    safetensors_torch.save_file({"<ugly>": single[0]}, str(tmp_path / "learned_embeds.safetensors"))
    return {"a1111": (str(tmp_path / "<cat-toy>.safetensors"), a1111),
            "diffusers": (str(tmp_path / "learned_embeds.safetensors"), single)}


@pytest.mark.parametrize("layout", ["hub", "transformers"])
def test_token_ids_match_transformers(tmp_path, layout):
    import transformers

    from sdx.tokenizer import CLIPTokenizer

    pipe = make_tiny_pipeline("sd15", tmp_path / "model", tokenizer_files=layout)
    files = embedding_files(tmp_path, pipe.text_encoder.config.hidden_size)
    folder = library.ensure_sdx_folder(tmp_path / "model", cache_dir=tmp_path / "cache", options=ModelOptions(
        embeddings=((files["a1111"][0], None), (files["diffusers"][0], None))))
    ours = model_folder.load_tokenizer(folder)
    reference = transformers.CLIPTokenizer.from_pretrained(tmp_path / "model" / "tokenizer")
    pipe = diffusers.StableDiffusionPipeline(**{**pipe.components, "tokenizer": reference})
    pipe.load_textual_inversion(files["a1111"][0], token="<cat-toy>")
    pipe.load_textual_inversion(files["diffusers"][0])
    prompts = ["a <cat-toy> on a table", "<ugly>, <cat-toy><cat-toy> and <ugly>!", "a cat toy", "<CAT-TOY> upper"]
    for prompt in prompts:
        want = reference(pipe.maybe_convert_prompt(prompt, reference), padding="max_length", max_length=77,
                         truncation=True).input_ids
        assert ours([prompt])[0].tolist() == want, prompt
    assert ours.vocab_size == len(reference) == 49408 + 3
    assert isinstance(ours, CLIPTokenizer)


def test_sd_images_match_diffusers(tiny, tmp_path):
    pipe, folder = tiny("sd15")
    files = embedding_files(tmp_path, pipe.text_encoder.config.hidden_size)
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = dict(prompt="a <toy> in the snow", negative_prompt="<ugly>", latents=noise, num_inference_steps=STEPS,
               height=64, width=64)
    plain = reference(pipe, **run)  # the words are BPE pieces without the embeddings
    words = diffusers.StableDiffusionPipeline(**pipe.components)
    words.load_textual_inversion(files["a1111"][0], token="<toy>")
    words.load_textual_inversion(files["diffusers"][0])
    ref = reference(words, **run)
    words.unload_textual_inversion()  # the fixture's tokenizer and text encoder, as they were
    ours = sample(tmp_path, folder, "--prompt", "a <toy> in the snow", "--negative-prompt", "<ugly>", "--steps",
                  str(STEPS), "--height", "64", "--width", "64", "--latents", str(latents),
                  "--embedding", f"{files['a1111'][0]}:<toy>", "--embedding", files["diffusers"][0])
    assert_parity(ours, ref)
    assert_effect("--embedding (two files)", ref, plain)


def test_sdxl_images_match_diffusers(tiny, tmp_path):
    pipe, folder = tiny("sdxl")
    vectors = {"clip_l": _vectors(2, pipe.text_encoder.config.hidden_size, 3),
               "clip_g": _vectors(2, pipe.text_encoder_2.config.hidden_size, 4)}
    path = tmp_path / "<xl-style>.safetensors"
    safetensors_torch.save_file(vectors, str(path))
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = dict(prompt="a house, <xl-style>", latents=noise, num_inference_steps=STEPS, height=64, width=64)
    plain = reference(pipe, **run)
    words = diffusers.StableDiffusionXLPipeline(**pipe.components)
    words.load_textual_inversion(vectors["clip_l"], token="<xl-style>", text_encoder=words.text_encoder,
                                 tokenizer=words.tokenizer)
    words.load_textual_inversion(vectors["clip_g"], token="<xl-style>", text_encoder=words.text_encoder_2,
                                 tokenizer=words.tokenizer_2)
    ref = reference(words, **run)
    ours = sample(tmp_path, folder, "--prompt", "a house, <xl-style>", "--steps", str(STEPS), "--height", "64", "--width",
                  "64", "--latents", str(latents), "--embedding", str(path))  # the token: the file's name
    assert_parity(ours, ref)
    assert_effect("--embedding (clip_l and clip_g)", ref, plain)


def test_files_and_options(tiny, tmp_path, capsys):
    pipe, folder = tiny("sd15")
    width = pipe.text_encoder.config.hidden_size
    assert parse_embedding_arg("a/b.safetensors:<tok>") == ("a/b.safetensors", "<tok>")
    assert parse_embedding_arg("a/b.safetensors") == ("a/b.safetensors", None)
    with pytest.raises(SdxError, match="pickled"):
        read_embedding(tmp_path / "easynegative.pt", None)
    safetensors_torch.save_file({"a": torch.zeros(2, width), "b": torch.zeros(2, width)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(SdxError, match="not an embedding sdx knows"):
        read_embedding(tmp_path / "two.safetensors", None)
    base = ["--model", str(folder), "--prompt", "x", "--steps", "1", "--output", str(tmp_path / "out"),
            "--cache", str(tmp_path / "c"), "--quiet"]
    cases = {  # file contents -> what the error says
        "wide": ({"emb_params": torch.zeros(1, width + 1)}, "wide vectors"),
        "xl": ({"clip_l": torch.zeros(1, width), "clip_g": torch.zeros(1, 8)}, "an SDXL embedding"),
        "a": ({"emb_params": torch.zeros(1, width)}, "already in the tokenizer's vocabulary"),  # "a" is a CLIP word
    }
    for name, (tensors, message) in cases.items():
        safetensors_torch.save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        assert main(base + ["--embedding", str(tmp_path / f"{name}.safetensors")]) == 2
        assert message in capsys.readouterr().err


def test_hub_embedding_fetches_its_file_alone(tmp_path, monkeypatch):
    from convert import hub
    from convert.sources import resolve_embedding
    from tests.test_convert import FakeHub

    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("learned_embeds.safetensors", "learned_embeds.bin", "README.md"):
        (repo / name).write_text("x")
    fake = FakeHub("org/words", repo, tmp_path / "cache")
    monkeypatch.setattr(hub, "reachable", lambda: True)  # the hub answers
    for name in ("list_repo_files", "snapshot_download"):
        monkeypatch.setattr(hub, name, getattr(fake, name))
    assert resolve_embedding("org/words/learned_embeds.safetensors").is_file()
    assert fake.downloaded == {"learned_embeds.safetensors"}
    with pytest.raises(SdxError, match="has no file other.safetensors"):
        resolve_embedding("org/words/other.safetensors")
    with pytest.raises(SdxError, match="name the file in the repo"):
        resolve_embedding("org/words")
