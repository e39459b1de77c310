"""Training: `python -m train.X` trainers, their data and the shapes world the default models learn.

Training needs the `train` extra (checkpoints, data loading, parquet, TensorBoard files), which `make demo`
does not install. Without it, `python -m train.X` ends with one `error:` line that says what to install
(exit status 2; `sdx.dependencies`), and `import train...` raises an ImportError with the same words.
"""

from sdx import dependencies

dependencies.check_command()
_MISSING = dependencies.problem("train", required=False)
if _MISSING:
    raise ImportError(_MISSING)
