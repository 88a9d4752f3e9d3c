"""Files shipped with pdmesh (the tokenizer of the tiny model)."""
