"""Hugging Face transformers as the numerical reference of the engine."""

from __future__ import annotations

import random

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.sequence import SeqStatus


def prompts_of(lengths, vocab: int, seed: int = 0, low: int = 0) -> list[list[int]]:
    """One prompt of random token ids in ``[low, vocab)`` per length."""
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab) for _ in range(n)] for n in lengths]


def hf_model(path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )
    return out[0, len(prompt):].tolist()


def assert_logits_match_transformers(path, family: str) -> None:
    """Every row our engine computes, in the prefill step and each decode step after it, equals
    transformers' logits at that position (float32, up to 1e-4)."""
    ref = hf_model(path)
    engine = Engine(EngineConfig(path, num_kv_blocks=128, block_size=8))
    engine.runner.capture_logits = True
    prompts = prompts_of([5, 19, 33], ref.config.vocab_size)
    seqs = [engine.new_sequence(p, SamplingParams(max_tokens=6, temperature=0.0)) for p in prompts]
    for s in seqs:
        engine.add(s)
    steps = 0
    while engine.has_work:
        # the rows this step computes, per sequence, before the step advances them
        plan = [(s, s.num_computed_tokens, s.num_tokens) for s in seqs if not s.is_finished]
        engine.step()
        logits = engine.runner.last_logits
        row = 0
        for s, start, end in plan:
            with torch.no_grad():
                full = ref(torch.tensor([s.token_ids[:end]])).logits[0].float()
            ours = logits[row : row + end - start]
            diff = (ours - full[start:end]).abs().max().item()
            assert diff < 1e-4, f"{family}: step {steps} rows {start}:{end} differ by {diff}"
            row += end - start
        steps += 1
    assert steps == 6  # one prefill step, then five decode steps
    assert all(s.status == SeqStatus.FINISHED_LENGTH for s in seqs)


def run_with_logits(engine: Engine, prompts, params: SamplingParams):
    """Greedy outputs, cached tokens per sequence, and the logits of every step's rows (in step order)."""
    engine.runner.capture_logits = True
    seqs = [engine.new_sequence(p, params) for p in prompts]
    for s in seqs:
        engine.add(s)
    logits = []
    while engine.has_work:
        engine.step()
        logits.append(engine.runner.last_logits)
    return [s.output_token_ids for s in seqs], [s.num_cached_tokens for s in seqs], logits
