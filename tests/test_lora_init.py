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
