"""Tiny random diffusers folders of every card, for the tests and the benchmarks (not part of the product).

Each `build_tiny_*` writes a complete folder with `save_pretrained` (random
weights, tokenizers built in memory, nothing from a hub), so it loads through
the path a user's folder takes. The package lives under tests/ so the wheel of
flywheel does not ship it (pyproject packages only engine, rewards, flywheel
and trainers). It is imported as `tiny_models`: pytest puts tests/ on sys.path
(pyproject's `pythonpath`), and the benchmarks insert it themselves.

- `core`: the shared parts (tokenizers, text encoders, a KL VAE) and SD3, FLUX.1, Wan2.1 T2V;
- `qwen_image`, `wan_i2v`, `ltx2`, `families_2026` (FLUX.2-klein, Z-Image, Wan2.2), `edit` (Kontext,
  Qwen-Image-Edit-Plus): one family each;
- `folders`: a folder of any card by its id, and the smoke-test command (`python tests/tiny_models`).
"""
