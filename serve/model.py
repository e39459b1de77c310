"""The model a server serves: the loaded pipeline, what the API lists about it, and the settings clients may
change (`/sdapi/v1/options`).

Every name the API shows is a name, never a path: a local model, VAE, LoRA or ControlNet is listed by its file or
folder name, a hub id as typed. A client may name only what is listed.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from sdx.errors import SdxError


def shown_name(spec: str) -> str:
    """How the API names a model source: a local file or folder by its name, anything else (a hub id, a shipped
    model's name) as given."""
    path = Path(spec)
    return path.name if path.exists() else spec


@dataclasses.dataclass
class Served:
    """pipeline: with every --controlnet; plain: the same models without them (what a request without ControlNet
    units runs); scheduler_config: the model's scheduler_config.json, on which each request's sampler is built;
    title: the model as listed; vae: the --vae as listed (None: the model's own); controlnets: the
    --controlnet names, in the pipeline's order; loras: (name, scale) merged at start; embeddings: {token: (vectors,
    width)}; clip_stop: A1111's CLIP_stop_at_last_layers, the one setting clients change."""

    pipeline: object
    plain: object
    scheduler_config: dict
    title: str
    vae: str | None = None
    controlnets: tuple[str, ...] = ()
    loras: tuple[tuple[str, float], ...] = ()
    embeddings: dict = dataclasses.field(default_factory=dict)
    clip_stop: int = 1
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def options(self) -> dict:
        """GET /sdapi/v1/options: the settings that mean something here."""
        return {"sd_model_checkpoint": self.title, "sd_checkpoint_hash": None, "sd_vae": self.vae or "Automatic",
                "CLIP_stop_at_last_layers": self.clip_stop, "samples_format": "png", "eta_noise_seed_delta": 0}

    def check_settings(self, settings: dict, where: str) -> dict:
        """The settings in `settings` (a POST to options, or a request's override_settings; `where` names it in
        errors) that change something, checked: {"CLIP_stop_at_last_layers": n}. Names must be the listed ones;
        settings that mean nothing here are ignored, as A1111 ignores those of an extension it lacks."""
        model = settings.get("sd_model_checkpoint")
        if model is not None and str(model).split(" [")[0] != self.title:
            raise SdxError(f"{where}.sd_model_checkpoint {model!r}: this server serves {self.title!r} "
                           "(GET /sdapi/v1/sd-models)")
        vae = settings.get("sd_vae")
        allowed = ("Automatic", self.vae) if self.vae else ("Automatic", "None")
        if vae is not None and vae not in allowed:
            raise SdxError(f"{where}.sd_vae {vae!r}: this server has {' or '.join(map(repr, allowed))}")
        if settings.get("samples_format", "png") != "png":
            raise SdxError(f"{where}.samples_format {settings['samples_format']!r}: this server answers with PNGs")
        if settings.get("eta_noise_seed_delta", 0) != 0:
            raise SdxError(f"{where}.eta_noise_seed_delta {settings['eta_noise_seed_delta']!r}: sdx's noise has no "
                           "seed delta (0)")
        out = {}
        if "CLIP_stop_at_last_layers" in settings:
            stop = settings["CLIP_stop_at_last_layers"]
            if not isinstance(stop, int) or isinstance(stop, bool) or stop < 1:
                raise SdxError(f"{where}.CLIP_stop_at_last_layers {stop!r} must be an integer >= 1 (1: the last layer)")
            out["CLIP_stop_at_last_layers"] = stop
        return out

    def set_options(self, settings: dict) -> None:
        changes = self.check_settings(settings, "options")
        with self.lock:
            self.clip_stop = changes.get("CLIP_stop_at_last_layers", self.clip_stop)

    def loras_listed(self) -> list[dict]:
        return [{"name": name, "alias": name, "path": name, "metadata": {"scale": scale}} for name, scale in self.loras]

    def embeddings_listed(self) -> dict:
        loaded = {token: {"step": None, "sd_checkpoint": None, "sd_checkpoint_name": None, "shape": width,
                          "vectors": vectors} for token, (vectors, width) in self.embeddings.items()}
        return {"loaded": loaded, "skipped": {}}
