"""Reading the checkpoints people have (diffusers folders, the hub) into the sdx layout, and back."""
