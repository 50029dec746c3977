"""A LoRA run starts from an adapter its seed fixes: peft draws A from torch's global generator, which the
recipes never seed, so two runs of one config once trained different adapters (toy_lora_kl's metrics moved
run to run)."""

import torch

from flywheel.recipe.policy import build_policy


def lora_cfg(seed: int, init: str = "default"):
    from flywheel.runs.config import parse_config
    from trainers.grpo import Config

    return parse_config(Config, [f"seed={seed}", "model.finetune=lora", "model.lora_rank=4", "model.lora_alpha=4",
                                 f"model.lora_init={init}"])


def adapter(seed: int, init: str = "default") -> dict[str, torch.Tensor]:
    policy = build_policy(lora_cfg(seed, init), torch.device("cpu"), reference=False)
    return {n: p.detach().clone() for n, p in policy.named_params}


def test_the_seed_fixes_the_adapters_initial_a_whatever_the_global_generator_holds():
    torch.manual_seed(123)
    first = adapter(seed=0)
    torch.manual_seed(456)  # another global state: the adapter must not depend on it
    second = adapter(seed=0)
    assert sorted(first) == sorted(second) and any("lora_A" in n for n in first)
    assert all(torch.equal(first[n], second[n]) for n in first)
    other = adapter(seed=1)
    assert not all(torch.equal(first[n], other[n]) for n in first if "lora_A" in n)  # the check can tell seeds apart
    assert all(not p.any() for n, p in first.items() if "lora_B" in n)  # B = 0: the run starts at the base model


def test_gaussian_init_is_seeded_too():
    torch.manual_seed(7)
    a = adapter(seed=3, init="gaussian")
    torch.manual_seed(8)
    b = adapter(seed=3, init="gaussian")
    assert all(torch.equal(a[n], b[n]) for n in a)
    lora_a = next(p for n, p in a.items() if "lora_A" in n)
    assert 0.2 < float(lora_a.std()) * 4 ** 0.5 < 5  # N(0, 1/r), r = 4: not the Kaiming-uniform default


def test_switching_the_adapters_off_and_on_keeps_a_frozen_adapter_frozen():
    """The reference forward (`adapters_disabled`) must not make trainable an adapter frozen on purpose (Wan2.2's
    expert left out by model.experts): peft's enable_adapters(True) marks every active adapter trainable again,
    and a later export then wrote the untouched expert as trained."""
    from flywheel.lora import adapters_disabled, add_lora

    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    add_lora(module, 2, 2, ["0", "1"])
    for name, p in module.named_parameters():
        if name.startswith("1.") and "lora_" in name:
            p.requires_grad_(False)
    before = {n: p.requires_grad for n, p in module.named_parameters()}
    assert any(before.values()) and not all(v for n, v in before.items() if "lora_" in n)
    x = torch.ones(1, 4)
    with adapters_disabled(module):
        module(x)
    assert {n: p.requires_grad for n, p in module.named_parameters()} == before


def test_a_16_bit_model_gets_a_float32_adapter_that_starts_at_the_base_and_keeps_the_output_dtype():
    from engine import load_model
    from flywheel.lora import add_lora

    for dtype in (torch.float16, torch.bfloat16):
        base = load_model("toy-digits", dtype=dtype)
        adapted = load_model("toy-digits", dtype=dtype)
        add_lora(adapted.transformer, 4, 4, ["qkv"])
        lora = {n: p for n, p in adapted.transformer.named_parameters() if "lora_" in n}
        assert lora and {p.dtype for p in lora.values()} == {torch.float32}, dtype
        frozen = {p.dtype for n, p in adapted.transformer.named_parameters() if "lora_" not in n}
        assert frozen == {dtype}  # the base weights keep the model's dtype
        shape = adapted.latent_shape(None, None, None)
        x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))
        t = torch.full((2,), 0.5)
        prompts = ["a seven", "a one"]
        out = adapted.velocity(adapted.transformer, x, t, adapted.encode_prompts(prompts))
        want = base.velocity(base.transformer, x, t, base.encode_prompts(prompts))
        assert out.dtype == want.dtype and torch.equal(out, want)  # B = 0: the base model's velocity


def test_float16_trains_through_a_lora_and_is_refused_for_a_full_fine_tune(tmp_path):
    from flywheel.runs.config import ConfigError, parse_config
    from trainers.grpo import Config, main, validate_config

    with __import__("pytest").raises(ConfigError, match="model.dtype=float16 with model.finetune=full: AdamW would "
                                                        "keep its state in float16"):
        validate_config(parse_config(Config, ["model.dtype=float16"]))
    # A LoRA on float16 weights: its float32 adapter steps (it made every weight inf at step 1 as float16).
    summary = main([f"run_dir={tmp_path / 'run'}", "tracker=none", "steps=2", "eval.every=2", "eval.seeds=1",
                    "data.prompts_per_step=2", "data.group_size=4", "sampling.steps=4", "model.dtype=float16",
                    "model.finetune=lora"])
    assert summary["trained_steps"] == 2
