"""diffusers behind a one-at-a-time FastAPI server: the baseline `benchmarks/serve.py --diffusers` loads.

    python benchmarks/serve_diffusers.py FOLDER [--dtype bfloat16] [--port 0]

FOLDER is a diffusers pipeline folder (`benchmarks/sample.py`'s random-weight ones, or a real model's). It answers
POST /sdapi/v1/txt2img with A1111's fields prompt, negative_prompt, steps, cfg_scale, width, height, seed and
batch_size, with diffusers' Euler scheduler, one request at a time behind a lock (as AUTOMATIC1111 and Forge run),
and prints "... at http://HOST:PORT" once it listens, as `python -m sdx.serve` does.
"""

from __future__ import annotations

import argparse
import base64
import io
import threading

import torch
import uvicorn
from diffusers import AutoPipelineForText2Image, EulerDiscreteScheduler
from fastapi import FastAPI
from pydantic import BaseModel


class Body(BaseModel):
    prompt: str = ""
    negative_prompt: str | None = None
    steps: int = 50
    cfg_scale: float = 7.0
    width: int = 512
    height: int = 512
    seed: int = 0
    batch_size: int = 1


def app_for(folder: str, dtype: str) -> FastAPI:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = AutoPipelineForText2Image.from_pretrained(folder, torch_dtype=getattr(torch, dtype)).to(device)
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    one_at_a_time, app = threading.Lock(), FastAPI()

    @app.post("/sdapi/v1/txt2img")
    def txt2img(body: Body):
        with one_at_a_time:
            images = pipe(prompt=body.prompt, negative_prompt=body.negative_prompt or None,
                          num_inference_steps=body.steps, guidance_scale=body.cfg_scale, width=body.width,
                          height=body.height, num_images_per_prompt=body.batch_size,
                          generator=torch.Generator(device).manual_seed(body.seed)).images
        encoded = []
        for image in images:
            out = io.BytesIO()
            image.save(out, format="PNG")
            encoded.append(base64.b64encode(out.getvalue()).decode())
        return {"images": encoded, "parameters": body.model_dump(), "info": "{}"}

    return app


class _Server(uvicorn.Server):
    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        print(f"serving diffusers at http://{host}:{port}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    _Server(uvicorn.Config(app_for(args.folder, args.dtype), host="127.0.0.1", port=args.port,
                           log_level="warning")).run()


if __name__ == "__main__":
    main()
