"""Tokenizer directories carrying the real chat templates of ``tests/data/chat_templates``, made
from the tiny model's tokenizer (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
FAMILIES = {  # template, format, bos, eos, the text that opens an assistant turn, what ends it
    "qwen2_5": ("qwen2_5.jinja", "hermes", None, "<|im_end|>", "<|im_start|>assistant\n", "<|im_end|>"),
    "llama3_1": ("llama3_1.jinja", "llama3_json", "<|begin_of_text|>", "<|eot_id|>",
                 "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "mistral": ("mistral_v0_3.jinja", "mistral", "<s>", "</s>", "[/INST]", "</s>"),
}


def make_dir(root: Path, family: str, tiny_model: Path) -> Path:
    template, _, bos, eos, _, _ = FAMILIES[family]
    d = root / family
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "chat_template": (TEMPLATES / template).read_text()}))
    return d


def make_plain_dir(root: Path, tiny_model: Path) -> Path:
    """The tiny tokenizer with bare ChatML (the tiny model's template before it took Qwen2.5's): a
    template that renders no tools and shows no tool-call format."""
    d = root / "plain"
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "chat_template": (TEMPLATES / "plain.jinja").read_text()}))
    return d
