"""Training: `python -m train.X` trainers, their data and the shapes world the default models learn."""
