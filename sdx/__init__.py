"""sdx: Stable Diffusion XL, SD 1.x/2.x and InstructPix2Pix in pure JAX."""

__version__ = "0.1.0"
