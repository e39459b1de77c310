"""Guidance objects: their UNet batch layout, their combinations, guidance rescale's edge cases, and the
null conditioning training shares with the sampler."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

from pipelines import guidance, text
from pipelines.guidance import ClassifierFree, Conditioning, InstructPix2Pix, Scales, Unguided
from pipelines.pipeline import Pipeline
from sdx import mesh as meshlib

B = 3
SCALES = Scales(jnp.float32(7.0), jnp.float32(1.7), jnp.float32(0.0))


def _cond(value: float, image: bool = False) -> Conditioning:
    """A branch whose every entry holds `value` (image latents 10 * value), with the image's row index added."""
    rows = jnp.arange(B, dtype=jnp.float32)
    fill = lambda *shape: value + rows.reshape(B, *[1] * len(shape)) + jnp.zeros((B, *shape))  # noqa: E731
    return Conditioning(fill(5, 4), fill(6), fill(2), 10 * fill(2, 2, 4) if image else None)


@pytest.mark.parametrize(
    "kind, branches",
    [
        (Unguided(), [(1.0, True)]),
        (ClassifierFree(), [(2.0, False), (1.0, False)]),  # [negative, text]
        (InstructPix2Pix(), [(1.0, True), (2.0, True), (2.0, None)]),  # [text+image, negative+image, negative+zeros]
    ],
)
def test_unet_batch_is_image_major(kind, branches):
    image = kind.branches == 3 or isinstance(kind, Unguided)
    cond = kind.conditioning(_cond(1.0, image), _cond(2.0))
    assert cond.context.shape == (B * kind.branches, 5, 4)
    for j in range(B):
        for k, (value, with_image) in enumerate(branches):
            row = j * kind.branches + k  # branch k of image j
            assert float(cond.context[row, 0, 0]) == value + j
            assert float(cond.pooled[row, 0]) == value + j
            if kind.branches == 3:  # every InstructPix2Pix branch takes the text's time ids
                assert float(cond.time_ids[row, 0]) == 1.0 + j
            if image:
                expected = 10 * (1.0 + j) if with_image else 0.0
                assert float(cond.image[row, 0, 0, 0]) == expected
    latents = jnp.arange(B, dtype=jnp.float32).reshape(B, 1, 1, 1) + jnp.zeros((B, 2, 2, 4))
    model_in = kind.model_input(latents, cond, 1)
    assert model_in.shape == (B * kind.branches, 2, 2, 8 if image else 4)
    np.testing.assert_array_equal(model_in[:, 0, 0, 0], np.repeat(np.arange(B), kind.branches))


def test_classifier_free_guidance_shares_its_input_except_where_the_time_embedding_reads_text():
    """SD 1.x/2.x's two branches read the same latents, image channels (an inpainting model's) and timestep:
    the UNet takes one row for both. SDXL's time embedding reads the pooled text, which differs."""
    from pipelines.family import family_of

    sd, xl = _family(pix2pix=False), family_of("StableDiffusionXLPipeline", {"text_encoder", "text_encoder_2"}, {})
    assert ClassifierFree().shared(sd) == 2 and ClassifierFree().shared(xl) == 1
    assert Unguided().shared(sd) == 1 and InstructPix2Pix().shared(_family(pix2pix=True)) == 1
    text = _cond(1.0, image=True)
    cond = ClassifierFree().conditioning(text, dataclasses.replace(_cond(2.0), image=text.image))
    latents = jnp.arange(B, dtype=jnp.float32).reshape(B, 1, 1, 1) + jnp.zeros((B, 2, 2, 4))
    model_in = ClassifierFree().model_input(latents, cond, 2)
    np.testing.assert_array_equal(model_in, jnp.concatenate([latents, text.image], axis=-1))


def test_combinations():
    r = np.random.default_rng(0)
    parts = [jnp.asarray(r.standard_normal((B, 2, 2, 4)), jnp.float32) for _ in range(3)]
    stack = lambda *xs: jnp.stack(xs, axis=1).reshape(-1, 2, 2, 4)  # noqa: E731  the image-major UNet batch
    g, gi = SCALES.text, SCALES.image
    assert Unguided().combine(parts[0], SCALES) is parts[0]
    uncond, cond = parts[:2]
    np.testing.assert_allclose(ClassifierFree().combine(stack(uncond, cond), SCALES), uncond + g * (cond - uncond), rtol=1e-6)
    cond, image, uncond = parts
    np.testing.assert_allclose(InstructPix2Pix().combine(stack(cond, image, uncond), SCALES),
                               uncond + g * (cond - image) + gi * (image - uncond), rtol=1e-6)


@pytest.mark.parametrize("kind", [Unguided(), ClassifierFree(), InstructPix2Pix()])
def test_blank_rows_are_the_negative_branches_where_no_negative_prompt_means_zeros(kind):
    """The rows whose cross-attentions the UNet may skip (`sdx.layers.BlankRows`) are where the guidance
    layout puts the negative branch, and exist only for a force_zeros family."""
    from pipelines.family import family_of

    xl = lambda zeros: family_of("StableDiffusionXLPipeline", {"text_encoder", "text_encoder_2"},  # noqa: E731
                                 {"force_zeros_for_empty_prompt": zeros})
    assert kind.blank_rows(xl(False)) is None and kind.blank_rows(_family(pix2pix=False)) is None
    blank = kind.blank_rows(xl(True))
    if isinstance(kind, Unguided):
        assert blank is None
        return
    cond = kind.conditioning(_cond(1.0, image=kind.branches == 3), _cond(2.0))  # InstructPix2Pix's text has an image
    negative = np.asarray(_cond(2.0).context)
    for r in range(kind.branches):
        rows = np.asarray(blank.pick(cond.context, (r,)))
        assert np.array_equal(rows, negative) == (r in blank.rows), f"branch {r}"


def test_choose_follows_diffusers():
    sd, p2p = _family(pix2pix=False), _family(pix2pix=True)
    assert guidance.choose(sd, 1.0, 1.5) == Unguided()
    assert guidance.choose(sd, 1.01, 0.0) == ClassifierFree()
    assert guidance.choose(p2p, 7.5, 1.5) == InstructPix2Pix()
    assert guidance.choose(p2p, 7.5, 0.99) == Unguided()
    assert guidance.choose(p2p, 1.0, 1.5) == Unguided()


def _family(pix2pix: bool):
    from pipelines.family import family_of

    cls = "StableDiffusionInstructPix2PixPipeline" if pix2pix else "StableDiffusionPipeline"
    return family_of(cls, {"text_encoder"}, {})


def _diffusers_rescale(guided: np.ndarray, cond: np.ndarray, phi: float) -> np.ndarray:
    nchw = lambda a: torch.tensor(np.asarray(a)).permute(0, 3, 1, 2)  # noqa: E731
    return rescale_noise_cfg(nchw(guided), nchw(cond), guidance_rescale=phi).permute(0, 2, 3, 1).numpy()


def test_rescale_equals_diffusers():
    r = np.random.default_rng(1)
    guided, cond = (r.standard_normal((2, 8, 8, 4)).astype(np.float32) * s for s in (3.0, 1.0))
    for phi in (0.3, 0.7, 1.0):
        out = guidance.rescale(jnp.asarray(guided), jnp.asarray(cond), jnp.float32(phi))
        np.testing.assert_allclose(out, _diffusers_rescale(guided, cond, phi), rtol=1e-5, atol=1e-6)


def test_rescale_off_is_the_guided_prediction_bit_for_bit():
    r = np.random.default_rng(2)
    guided = jnp.asarray(r.standard_normal((3, 4, 4, 4)), jnp.float32)
    cond = jnp.asarray(r.standard_normal((3, 4, 4, 4)), jnp.float32)
    flat = guided.at[1].set(0.5)  # zero spread: the rescale factor's denominator is 0
    inf = guided.at[2, 0, 0, 0].set(jnp.inf)  # a non-finite rescaled value that 0 * x would turn into NaN
    for g in (guided, flat, inf):
        out = jax.jit(guidance.rescale)(g, cond, jnp.float32(0.0))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(g))


def test_rescale_of_a_flat_prediction_stays_finite():
    r = np.random.default_rng(3)
    guided = jnp.asarray(r.standard_normal((2, 4, 4, 4)), jnp.float32).at[0].set(0.25)
    cond = jnp.asarray(r.standard_normal((2, 4, 4, 4)), jnp.float32)
    out = guidance.rescale(guided, cond, jnp.float32(0.7))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(guided[0]))  # nothing to rescale: kept as it is
    np.testing.assert_allclose(out[1:], _diffusers_rescale(guided[1:], cond[1:], 0.7), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, force_zeros", [("tiny", False), ("tiny_xl", True), ("tiny_xl", False)])
def test_null_conditioning_is_the_negative_branch_without_a_prompt(tmp_path_factory, demo_build, name, force_zeros):
    pipe = Pipeline.load(demo_build(name, tmp_path_factory.getbasetemp() / "demo"),
                         mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    family = dataclasses.replace(pipe.family, force_zeros=force_zeros)
    encoders = {n: pipe.sampler.models[n] for n in family.encoders}
    null = guidance.null_conditioning(family, encoders, pipe.tokenizers, jnp.float32)
    assert set(null) == ({"context", "pooled"} if family.xl else {"context"})
    ids = text.tokenize(family, pipe.tokenizers, [[""]] * len(family.encoders), chunks=None)
    context, pooled = text.encode(family, encoders, {k: jnp.asarray(v) for k, v in ids.items()}, None, jnp.float32)
    assert null["context"].shape == context.shape[1:]
    expected = (np.zeros_like, np.asarray)[not force_zeros]
    np.testing.assert_array_equal(np.asarray(null["context"]), expected(np.asarray(context[0])))
    if family.xl:
        np.testing.assert_array_equal(np.asarray(null["pooled"]), expected(np.asarray(pooled[0])))


def test_an_all_zero_negative_branch_runs_no_text_encoder(monkeypatch):
    """SDXL without a negative prompt (force_zeros_for_empty_prompt): every negative row is zeros, so the
    text encoders are not run for them; a batch where some row has a negative prompt runs them."""
    runs = []

    def encode(family, encoders, ids, clip_skip, dtype, *weighting):  # stands in for the encoders; counts its runs
        jax.debug.callback(lambda: runs.append(1))
        batch = ids["text_encoder"].shape[0]
        return jnp.ones((batch, 77, 8), dtype), jnp.ones((batch, 4), dtype)

    monkeypatch.setattr(text, "encode", encode)
    ids = {"text_encoder": jnp.zeros((2, 1, 77), jnp.int32)}
    run = jax.jit(lambda zero: guidance.negative_conditioning(None, {}, ids, zero, jnp.float32))
    context, pooled = run(jnp.array([True, True]))
    jax.effects_barrier()
    assert runs == [] and context.shape == (2, 77, 8) and not context.any() and not pooled.any()
    context, pooled = run(jnp.array([True, False]))
    jax.effects_barrier()
    assert runs == [1] and not context[0].any() and context[1].all() and pooled[1].all()
