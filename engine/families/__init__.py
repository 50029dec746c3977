"""Real model families loaded from local diffusers folders (SD3, FLUX, Wan); each registers its card."""
