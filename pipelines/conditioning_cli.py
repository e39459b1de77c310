"""`python -m sdx.sample`'s conditioning methods (`pipelines.method.Method`s): ControlNets, ControlNet-Unions,
T2I-Adapters and IP-Adapters. Each puts its flags on the parser, refuses bad values before anything is loaded, names
the models `Pipeline.load` loads, makes its plug-in's request part (`pipelines.plugin.Input`) from its pictures, and
records its settings in the PNG. The plug-ins themselves (`pipelines.control`, `pipelines.control_union`,
`pipelines.t2i_adapter`, `pipelines.image_prompt`) are imported when a method needs them: this module, like
`pipelines.research_cli`, imports no JAX, so the command's bad flags are refused in the time it takes to start."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from pipelines.method import Method, per_model, pictures_per_model, read_picture
from sdx.errors import SdxError

CONTROL_FLAG, CONTROL_IMAGE = "--controlnet", "--control-image"


def _finite(values, flag: str) -> None:
    for value in values or ():
        if not isinstance(value, dict) and not math.isfinite(value):
            raise SdxError(f"{flag} {value} must be a finite number")


def _windows(args: argparse.Namespace, n: int, models: str) -> tuple[list, list]:
    """--control-guidance-start and --control-guidance-end, one per model of flag `models` (or per image)."""
    return (per_model(args.control_guidance_start, n, "--control-guidance-start", models),
            per_model(args.control_guidance_end, n, "--control-guidance-end", models))


def _check_windows(args: argparse.Namespace, n: int, models: str) -> None:
    from pipelines.control import check_window

    for start, end in zip(*_windows(args, n, models)):
        check_window(start, end)


class ControlNetFlags(Method):
    """The ControlNet flags; a ControlNet-Union's images, with their --control-mode, are `UnionFlags`'."""

    title = "ControlNet"

    def add_flags(self, g) -> None:
        g.add_argument(CONTROL_FLAG, metavar="MODEL", action="append", default=[],
                       help="a ControlNet (diffusers or sdx folder, hub id, or original single file) to guide the model "
                            "with; repeatable, each with its --control-image")
        g.add_argument(CONTROL_IMAGE, metavar="FILE", action="append", default=[],
                       help="the map a --controlnet reads (edges, depth, pose, ... as the user made it), in the same "
                            "order; resized to the generation size")
        g.add_argument("--controlnet-conditioning-scale", metavar="S", type=float, nargs="+",
                       help="one, or one per --controlnet (default 1.0; img2img 0.8; inpainting 0.5, SDXL 1.0: diffusers')")
        g.add_argument("--control-guidance-start", metavar="F", type=float, nargs="+", default=[0.0],
                       help="share of the steps before a ControlNet starts acting: one, or one per --controlnet")
        g.add_argument("--control-guidance-end", metavar="F", type=float, nargs="+", default=[1.0],
                       help="share of the steps after which a ControlNet stops acting: one, or one per --controlnet")
        g.add_argument("--guess-mode", action="store_true",
                       help="ControlNets act without the prompt's help: their residuals scaled from 0.1 to 1 across the "
                            "blocks and, with guidance, on the text branch only")

    def check(self, args) -> list:
        if args.control_mode:  # ControlNet-Unions' images (`UnionFlags`)
            return []
        pictures = pictures_per_model(args, "controlnet", "control_image", "a ControlNet guides one model")
        n = len(pictures)
        if not n and (args.guess_mode or args.controlnet_conditioning_scale):
            raise SdxError("--guess-mode and --controlnet-conditioning-scale act on ControlNets: pass --controlnet")
        _finite(per_model(args.controlnet_conditioning_scale, n, "--controlnet-conditioning-scale", CONTROL_FLAG),
                "--controlnet-conditioning-scale")
        if n:
            _check_windows(args, n, CONTROL_FLAG)
        return pictures

    def load(self, args, cache, log) -> dict:
        return {"controlnets": tuple(args.controlnet)}

    def pictures(self, read) -> list:
        return read

    def request(self, args, read, at) -> dict:
        """Each --control-image at the generation size, its scale (diffusers' default for the pipeline: 1.0,
        img2img 0.8, inpainting 0.5 (SDXL 1.0)) and guidance window."""
        if not read:  # no ControlNets, or ControlNet-Unions' images
            return {}
        from pipelines.control import Control, default_scale, fit_control_image

        n = len(read)
        scales = per_model(args.controlnet_conditioning_scale, n, "--controlnet-conditioning-scale", CONTROL_FLAG) or \
            [default_scale(at)] * n
        nets = at.pipe.conditioning_models(Control.kind)
        return {"conditioning": [
            Control(fit_control_image(at.cut(p), at.size, net.config.conditioning_channels), scale, start, end,
                    args.guess_mode)
            for p, net, scale, start, end in zip(read, nets, scales, *_windows(args, n, CONTROL_FLAG))]}

    def png(self, args, request) -> dict:
        from pipelines.control import Control

        controls = [one for one in request.conditioning if isinstance(one, Control)]
        if not controls:
            return {}
        out = {"controlnet": args.controlnet, "control_image": args.control_image,
               "controlnet_conditioning_scale": [c.scale for c in controls]}
        return out | ({"guess_mode": True} if args.guess_mode else {})


class UnionFlags(Method):
    """`--control-mode`: the ControlNet-Union's control type of each --control-image; the images, scales, windows
    and guess mode are the ControlNet flags, per image."""

    title = "ControlNet-Union"

    def add_flags(self, g) -> None:
        g.add_argument("--control-mode", metavar="MODE", action="append", default=[],
                       help="the control type of each --control-image, in the same order, when --controlnet is a "
                            "ControlNet-Union: diffusers' index or its name (openpose, depth, hed/scribble/softedge, "
                            "canny/lineart/mlsd, normal, segment, tile, repaint); one ControlNet-Union takes every "
                            "image, several take one each")

    def check(self, args) -> list:
        modes, paths, nets = args.control_mode, args.control_image, len(args.controlnet)
        if not modes:
            return []
        if not nets:
            raise SdxError("--control-mode gives a ControlNet-Union's control types: pass --controlnet")
        if len(modes) != len(paths):
            raise SdxError(f"give one --control-mode per --control-image ({len(paths)}), not {len(modes)}")
        if nets > 1 and len(paths) != nets:
            raise SdxError(f"several ControlNet-Unions take one --control-image each: {nets} --controlnet, "
                           f"{len(paths)} images")
        if args.refiner:
            raise SdxError("--controlnet and --refiner do not go together: a ControlNet guides one model")
        from pipelines.control_union import mode_index

        for mode in modes:
            mode_index(mode)
        _finite(per_model(args.controlnet_conditioning_scale, len(paths), "--controlnet-conditioning-scale",
                          CONTROL_IMAGE), "--controlnet-conditioning-scale")
        _check_windows(args, len(paths), CONTROL_IMAGE)
        return [read_picture(path, CONTROL_IMAGE) for path in paths]

    def pictures(self, read) -> list:
        return read

    def request(self, args, read, at) -> dict:
        """One `UnionControl` with every image, or one per ControlNet-Union with its image, each image at the
        generation size with its mode, scale (diffusers' default for the pipeline) and window."""
        if not read:
            return {}
        from pipelines.control import Control, default_scale, fit_control_image
        from pipelines.control_union import UnionControl

        nets = at.pipe.conditioning_models(Control.kind)
        n = len(read)
        images = [fit_control_image(at.cut(p), at.size, nets[i if len(nets) > 1 else 0].config.conditioning_channels)
                  for i, p in enumerate(read)]
        scales = per_model(args.controlnet_conditioning_scale, n, "--controlnet-conditioning-scale",
                           CONTROL_IMAGE) or [default_scale(at)] * n
        each = list(zip(images, args.control_mode, scales, *_windows(args, n, CONTROL_IMAGE)))
        groups = [each] if len(nets) == 1 else [[one] for one in each]
        return {"conditioning": [UnionControl(*(tuple(v) for v in zip(*group)), guess_mode=args.guess_mode)
                                 for group in groups]}

    def png(self, args, request) -> dict:
        from pipelines.control_union import UnionControl

        unions = [one for one in request.conditioning if isinstance(one, UnionControl)]
        if not unions:
            return {}
        out = {"controlnet": args.controlnet, "control_image": args.control_image, "control_mode": args.control_mode,
               "controlnet_conditioning_scale": [part.scale for one in unions for part in one.parts()]}
        return out | ({"guess_mode": True} if args.guess_mode else {})


class AdapterFlags(Method):
    """The T2I-Adapter flags."""

    title = "T2I-Adapter"
    flag = "--t2i-adapter"

    def add_flags(self, g) -> None:
        g.add_argument("--t2i-adapter", metavar="MODEL", action="append", default=[],
                       help="a T2I-Adapter (diffusers folder, hub id, e.g. TencentARC/t2iadapter_sketch_sd14v1, or an "
                            "original t2iadapter_*.pth file) to guide the model with; repeatable, each with its "
                            "--t2i-adapter-image")
        g.add_argument("--t2i-adapter-image", metavar="FILE", action="append", default=[],
                       help="the map a --t2i-adapter reads (sketch, depth, pose, ...), in the same order; resized to "
                            "the generation size")
        g.add_argument("--t2i-adapter-scale", metavar="S", type=float, nargs="+",
                       help="weight of each adapter's features: one, or one per --t2i-adapter (default 1.0)")
        g.add_argument("--t2i-adapter-factor", metavar="F", type=float, default=1.0,
                       help="share of the steps, from the first, that the T2I-Adapters act in (default 1.0)")

    def check(self, args) -> list:
        """Refuse bad T2I-Adapter flags (and a local adapter whose architecture cannot be read)."""
        pictures = pictures_per_model(args, "t2i_adapter", "t2i_adapter_image", "an adapter guides one model")
        n = len(pictures)
        if not n and (args.t2i_adapter_scale or args.t2i_adapter_factor != 1.0):
            raise SdxError("--t2i-adapter-scale and --t2i-adapter-factor act on T2I-Adapters: pass --t2i-adapter")
        if n and not 0.0 <= args.t2i_adapter_factor <= 1.0:
            raise SdxError(f"--t2i-adapter-factor {args.t2i_adapter_factor}: the share of the steps the adapters act "
                           "in, from 0 to 1")
        _finite(per_model(args.t2i_adapter_scale, n, "--t2i-adapter-scale", self.flag), "--t2i-adapter-scale")
        if any(Path(spec).exists() for spec in args.t2i_adapter):
            from convert.t2i_adapter import local_config

            for spec in args.t2i_adapter:
                if Path(spec).exists():
                    local_config(Path(spec), f"--t2i-adapter {spec}")
        return pictures

    def load(self, args, cache, log) -> dict:
        return {"t2i_adapters": tuple(args.t2i_adapter)}

    def pictures(self, read) -> list:
        return read

    def request(self, args, read, at) -> dict:
        if not read:
            return {}
        from pipelines.t2i_adapter import AdapterImage, fit_image

        scales = per_model(args.t2i_adapter_scale, len(read), "--t2i-adapter-scale", self.flag) or [1.0] * len(read)
        adapters = at.pipe.conditioning_models(AdapterImage.kind)
        return {"conditioning": [
            AdapterImage(fit_image(at.cut(p), at.size, adapter.config.in_channels), scale, args.t2i_adapter_factor)
            for p, adapter, scale in zip(read, adapters, scales)]}

    def png(self, args, request) -> dict:
        if not args.t2i_adapter:
            return {}
        from pipelines.t2i_adapter import AdapterImage

        adapters = [one for one in request.conditioning if isinstance(one, AdapterImage)]
        return {"t2i_adapter": args.t2i_adapter, "t2i_adapter_image": args.t2i_adapter_image,
                "t2i_adapter_scale": [a.scale for a in adapters], "t2i_adapter_factor": args.t2i_adapter_factor}


def _ip_scale(text: str) -> float | dict:
    """--ip-adapter-scale: a number, or a JSON object of diffusers' per-block scales."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor a JSON object like "
                                         '\'{"up": {"block_0": [0.0, 1.0, 0.0]}}\'')
    return value


class IPAdapterFlags(Method):
    """The IP-Adapter flags: one --ip-adapter-image per --ip-adapter, in order."""

    title = "IP-Adapter"
    flag = "--ip-adapter"

    def add_flags(self, g) -> None:
        g.add_argument("--ip-adapter", metavar="FILE", action="append", default=[],
                       help="an IP-Adapter .safetensors file (plain or plus, e.g. h94/IP-Adapter's "
                            "models/ip-adapter_sd15.safetensors) that lets --ip-adapter-image prompt the model; "
                            "repeatable, each with its --ip-adapter-image")
        g.add_argument("--ip-adapter-image", metavar="FILE", action="append", default=[],
                       help="the image prompt an --ip-adapter reads, in the same order")
        g.add_argument("--ip-adapter-scale", metavar="S", type=_ip_scale, action="append",
                       help="weight of the image prompt in every cross-attention (default 1.0; 0 ignores it), or per "
                            "block as JSON, diffusers' set_ip_adapter_scale dict, e.g. '{\"up\": {\"block_0\": [0.0, "
                            "1.0, 0.0]}}' (InstantStyle: the style block only; parts and blocks left out get 0); one, "
                            "or one per --ip-adapter")
        g.add_argument("--ip-adapter-image-encoder", metavar="FOLDER", action="append", default=[],
                       help="an adapter's CLIP image encoder (a transformers CLIPVisionModelWithProjection folder; "
                            "default: image_encoder beside the --ip-adapter file, as h94/IP-Adapter lays them out); "
                            "none, or one per --ip-adapter")

    def check(self, args) -> list:
        """Refuse bad IP-Adapter flags (a missing, pickled or foreign local adapter file among them, unloaded)."""
        pictures = pictures_per_model(args, "ip_adapter", "ip_adapter_image", "an IP-Adapter is made for one UNet")
        n = len(pictures)
        if not n and (args.ip_adapter_scale or args.ip_adapter_image_encoder):
            raise SdxError("--ip-adapter-scale and --ip-adapter-image-encoder go with an IP-Adapter: pass --ip-adapter")
        if args.ip_adapter_image_encoder and len(args.ip_adapter_image_encoder) != n:
            raise SdxError(f"--ip-adapter-image-encoder: give none or one per --ip-adapter ({n}), not "
                           f"{len(args.ip_adapter_image_encoder)}")
        _finite(per_model(args.ip_adapter_scale, n, "--ip-adapter-scale", self.flag), "--ip-adapter-scale")
        if n:
            from convert.hub import split_hub_path
            from convert.sources import looks_local
            from sdx.ip_adapter import config_of, read_file

            for spec in args.ip_adapter:
                on_hub = not Path(spec).exists() and not looks_local(spec) and (split_hub_path(spec) or ("", None))[1]
                if not on_hub:
                    config_of(read_file(spec), f"--ip-adapter {spec}")
        return pictures

    def load(self, args, cache, log) -> dict:
        if not args.ip_adapter:
            return {}
        from convert.sources import resolve_ip_adapter

        encoders = args.ip_adapter_image_encoder or [None] * len(args.ip_adapter)
        found = [resolve_ip_adapter(spec, encoder, cache_dir=cache / "models", log=log)
                 for spec, encoder in zip(args.ip_adapter, encoders)]
        return {"ip_adapters": tuple(a for a, _ in found), "image_encoders": tuple(e for _, e in found)}

    def request(self, args, read, at) -> dict:
        """Each --ip-adapter-image's prompt at its scale (diffusers' per-block dicts as site patterns)."""
        if not read:
            return {}
        from pipelines.image_prompt import ImagePrompt
        from sdx.ip_adapter import diffusers_scales

        scales = per_model(args.ip_adapter_scale, len(read), "--ip-adapter-scale", self.flag) or [1.0] * len(read)
        unet = at.pipe.sampler.models["unet"]
        scales = [diffusers_scales(s, unet) if isinstance(s, dict) else s for s in scales]
        return {"conditioning": [ImagePrompt.of([picture], at.pipe, k, scale)
                                 for k, (picture, scale) in enumerate(zip(read, scales))]}

    def png(self, args, request) -> dict:
        if not args.ip_adapter:
            return {}
        return {"ip_adapter": args.ip_adapter, "ip_adapter_image": args.ip_adapter_image,
                "ip_adapter_scale": args.ip_adapter_scale or [1.0]}


METHODS: tuple[Method, ...] = (ControlNetFlags(), UnionFlags(), AdapterFlags(), IPAdapterFlags())
