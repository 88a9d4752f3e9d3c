"""PEFT adapters on a base checkpoint, and transformers + peft as their reference."""

from __future__ import annotations

import torch

from tests.helpers.references import hf_greedy

# name -> PEFT settings: every projection; attention only with a per-module alpha; MLP only, rsLoRA
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj"]),
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], alpha_pattern={"o_proj": 2}),
    "mlp": dict(r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
}


def make_adapter(base_dir, out, seed: int, **settings):
    """A PEFT adapter with random, non-zero A and B (``init_lora_weights=False``), saved as PEFT does."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **settings))
    with torch.no_grad():  # scale B up so that every adapter changes the greedy choices
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft_model.save_pretrained(out)
    return out


def peft_references(base_dir, root, prompts, max_tokens: int):
    """The ``ADAPTERS`` made by peft on ``base_dir`` (under ``root``), and transformers + peft
    greedy outputs of every prompt under each (key None: the base model)."""
    import transformers as tf
    from peft import PeftModel

    dirs = {name: make_adapter(base_dir, root / name, seed, **settings)
            for seed, (name, settings) in enumerate(ADAPTERS.items(), start=1)}
    expected = {}
    for name in [None, *dirs]:
        model = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, dirs[name]).eval()
        expected[name] = [hf_greedy(model, p, max_tokens) for p in prompts]
    return dirs, expected
