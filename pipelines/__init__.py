"""Text-to-image, img2img, refiner and InstructPix2Pix pipelines over the sdx models."""

from sdx.dependencies import check_command

check_command()  # `python -m pipelines.X` by a Python without sdx's dependencies: one error line
