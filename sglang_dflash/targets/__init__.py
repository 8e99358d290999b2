"""Model recipes and fixtures: tiny random targets, real targets from GGUF wheels, exact-shape configs."""
