"""The request and response bodies of `/sdapi/v1`, with AUTOMATIC1111's field names and defaults, as pydantic
models so that `/docs` shows their schema.

A1111 builds its bodies from its processing classes' constructor arguments, each optional with the class's
default; these are the same fields. An unknown field is ignored, as A1111 ignores it. What each field does here,
and which values sdx cannot honour (a 422 naming the field), is `serve.translate`'s.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Generation(_Body):
    """The fields txt2img and img2img share."""

    prompt: str = ""
    negative_prompt: str | None = None
    styles: list[str] | None = None
    seed: int = Field(-1, description="-1: random; image j of the request is seeded seed + j")
    subseed: int = -1
    subseed_strength: float = 0.0
    seed_resize_from_h: int = -1
    seed_resize_from_w: int = -1
    sampler_name: str | None = Field(None, description="an A1111 sampler name (GET /sdapi/v1/samplers); default "
                                                       "sampler_index")
    sampler_index: str = "Euler"
    scheduler: str | None = Field(None, description="an A1111 schedule type (GET /sdapi/v1/schedulers)")
    batch_size: int = 1
    n_iter: int = 1
    steps: int = 50
    cfg_scale: float = 7.0
    width: int = 512
    height: int = 512
    restore_faces: bool | None = None
    tiling: bool | None = None
    do_not_save_samples: bool = False
    do_not_save_grid: bool = False
    eta: float | None = None
    s_min_uncond: float | None = None
    s_churn: float | None = None
    s_tmax: float | None = None
    s_tmin: float | None = None
    s_noise: float | None = None
    override_settings: dict[str, Any] | None = None
    override_settings_restore_afterwards: bool = True
    refiner_checkpoint: str | None = None
    refiner_switch_at: float | None = None
    disable_extra_networks: bool = False
    firstpass_image: str | None = None
    comments: dict[str, Any] | None = None
    script_name: str | None = None
    script_args: list[Any] = Field(default_factory=list)
    send_images: bool = True
    save_images: bool = False
    alwayson_scripts: dict[str, Any] = Field(default_factory=dict)
    force_task_id: str | None = Field(None, description="the task id to follow this job by (POST /internal/progress)")
    infotext: str | None = None


class Txt2Img(Generation):
    enable_hr: bool = False
    denoising_strength: float | None = 0.75
    firstphase_width: int = 0
    firstphase_height: int = 0
    hr_scale: float = 2.0
    hr_upscaler: str | None = None
    hr_second_pass_steps: int = 0
    hr_resize_x: int = 0
    hr_resize_y: int = 0
    hr_checkpoint_name: str | None = None
    hr_sampler_name: str | None = None
    hr_scheduler: str | None = None
    hr_prompt: str = ""
    hr_negative_prompt: str = ""


class Img2Img(Generation):
    init_images: list[str] | None = Field(None, description="base64 images or data URIs (URLs are refused)")
    resize_mode: int = Field(0, description="0 just resize, 1 crop and resize, 2 resize and fill")
    denoising_strength: float = 0.75
    image_cfg_scale: float | None = Field(None, description="InstructPix2Pix models: the image guidance scale")
    mask: str | None = Field(None, description="base64 image or data URI: white is repainted")
    mask_blur_x: int = 4
    mask_blur_y: int = 4
    mask_blur: int | None = None
    mask_round: bool = True
    inpainting_fill: int = Field(0, description="1 (original): sdx starts from the image under the mask")
    inpaint_full_res: bool = Field(True, description="repaint a crop around the mask at the generation size")
    inpaint_full_res_padding: int = 0
    inpainting_mask_invert: int = 0
    initial_noise_multiplier: float | None = None
    latent_mask: str | None = None
    include_init_images: bool = False


class Images(BaseModel):
    images: list[str] = Field(default_factory=list, description="the images, base64 PNGs with A1111's parameters")
    parameters: dict[str, Any]
    info: str = Field(description="a JSON string: all_seeds, all_prompts, infotexts, ...")


class PngInfoBody(_Body):
    image: str


class ProgressBody(_Body):
    id_task: str | None = None
    id_live_preview: int = -1
    live_preview: bool = True
