"""The sampling markers that SDXL single files carry beside their weights: how the model was trained to be
sampled, which the SGM layout has no config for. Read and written as ComfyUI reads and writes them (its
SDXL model detection and its checkpoint saver), the convention the files in circulation follow:

    edm_vpred.sigma_max [+ edm_vpred.sigma_min]   scalars. An EDM v-prediction model (CosXL, CosXL Edit):
        EDMEulerScheduler with v-prediction, sigma_data 1, the file's sigma range (sigma_min 0.002 when
        absent) and sigmas evenly spaced in log sigma (`sigma_schedule="exponential"`, the setting
        diffusers gives for CosXL). On an InstructPix2Pix file it also marks CosXL Edit, whose image
        latents are scaled by the VAE's factor (`is_cosxl_edit`).
    edm_mean + edm_std   4 values each. An EDM epsilon model whose latents are normalised per channel
        (Playground v2.5): the EDMDPMSolverMultistepScheduler that Playground ships, and the VAE's
        latents_mean / latents_std from the file.
    v_pred [+ ztsnr]   empty tensors. v-prediction with the preset's scheduler [and a zero terminal SNR
        schedule: rescaled betas, trailing timesteps].

diffusers' single-file loader ignores these keys (a CosXL file sampled as an epsilon model draws noise);
sdx reads them into the scheduler and VAE configs, over a config folder's (the markers are the file's own
word; `--scheduler` still picks another sampler). Writing puts back the marker that describes the checkpoint's scheduler; a scheduler that
none describes (an EDM model with other constants) is not recorded, and its reader needs the config
folder, as for any other single file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sdx.errors import SdxError

EDM_VPRED_MAX, EDM_VPRED_MIN = "edm_vpred.sigma_max", "edm_vpred.sigma_min"
EDM_MEAN, EDM_STD = "edm_mean", "edm_std"
V_PRED, ZTSNR = "v_pred", "ztsnr"
KEYS = (EDM_VPRED_MAX, EDM_VPRED_MIN, EDM_MEAN, EDM_STD, V_PRED, ZTSNR)

_EDM_CLASSES = ("EDMEulerScheduler", "EDMDPMSolverMultistepScheduler")
_EDM_VPRED = {"_class_name": "EDMEulerScheduler", "num_train_timesteps": 1000, "prediction_type": "v_prediction",
              "rho": 7.0, "sigma_data": 1.0, "sigma_schedule": "exponential"}
# playgroundai/playground-v2.5-1024px-aesthetic's scheduler_config.json
_PLAYGROUND = {"_class_name": "EDMDPMSolverMultistepScheduler", "algorithm_type": "dpmsolver++",
               "euler_at_final": False, "final_sigmas_type": "zero", "lower_order_final": True,
               "num_train_timesteps": 1000, "prediction_type": "epsilon", "rho": 7.0, "sigma_data": 0.5,
               "sigma_max": 80.0, "sigma_min": 0.002, "solver_order": 2, "solver_type": "midpoint",
               "thresholding": False}


def _scalar(tensors: Mapping[str, Any], key: str, where: str) -> float:
    value = np.asarray(tensors[key], np.float64)
    if value.size != 1 or not np.isfinite(value).all() or value.item() <= 0:
        raise SdxError(f"{where}: the sampling marker {key} must be one positive number, not shape "
                       f"{list(value.shape)} {value.ravel()[:4].tolist()}")
    return value.item()


def _channels(tensors: Mapping[str, Any], key: str, count: int, where: str) -> list[float]:
    value = np.asarray(tensors[key], np.float64)
    if value.size != count:
        raise SdxError(f"{where}: the sampling marker {key} must hold one value per latent channel ({count}), "
                       f"not shape {list(value.shape)}")
    return value.ravel().tolist()


def read(tensors: Mapping[str, Any], configs: dict[str, dict], extra: dict[str, Any], *, pix2pix: bool,
         where: str) -> dict[str, Any]:
    """The file's tensors without the markers; `configs` ("scheduler", "vae") and `extra` (the
    pipeline's model_index fields) updated in place with what the markers say."""
    found = [k for k in KEYS if k in tensors]
    if not found:
        return dict(tensors)
    scheduler = configs["scheduler"]
    if EDM_VPRED_MAX in tensors:
        low = _scalar(tensors, EDM_VPRED_MIN, where) if EDM_VPRED_MIN in tensors else 0.002
        configs["scheduler"] = {**_EDM_VPRED, "sigma_max": _scalar(tensors, EDM_VPRED_MAX, where), "sigma_min": low}
        if pix2pix:
            extra["is_cosxl_edit"] = True
    elif EDM_MEAN in tensors or EDM_STD in tensors:
        if not (EDM_MEAN in tensors and EDM_STD in tensors):
            raise SdxError(f"{where}: has one of the sampling markers {EDM_MEAN} and {EDM_STD} without the other")
        count = configs["vae"]["latent_channels"]
        configs["scheduler"] = dict(_PLAYGROUND)
        configs["vae"] = {**configs["vae"], "latents_mean": _channels(tensors, EDM_MEAN, count, where),
                          "latents_std": _channels(tensors, EDM_STD, count, where)}
    elif V_PRED in tensors:
        configs["scheduler"] = {**scheduler, "prediction_type": "v_prediction"}
        if ZTSNR in tensors:
            configs["scheduler"].update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
    elif ZTSNR in tensors:
        raise SdxError(f"{where}: has the sampling marker {ZTSNR} without {V_PRED}")
    return {k: v for k, v in tensors.items() if k not in found}


def write(configs: Mapping[str, Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """The markers that describe `configs`' scheduler (and VAE statistics), for an SDXL single file."""
    scheduler, vae = configs.get("scheduler") or {}, configs.get("vae") or {}
    prediction = scheduler.get("prediction_type", "epsilon")
    if scheduler.get("_class_name") in _EDM_CLASSES:
        if prediction == "v_prediction" and scheduler.get("sigma_data") == 1.0:
            return {EDM_VPRED_MAX: np.float32(scheduler.get("sigma_max", 80.0)).reshape(()),
                    EDM_VPRED_MIN: np.float32(scheduler.get("sigma_min", 0.002)).reshape(())}
        if prediction == "epsilon" and vae.get("latents_mean") is not None and vae.get("latents_std") is not None:
            # (1, channels, 1, 1): the statistics' shape against a latent batch
            return {EDM_MEAN: np.asarray(vae["latents_mean"], np.float32).reshape(1, -1, 1, 1),
                    EDM_STD: np.asarray(vae["latents_std"], np.float32).reshape(1, -1, 1, 1)}
        return {}
    if prediction != "v_prediction":
        return {}
    out = {V_PRED: np.zeros((0,), np.float32)}
    if scheduler.get("rescale_betas_zero_snr"):
        out[ZTSNR] = np.zeros((0,), np.float32)
    return out
