"""python -m train.textual_inversion: a step's loss and the new words' gradients against diffusers'
textual_inversion.py in PyTorch (transformers' CLIP with its token embeddings resized and the new rows set from
the initializer token, the same batch, noise and timesteps), SD and SDXL; end to end on the tiny demo models:
only the words train, the run resumes bit-identical (SD), and `learned_embeds.safetensors` read by `--embedding`
draws the last validation's image, and by diffusers' `load_textual_inversion` gives the same token embeddings.
"""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image
from safetensors.numpy import load_file

from convert.sources import ModelOptions
from pipelines.cli import resolve_model
from pipelines.family import Family
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from sdx import textual_inversion as TI
from train import denoise, textual_inversion
from train import step as steplib
from tests.test_train_step import CASES, TEXT_CASES, _batch, _loss_config, _models, _reference_loss, _text_encoder

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

VOCAB = 49408
WORD_IDS = [VOCAB, VOCAB + 1]  # a two-vector word: T, T_1


@pytest.mark.parametrize("family", TEXT_CASES)
def test_word_loss_and_gradients_match_diffusers(family):
    """The words start from token 1000's vector (--initializer_token); the batch's ids hold them; only their
    vectors get a gradient: diffusers' whole-table gradient at the new rows (its other rows are put back after
    every step) against sdx's WordParam gradient, and the loss, in float32."""
    from tests.helpers_text import random_ids

    unet_config, encoder_shapes = TEXT_CASES[family]
    xl = family == "sdxl"
    case = CASES[0]  # epsilon, no dropout: diffusers' textual inversion objective
    ref, unet = _models(4, config=unet_config)
    refs, models = {}, {"unet": unet}
    names = ("text_encoder", "text_encoder_2")[:len(encoder_shapes)]
    for i, (name, (hidden, projection)) in enumerate(zip(names, encoder_shapes)):
        refs[name], models[name] = _text_encoder(hidden, projection, seed=10 + i)
        start = models[name].text_model.embeddings.token_embedding.embedding[...][1000]
        TI.add_words(models[name], jnp.broadcast_to(start, (len(WORD_IDS), hidden)))
        refs[name].requires_grad_(False)
        refs[name].resize_token_embeddings(VOCAB + len(WORD_IDS))
        table = refs[name].get_input_embeddings().weight
        with torch.no_grad():
            table[WORD_IDS] = table[1000].clone()
        table.requires_grad_(True)
    ref.requires_grad_(False)
    module = nnx.Dict(models)

    batch = {k: v for k, v in _batch(4, False).items() if k not in ("context", "pooled")}
    pads = (49407, 0)
    ids = np.stack([random_ids(4, pad_id=pads[j], seed=20 + j) for j in range(len(names))], axis=1)  # (B, E, 77)
    ids[:, :, 2], ids[:, :, 3] = WORD_IDS  # "... T T_1 ..." in every caption
    batch["ids"] = ids
    fam = Family(xl=xl, pix2pix=False, aesthetic=False, encoders=names, force_zeros=xl)
    null = ({"context": np.zeros((77, 32), np.float32), "pooled": np.zeros((16,), np.float32)} if xl
            else {"ids": np.zeros((1, 77), np.int32)})  # never read: no caption is dropped
    cfg = dataclasses.replace(_loss_config(case), family=fam, text_dtype="float32")
    graphdef, params, base = nnx.split(module, TI.WordParam, ...)
    fn, constants = steplib.trained_in_part(denoise.loss_fn(graphdef, cfg), jax.tree.map(jnp.asarray, null), base)
    keys = steplib.sample_keys(jax.random.key(3), jnp.int32(7), jnp.asarray(batch["index"]))
    (loss, _), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, jax.tree.map(jnp.asarray, batch), keys,
                                                                     constants)

    def conditioning(dropped):
        assert not dropped.any()
        outs = [refs[n](torch.from_numpy(ids[:, j]).long(), output_hidden_states=True) for j, n in enumerate(names)]
        if not xl:
            return outs[0].last_hidden_state, None
        return torch.cat([o.hidden_states[-2] for o in outs], dim=-1), outs[1].text_embeds

    ref_loss = _reference_loss(ref, case, batch, keys, conditioning)
    ref_loss.backward()
    print("loss", float(loss), ref_loss.item())
    np.testing.assert_allclose(float(loss), ref_loss.item(), rtol=2e-5)
    ours = {p[0]: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    assert set(ours) == set(names)
    for name in names:
        theirs = refs[name].get_input_embeddings().weight.grad[WORD_IDS].numpy()
        error = np.abs(ours[name] - theirs).max() / np.abs(theirs).max()
        print(name, "largest relative gradient error", error)
        assert np.abs(theirs).max() > 0 and error < 1e-4


PROMPT = "a <shape> on a blue background"
FLAGS = ["--placeholder_token", "<shape>", "--initializer_token", "circle", "--num_vectors", "2", "--repeats", "2",
         "--resolution", "32", "--train_batch_size", "2", "--max_train_steps", "4", "--checkpointing_steps", "2",
         "--learning_rate", "5e-2", "--lr_warmup_steps", "0", "--report_to", "none", "--validation_prompt", PROMPT,
         "--num_validation_images", "1", "--validation_steps", "2", "--validation_inference_steps", "2"]


@pytest.mark.parametrize("name", ["tiny", "tiny_xl"])
def test_words_train_resume_exactly_and_load_in_sdx_and_diffusers(tmp_path, demo_models, name):
    model = demo_models(name)
    data = tmp_path / "images"
    data.mkdir()
    for i in range(3):
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (40, 36, 3), dtype=np.uint8)).save(data / f"{i}.png")
    a, b = tmp_path / "a", tmp_path / "b"
    argv = lambda out, *extra: ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data),
                                "--output_dir", str(out), *FLAGS, *extra]
    assert textual_inversion.train(argv(a)) == 0
    path = a / textual_inversion.EMBEDS_FILE
    arrays = load_file(path)
    assert set(arrays) == ({"clip_l", "clip_g"} if name == "tiny_xl" else {"<shape>"})
    assert all(v.shape[0] == 2 and np.abs(v[0] - v[1]).max() > 0 for v in arrays.values())  # each vector trained

    if name == "tiny":  # resuming is the loop's, the same for SDXL
        (b / "checkpoints").mkdir(parents=True)
        shutil.copytree(a / "checkpoints" / "2", b / "checkpoints" / "2")
        assert textual_inversion.train(argv(b, "--resume_from_checkpoint", "latest")) == 0
        assert (b / textual_inversion.EMBEDS_FILE).read_bytes() == path.read_bytes()

    # the sampler's --embedding (the word from the file's metadata): the last validation's image
    folder = resolve_model(str(model), dtype="float32", cache=tmp_path / "cache", log=lambda _m: None,
                           options=ModelOptions.from_args(embedding=[str(path)]))
    pipe = Pipeline.load(folder)
    out = pipe(Request(prompts=[PROMPT], height=32, width=32, steps=2, seed=0,
                       guidance_scale=5.0 if name == "tiny_xl" else 7.5))
    grid = np.asarray(Image.open(a / "validation" / "step-000004.png"))
    assert np.abs((out[0] * 255).round().astype(int) - grid).max() <= 1
    assert not np.array_equal(grid, np.asarray(Image.open(a / "validation" / "step-000002.png")))

    if name == "tiny":  # diffusers: load_textual_inversion of the file, the same words and vectors
        from convert import library

        ref = diffusers.StableDiffusionPipeline.from_pretrained(library.convert(
            model, tmp_path / "diffusers", fmt="diffusers"), safety_checker=None)
        ref.load_textual_inversion(str(path))
        ids = ref.tokenizer(ref.maybe_convert_prompt(PROMPT, ref.tokenizer)).input_ids
        assert pipe.tokenizers["tokenizer"]([PROMPT])[0][:len(ids)].tolist() == ids
        table = ref.text_encoder.get_input_embeddings().weight.detach().numpy()
        np.testing.assert_array_equal(table[-2:], arrays["<shape>"])


def test_bad_words_and_data_fail_before_training(tmp_path, demo_models, capsys):
    from sdx.errors import run_command

    model = demo_models("tiny")
    data = tmp_path / "images"
    data.mkdir()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(data / "0.png")
    out = tmp_path / "out"

    def fails(*flags) -> str:
        argv = ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--output_dir", str(out),
                "--placeholder_token", "<w>", "--initializer_token", "toy", "--max_train_steps", "1", *flags]
        assert run_command(lambda: textual_inversion.train(argv)) == 2
        assert not (out / "checkpoints").exists()
        return capsys.readouterr().err

    assert "'two words' is 2 tokens" in fails("--initializer_token", "two words")
    assert "already in the tokenizer's vocabulary" in fails("--placeholder_token", "circle")
    (tmp_path / "empty").mkdir()
    assert "holds no image files" in fails("--train_data_dir", str(tmp_path / "empty"))
    assert "--num_vectors must be at least 1" in fails("--num_vectors", "0")
    assert "--save_as_full_pipeline (a diffusers flag) is not supported" in fails("--save_as_full_pipeline")
