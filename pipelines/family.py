"""What kind of pipeline a model folder holds, decided once from its spec (never from flags).

SD 1.x/2.x, SDXL base, the SDXL refiner, InstructPix2Pix and inpainting (SD and SDXL) differ in which
text encoders condition the UNet, whether the UNet takes added (pooled + micro-conditioning) inputs, and
what is concatenated to its input: an image's latents (InstructPix2Pix) or a mask and the masked image's
latents (inpainting models, 9 input channels). Everything else is shared.
"""

from __future__ import annotations

import dataclasses

from sdx.errors import SdxError
from sdx.model_folder import GUIDANCE_KEY

_KNOWN = {  # pipeline class -> (xl, pix2pix, inpaint)
    "StableDiffusionPipeline": (False, False, False),
    "StableDiffusionImg2ImgPipeline": (False, False, False),
    "StableDiffusionInstructPix2PixPipeline": (False, True, False),
    "StableDiffusionInpaintPipeline": (False, False, True),
    "LatentConsistencyModelPipeline": (False, False, False),  # SD 1.x with an LCM UNet (`guidance_embedded`)
    "LatentConsistencyModelImg2ImgPipeline": (False, False, False),
    "StableDiffusionXLPipeline": (True, False, False),
    "StableDiffusionXLImg2ImgPipeline": (True, False, False),
    "StableDiffusionXLInstructPix2PixPipeline": (True, True, False),
    "StableDiffusionXLInpaintPipeline": (True, False, True),
}

# Each encoder reads its own tokenizer; SDXL's encoder i reads prompt i (prompt, prompt_2).
TOKENIZER_OF = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}


@dataclasses.dataclass(frozen=True)
class Family:
    """xl: SDXL conditioning (penultimate hidden states of every encoder concatenated, pooled text embeds
    and time ids as added inputs); pix2pix: the UNet also takes the input image's latents; inpaint: the
    UNet also takes the mask and the masked image's latents (an ordinary model inpaints by blending the
    known region's latents in after every step instead, see `pipelines.sampler`); aesthetic:
    time ids end with an aesthetic score (the refiner) instead of the target size; encoders: the text
    encoders present, in prompt order; force_zeros: a missing negative prompt means zero embeddings;
    scaled_image_latents: the pix2pix image latents are multiplied by the VAE's scaling factor (CosXL
    edit models, `is_cosxl_edit` in model_index.json); guidance_embedded: the UNet takes the guidance scale as
    an embedding (an LCM UNet's time_cond_proj_dim), so no classifier-free guidance branch runs, as in diffusers'
    pipelines (set by `Pipeline.from_models` from the UNet's config); model_guidance_scale: the classifier-free
    guidance the model was made to be sampled at (`default_guidance_scale` in model_index.json, an sdx key that
    diffusers ignores; the default models carry one), None for diffusers' pipelines' defaults."""

    xl: bool
    pix2pix: bool
    aesthetic: bool
    encoders: tuple[str, ...]
    force_zeros: bool
    scaled_image_latents: bool = False
    inpaint: bool = False
    guidance_embedded: bool = False
    model_guidance_scale: float | None = None

    @property
    def guidance_scale(self) -> float:
        """What a request that leaves guidance_scale open gets: the model's own, else diffusers' pipelines'
        default (5.0 for SDXL, 7.5 otherwise)."""
        if self.model_guidance_scale is not None:
            return self.model_guidance_scale
        return 5.0 if self.xl else 7.5

    @property
    def name(self) -> str:
        base = ("sdxl_refiner" if self.aesthetic else "sdxl") if self.xl else "sd"
        return f"{base}_pix2pix" if self.pix2pix else f"{base}_inpaint" if self.inpaint else base


def family_of(pipeline_class: str, models: set[str] | dict, extra: dict) -> Family:
    if pipeline_class not in _KNOWN:
        raise SdxError(f"pipeline class {pipeline_class!r} is not supported (supported: {', '.join(sorted(_KNOWN))})")
    xl, pix2pix, inpaint = _KNOWN[pipeline_class]
    encoders = tuple(e for e in ("text_encoder", "text_encoder_2") if e in models)
    if not encoders:
        raise SdxError(f"{pipeline_class}: the model has no text encoder")
    guidance = extra.get(GUIDANCE_KEY)
    if guidance is not None and (isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or guidance < 0):
        raise SdxError(f"{pipeline_class}: {GUIDANCE_KEY} in the model's index must be a number ≥ 0, not {guidance!r}")
    return Family(
        xl=xl,
        pix2pix=pix2pix,
        aesthetic=bool(extra.get("requires_aesthetics_score", False)),
        encoders=encoders,
        force_zeros=bool(extra.get("force_zeros_for_empty_prompt", False)) if xl else False,
        scaled_image_latents=bool(extra.get("is_cosxl_edit", False)),
        inpaint=inpaint,
        model_guidance_scale=None if guidance is None else float(guidance),
    )
