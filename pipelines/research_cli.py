"""`python -m sdx.sample`'s research methods (`pipelines.method.Method`s): FreeU, Perturbed-Attention Guidance,
Self-Attention Guidance and attention maps. Each puts its flags on the parser, refuses bad values before anything
is loaded, gives the `Request` its guider or interventions, records its settings in the PNG and writes what it
reads out; what a model cannot take (SAG on SDXL, a PAG layer without self-attention, a pattern that selects
nothing) is refused by `Pipeline.validate`, before compiling."""

from __future__ import annotations

import math
from pathlib import Path

from pipelines.method import Method
from sdx.errors import SdxError


def _non_negative(args, *flags: str) -> None:
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise SdxError(f"--{flag.replace('_', '-')} {value} must be a finite number >= 0")


def _one_model(args, flag: str, why: str) -> None:
    if args.refiner:
        raise SdxError(f"{flag} acts on one model{why}: no --refiner")


class FreeUFlags(Method):
    title = "FreeU"

    def add_flags(self, g) -> None:
        g.add_argument("--freeu", metavar=("B1", "B2", "S1", "S2"), type=float, nargs=4,
                       help="FreeU (diffusers' enable_freeu): backbone scales b1, b2 and skip scales s1, s2 of the "
                            "first two up blocks, e.g. SD 1.5: 1.5 1.6 0.9 0.2, SD 2.1: 1.4 1.6 0.9 0.2, SDXL: 1.3 1.4 "
                            "0.9 0.2")

    def check(self, args) -> None:
        if args.freeu and not all(math.isfinite(v) for v in args.freeu):
            raise SdxError(f"--freeu {' '.join(map(str, args.freeu))}: four finite numbers b1 b2 s1 s2")
        if args.freeu:
            _one_model(args, "--freeu", " (its scales are each model's own)")

    def request(self, args, read, at) -> dict:
        from sdx.freeu import FreeU

        return {"interventions": [FreeU(*args.freeu)]} if args.freeu else {}

    def png(self, args, request) -> dict:
        return {"freeu": list(args.freeu)} if args.freeu else {}


class PAGFlags(Method):
    title = "Perturbed-Attention Guidance"

    def add_flags(self, g) -> None:
        g.add_argument("--pag-scale", metavar="S", type=float,
                       help="Perturbed-Attention Guidance at scale S (diffusers' pag_scale; 3.0 is theirs), with or "
                            "without classifier-free guidance")
        g.add_argument("--pag-adaptive-scale", metavar="A", type=float, default=0.0,
                       help="PAG's scale falls by A per timestep below 1000 (diffusers' pag_adaptive_scale; default 0)")
        g.add_argument("--pag-layers", metavar="LAYER", nargs="+", default=None,
                       help="the self-attentions PAG perturbs, as diffusers' pag_applied_layers: regular expressions "
                            "searched in their module paths (default: mid; e.g. up_blocks.1, down_blocks.2.attentions.1)")

    def check(self, args) -> None:
        _non_negative(args, "pag_scale", "pag_adaptive_scale")
        if args.pag_scale is None and (args.pag_adaptive_scale or args.pag_layers):
            raise SdxError("--pag-adaptive-scale and --pag-layers go with Perturbed-Attention Guidance: pass --pag-scale")
        if args.pag_scale is not None:
            _one_model(args, "--pag-scale", "")

    def request(self, args, read, at) -> dict:
        from pipelines.pag import PerturbedAttention, diffusers_layers

        if args.pag_scale is None:
            return {}
        layers = diffusers_layers(at.pipe.sampler.models["unet"], tuple(args.pag_layers or ("mid",)))
        return {"guidance": PerturbedAttention(layers, args.pag_scale, args.pag_adaptive_scale)}

    def png(self, args, request) -> dict:
        if args.pag_scale is None:
            return {}
        return {"pag_scale": args.pag_scale, "pag_adaptive_scale": args.pag_adaptive_scale,
                "pag_layers": list(args.pag_layers or ("mid",))}


class SAGFlags(Method):
    title = "Self-Attention Guidance"

    def add_flags(self, g) -> None:
        g.add_argument("--sag-scale", metavar="S", type=float,
                       help="Self-Attention Guidance at scale S (SD 1.x/2.x, diffusers' StableDiffusionSAGPipeline; "
                            "0.75 is theirs)")

    def check(self, args) -> None:
        _non_negative(args, "sag_scale")
        if args.sag_scale is not None and args.pag_scale is not None:
            raise SdxError("--pag-scale and --sag-scale do not go together (diffusers has no pipeline with both)")
        if args.sag_scale is not None:
            _one_model(args, "--sag-scale", "")

    def request(self, args, read, at) -> dict:
        from pipelines.sag import SelfAttention

        return {} if args.sag_scale is None else {"guidance": SelfAttention(args.sag_scale)}

    def png(self, args, request) -> dict:
        return {} if args.sag_scale is None else {"sag_scale": args.sag_scale}


class AttentionMapsFlags(Method):
    title = "attention maps"

    def add_flags(self, g) -> None:
        g.add_argument("--attention-maps", metavar="DIR",
                       help="write each image's cross-attention map of every prompt token (DAAM's aggregation: summed "
                            "over heads, layers and steps, upscaled to the image) to DIR: IMAGE-NN-WORD.png heatmaps "
                            "and IMAGE.npy (tokens, height, width)")
        g.add_argument("--attention-maps-layers", metavar="PATTERN", default="**",
                       help="the cross-attentions whose maps count, a pattern over their module paths (* one part, ** "
                            "any; default all), e.g. 'up_blocks' or 'down_blocks.1.attentions.*'")
        g.add_argument("--attention-maps-steps", metavar=("START", "END"), type=float, nargs=2, default=(0.0, 1.0),
                       help="the share of the steps whose maps count, from START to END (default 0 1: all)")

    def check(self, args) -> None:
        start, end = args.attention_maps_steps
        if not 0.0 <= start < end <= 1.0:
            raise SdxError(f"--attention-maps-steps {start} {end}: shares of the steps with 0 <= START < END <= 1")
        if args.attention_maps is None and (args.attention_maps_layers != "**" or (start, end) != (0.0, 1.0)):
            raise SdxError("--attention-maps-layers and --attention-maps-steps go with --attention-maps DIR")
        if args.attention_maps is not None and (args.refiner or args.padding_mask_crop is not None):
            raise SdxError("--attention-maps reads one model's cross-attentions over the whole picture: no --refiner, "
                           "no --padding-mask-crop")

    def request(self, args, read, at) -> dict:
        from pipelines.attention_maps import AttentionMaps

        if args.attention_maps is None:
            return {}
        return {"interventions": [AttentionMaps(args.attention_maps_layers, *args.attention_maps_steps)]}

    def write(self, args, pipe, request, generated, pixels, paths: list[Path], log) -> list[Path]:
        """Each image's token maps beside its PNG's name in the folder (`pipelines.attention_maps`); `generated`:
        the `Pipeline.generate` result (None when nothing was read out)."""
        from pipelines.attention_maps import AttentionMaps, token_maps, write

        if args.attention_maps is None or generated is None:
            return []
        buffer = next(r for r, one in zip(generated.readouts, request.interventions) if isinstance(one, AttentionMaps))
        prompts = [p for p in request.prompts for _ in range(request.num_images_per_prompt)]
        written = []
        for path, (words, maps), picture in zip(paths, token_maps(pipe, buffer, prompts, pixels.shape[1:3]), pixels):
            written += write(Path(args.attention_maps), path.stem, words, maps, picture)
        log(f"wrote {len(written)} attention-map files to {args.attention_maps}")
        return written


METHODS: tuple[Method, ...] = (FreeUFlags(), PAGFlags(), SAGFlags(), AttentionMapsFlags())
