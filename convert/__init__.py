"""Reading the checkpoints people have (diffusers folders, the hub) into the sdx layout, and back."""

from sdx.dependencies import check_command

check_command()  # `python -m convert.X` by a Python without sdx's dependencies: one error line
