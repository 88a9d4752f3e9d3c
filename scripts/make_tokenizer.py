"""Train the byte-level BPE shipped as engine/assets/tokenizer.json.

Run once; the result is committed so that `mesh model tiny` is deterministic
and needs no training at run time. The corpus is English text this machine's
Python ships (stdlib docstrings) plus the project's design notes.
"""

from __future__ import annotations

import ast
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 4096


def corpus() -> list[str]:
    texts = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    for extra in sys.argv[2:]:
        texts.append(Path(extra).read_text(encoding="utf-8"))
    return texts


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "engine/assets/tokenizer.json")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    out.write_text(tok.to_str(pretty=False), encoding="utf-8")
    print(f"wrote {out}: vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
