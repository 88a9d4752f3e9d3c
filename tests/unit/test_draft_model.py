"""``draft:DIR`` (issue 34): a smaller model with the target's tokenizer drafts, with paged KV of
its own. The target's greedy output is unchanged; the target drafting for itself has every draft
accepted (its draft KV, kept across steps and recomputed past rejections, is right); a draft
model with another vocabulary is refused in one line."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def other_size(tiny_model, tmp_path_factory):
    """A model of another size (one layer, 32 wide) with the tiny model's tokenizer, random weights."""
    import torch
    import transformers as tf

    out = tmp_path_factory.mktemp("draft") / "tiny-1l"
    cfg = json.loads((tiny_model / "config.json").read_text())
    cfg.update(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    torch.manual_seed(5)
    model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**cfg))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_model / name, out / name)
    return out


def engine(model, **kw):
    from engine.config import EngineConfig
    from engine.engine import Engine

    return Engine(EngineConfig(model, device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=8, **kw))


def prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(8, 4096) for _ in range(5 + i)] * 2 for i in range(3)]


def run(e, ps, n=14) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n - 2 * i, temperature=0.0, ignore_eos=True) for i in range(len(ps))]
    return [s.output_token_ids for s in e.generate(ps, params)]


def test_draft_models_keep_the_targets_output(tiny_model, other_size):
    ps = prompts()
    ref = run(engine(tiny_model), ps)
    itself = engine(tiny_model, speculative=f"draft:{tiny_model}", num_speculative_tokens=3)
    assert run(itself, ps) == ref
    c = itself.scheduler.spec
    assert c.drafted > 10 and c.accepted == c.drafted  # its own greedy tokens: every draft accepted
    assert run(itself, ps) == ref  # again: finished rows' draft blocks came back to its pool
    other = engine(tiny_model, speculative=f"draft:{other_size}", num_speculative_tokens=3)
    assert run(other, ps) == ref
    assert other.scheduler.spec.drafted > 0


def test_a_draft_model_with_another_vocabulary_is_refused_in_one_line(tiny_model, tmp_path):
    cfg = json.loads((tiny_model / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000}))
    with pytest.raises(ValueError, match=r"vocabulary of 1000 tokens, the target 4096") as e:
        engine(tiny_model, speculative=f"draft:{tmp_path}")
    assert "\n" not in str(e.value)


def test_finished_and_preempted_rows_give_their_blocks_back_when_the_pool_runs_short():
    """A preempted sequence's draft KV (a draft model's, an EAGLE-3 head's) is not kept while it
    waits: the running rows would find no blocks to draft with. Rows of running sequences stay."""
    from engine.draft_model import DraftBlocks, _DraftRow
    from engine.sequence import SeqStatus

    class Seq:
        def __init__(self, status):
            self.status = status

        @property
        def is_finished(self):
            return self.status.is_finished

    kv = DraftBlocks(6, 4, _DraftRow)
    running, preempted, done = Seq(SeqStatus.RUNNING), Seq(SeqStatus.RUNNING), Seq(SeqStatus.FINISHED_LENGTH)
    for seq in (running, preempted, done):
        assert kv.grow(kv.row(seq), 8)  # two blocks each: the pool is empty
    preempted.status = SeqStatus.PREEMPTED
    new = Seq(SeqStatus.RUNNING)
    assert kv.grow(kv.row(new), 16)  # four blocks: the finished and the preempted rows' came back
    assert len(kv.row(running).blocks) == 2 and preempted not in kv.rows and done not in kv.rows
    assert not kv.grow(kv.row(new), 20)  # nothing else to take: no drafts, nothing taken
    assert kv.row(preempted).blocks == []  # readmitted: a new row, its draft KV computed again
