"""benchmarks/memory.py: its flat keys and ratios on hand-written peaks, the table, the shared command line, and
the checks of its own flags (a full measurement runs a recipe per process: docs/memory.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "memory.py"


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("memory_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


memory = _load_benchmark()
MB = 2**20


def test_keys_are_peaks_over_the_weights_and_over_grpos_peak():
    peaks = {("grpo", "lora"): {"peak": 300 * MB, "peak_run": 400 * MB},
             ("nft", "lora"): {"peak": 330 * MB, "peak_run": 400 * MB},
             ("nft", "full"): {"peak": 900 * MB, "peak_run": 1000 * MB}}
    result = memory.summarize(peaks, weights_bytes=200 * MB)
    assert result["weights_mb"] == 200
    assert result["nft_peak_lora_mb"] == 330 and result["nft_peak_run_full_mb"] == 1000
    assert result["grpo_peak_lora_over_weights"] == 1.5 and result["nft_peak_full_over_weights"] == 4.5
    assert result["nft_over_grpo_peak_lora"] == pytest.approx(1.1)
    assert result["grpo_over_grpo_peak_lora"] == 1.0 and result["nft_over_grpo_peak_run_lora"] == 1.0
    assert "nft_over_grpo_peak_full" not in result  # no GRPO full-fine-tune run to divide by
    text = memory.table(result, ["grpo", "nft"], ["lora", "full"])
    assert text.splitlines()[1].split() == ["grpo", "300", "1.50", "1.00", "-", "-", "-"]
    assert text.splitlines()[2].split() == ["nft", "330", "1.65", "1.10", "900", "4.50", "-"]


def test_every_recipe_gets_the_same_batch_resolution_and_evaluation():
    args = {r: memory.run_args(r, "lora", Path("/f"), Path("/p"), Path("/runs/x"), steps=2) for r in memory.RECIPES}
    shared = {r: [a for a in argv if a not in memory.RECIPE_ARGS.get(r, [])] for r, argv in args.items()}
    assert len({tuple(a) for a in shared.values()}) == 1
    extras = [a for extra in memory.RECIPE_ARGS.values() for a in extra]
    assert extras and all(a.startswith("train.") for a in extras)  # only the recipes' own keys differ
    assert {"model.finetune=lora", "data.prompts_per_step=2", "data.group_size=2", "sampling.height=32",
            "sampling.guidance_scale=1", "steps=2", "model.card=sd3"} <= set(args["nft"])


def test_the_full_size_transformer_has_over_fifty_million_parameters():
    from diffusers import SD3Transformer2DModel

    layers, heads, head_dim = memory.SIZES["full"]
    config = dict(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=layers,
                  attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=32,
                  caption_projection_dim=heads * head_dim, pooled_projection_dim=32, pos_embed_max_size=32)
    with __import__("torch").device("meta"):
        params = sum(p.numel() for p in SD3Transformer2DModel(**config).parameters())
    assert params > 50e6


@pytest.mark.parametrize("argv, message", [
    (["--recipes", "grpo,ppo"], "--recipes='grpo,ppo': valid values are grpo, nft, awm, dpo"),
    (["--finetune", "qlora"], "--finetune='qlora': valid values are lora, full"),
    (["--root", "/"], "holds no trainers/ folder"),
    (["--steps", "0"], "--steps 0: must be >= 1"),
])
def test_bad_flags_stop_before_anything_is_built(argv, message):
    with pytest.raises(SystemExit, match=message):
        memory.main(argv)
