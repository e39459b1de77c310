"""sdx: Stable Diffusion XL, SD 1.x/2.x and InstructPix2Pix in pure JAX."""

__version__ = "0.1.0"

from sdx.dependencies import check_command

check_command()  # `python -m sdx.sample` by a Python without sdx's dependencies: one error line
