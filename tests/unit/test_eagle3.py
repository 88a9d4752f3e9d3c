"""``eagle3:DIR`` (issue 34): an EAGLE-3 head in its published checkpoint format drafts from the
target's hidden states. Its drafts match an independent re-implementation of the published
architecture over Hugging Face's hidden states; states rebuilt for tokens the target did not
compute here match the captured ones; greedy outputs are token-identical to decoding without
speculation (batch, preemption, prefix-cache hits); a checkpoint for another target is refused
in one line, in the engine and by the CLI."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine.sampling import SamplingParams
from engine.spec.adaptive import AcceptancePrior
from tests.helpers.eagle3 import make_eagle3_checkpoint

AUX = [1, 0, 1]  # the tiny target has 2 layers: the published default (2, L // 2, L - 3) needs 4


@pytest.fixture(scope="module")
def head(tiny_model, tmp_path_factory):
    """A head with a draft vocabulary of its own (1024 of the 4096 ids, through d2t)."""
    return make_eagle3_checkpoint(tiny_model, tmp_path_factory.mktemp("eagle3") / "head", seed=3,
                                  draft_vocab_size=1024, aux_layers=AUX)


def engine(model, **kw):
    from engine.config import EngineConfig
    from engine.engine import Engine

    kw.setdefault("num_kv_blocks", 64)
    return Engine(EngineConfig(model, device="cpu", block_size=4, max_num_seqs=8, **kw))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompts(count: int = 4, seed: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 4096) for _ in range(5 + 3 * i)] for i in range(count)]


def outputs(e, ps, n: int = 16) -> list[list[int]]:
    return [s.output_token_ids for s in e.generate(ps, [greedy(n - i) for i in range(len(ps))])]


# -- an independent reference of the published architecture -------------------------------------

def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.fixture(scope="module")
def hf(tiny_model):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()


def reference_states(hf, ckpt, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``fc`` of the inputs of layers AUX, from transformers' ``hidden_states`` (entry j is layer
    j's input): the head's hidden state of every position of ``tokens``; and the embeddings."""
    with torch.no_grad():
        hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    fc = load_file(str(ckpt / "model.safetensors"))["fc.weight"]
    return torch.cat([hs[j][0] for j in AUX], dim=-1) @ fc.T, hf.model.embed_tokens.weight.detach()


def reference_drafts(ckpt, states: torch.Tensor, embed: torch.Tensor, tokens: list[int], k: int) -> list[int]:
    """The published head run as vLLM runs it: position i takes token i + 1 with the target's state
    at i; each drafted token then goes in at the next position with the head's pre-norm output."""
    import transformers as tf

    w = load_file(str(ckpt / "model.safetensors"))
    cfg = json.loads((ckpt / "config.json").read_text())
    eps, heads, kv_heads = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg["hidden_size"] // heads
    rotary = tf.models.llama.modeling_llama.LlamaRotaryEmbedding(tf.LlamaConfig(**cfg))
    rotate = tf.models.llama.modeling_llama.apply_rotary_pos_emb
    n = len(tokens)
    ids, hidden, pos = torch.tensor(tokens[1:]), states[: n - 1], torch.arange(n - 1)
    keys, values, drafts = [], [], []
    for _ in range(k):
        p = "midlayer."
        x = torch.cat([rms(embed[ids], w[p + "input_layernorm.weight"], eps),
                       rms(hidden, w[p + "hidden_norm.weight"], eps)], dim=-1)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(len(ids), heads, dim).transpose(0, 1)[None]
        kk = (x @ w[p + "self_attn.k_proj.weight"].T).view(len(ids), kv_heads, dim).transpose(0, 1)[None]
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(len(ids), kv_heads, dim).transpose(0, 1)[None]
        cos, sin = rotary(v, pos[None])
        q, kk = rotate(q, kk, cos, sin)
        keys.append(kk)
        values.append(v)
        kc, vc = torch.cat(keys, 2), torch.cat(values, 2)
        mask = torch.arange(kc.shape[2])[None, :] <= (kc.shape[2] - len(ids) + torch.arange(len(ids)))[:, None]
        o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True, scale=1 / math.sqrt(dim))
        r = o[0].transpose(0, 1).reshape(len(ids), -1) @ w[p + "self_attn.o_proj.weight"].T + hidden
        y = rms(r, w[p + "post_attention_layernorm.weight"], eps)
        pre = (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"].T + r
        best = int((rms(pre[-1], w["norm.weight"], eps) @ w["lm_head.weight"].T).argmax())
        drafts.append(best + int(w["d2t"][best]))
        ids, hidden, pos = torch.tensor([drafts[-1]]), pre[-1:], pos[-1:] + 1
    return drafts


def test_the_head_matches_a_reference_of_the_published_architecture(tiny_model, head, hf):
    e = engine(tiny_model, speculative=f"eagle3:{head}", num_speculative_tokens=4)
    seq = e.new_sequence(prompts(1, seed=9)[0] * 2, greedy(8))
    e.add(seq)
    e.step()  # the prompt: its states are captured
    tokens = seq.token_ids
    states, embed = reference_states(hf, head, tokens)
    drafter = e.eagle3
    row = drafter.kv.row(seq)
    assert row.start == 0 and len(row.states) == len(tokens) - 1
    torch.testing.assert_close(row.states, states[: len(tokens) - 1], rtol=1e-4, atol=1e-4)
    # the states of tokens the target did not compute here, rebuilt from its KV, are the same
    torch.testing.assert_close(drafter._rebuild(seq, 0, len(tokens) - 1), row.states, rtol=1e-4, atol=1e-4)
    want = reference_drafts(head, states, embed, tokens, 4)
    assert len(set(want)) > 1 and all(t % 4 == 0 for t in want)  # through d2t: every 4th target id
    assert drafter.propose(seq, 4) == want
    assert drafter.propose(seq, 4) == want  # again, from the head KV it kept


def test_states_after_verification_are_those_of_the_accepted_tokens(tiny_model, head, hf):
    """Drafts some accepted, some rejected (the oracle drafter proposes the target's own tokens,
    30% corrupted) while the target keeps the head's states: the states kept for every position
    of the output are the reference ones of the tokens finally there (a rejected draft's state
    is replaced when the target computes that position again)."""
    from engine.spec.oracle import OracleDrafter

    ps = prompts(2, seed=11)
    ref = outputs(engine(tiny_model), ps, 20)
    e = engine(tiny_model, speculative=f"eagle3:{head}", num_speculative_tokens=3)
    e.scheduler.drafter = OracleDrafter({tuple(p): r for p, r in zip(ps, ref, strict=True)}, 0.7, e.vocab_size)
    seqs = e.generate(ps, [greedy(20 - i) for i in range(len(ps))])  # the head still captures (e.eagle3)
    assert [s.output_token_ids for s in seqs] == ref
    c = e.scheduler.spec
    assert 0 < c.accepted < c.drafted, c
    for seq in seqs:
        tokens = seq.token_ids
        row = e.eagle3.kv.row(seq)
        assert row.start == 0 and len(row.states) >= len(tokens) - 1
        states, _ = reference_states(hf, head, tokens)
        torch.testing.assert_close(row.states[: len(tokens) - 1], states[: len(tokens) - 1], rtol=1e-4, atol=1e-4)


def test_greedy_outputs_are_token_identical(tiny_model, head):
    ps = prompts()
    ref = outputs(engine(tiny_model), ps)
    e = engine(tiny_model, speculative=f"eagle3:{head}", num_speculative_tokens=3)
    assert outputs(e, ps) == ref
    c = e.scheduler.spec
    assert c.drafted > 0 and c.steps > 0, c
    assert e.eagle3.rebuilt_tokens == 0  # every token was computed here
    # the same prompts again: their blocks are cached, the target computes only the last token of
    # each prompt, and the head's states for the cached ones are rebuilt
    drafted = c.drafted
    e.scheduler.spec_prior = AcceptancePrior()  # forget the random head's acceptance (0): new rows draft
    assert outputs(e, ps) == ref
    assert c.drafted > drafted
    assert e.eagle3.rebuilt_tokens > 0
    assert_reported(e)
    # overlapped scheduling: a step launches before the last one's tokens reach the host
    overlapped = engine(tiny_model, speculative=f"eagle3:{head}", num_speculative_tokens=3, async_scheduling=True)
    assert outputs(overlapped, ps) == ref
    assert overlapped.scheduler.spec.drafted > 0


def assert_reported(e) -> None:
    """The worker's load report and the gateway's metrics carry the rebuilt states."""
    from mesh.metrics import LoadCollector
    from mesh.protocol import LoadReport
    from worker.base import speculative_counters

    counters = speculative_counters(e)
    assert counters["spec_rebuilt:eagle3"] == e.eagle3.rebuilt_tokens
    assert counters["spec_drafted:eagle3"] == e.scheduler.spec.drafted
    report = LoadReport(worker_id="w", model="tiny", role="decode", timestamp=0.0, counters=counters)
    got = {(m.name, tuple(s.labels.get(k, "") for k in ("method", "kind"))): s.value
           for m in LoadCollector(lambda: report).collect() for s in m.samples}
    assert got[("pdmesh_spec_tokens", ("eagle3", "rebuilt"))] == e.eagle3.rebuilt_tokens


def test_under_preemption(tiny_model, head):
    ps = prompts(6, seed=6)
    ref = outputs(engine(tiny_model, num_kv_blocks=30), ps, 30)
    e = engine(tiny_model, speculative=f"eagle3:{head}", num_speculative_tokens=3, num_kv_blocks=30)
    assert outputs(e, ps, 30) == ref
    assert e.scheduler.num_preemptions > 0
    assert e.scheduler.spec.drafted > 0


def test_a_batch_mixing_adapters(tiny_model, head, tmp_path):
    """Base-model and adapter rows in one batch, twice (the second time their prompts are cached,
    so every row's states are rebuilt, the adapter rows' with their adapter): token-identical; an
    adapter row's rebuilt states are the ones the adapted target computed (not the base model's)."""
    from tests.helpers.lora import ADAPTERS, make_adapter

    adapter = make_adapter(tiny_model, tmp_path / "all", 1, **ADAPTERS["all"])
    ps = prompts(4, seed=12)
    loras = [None, "all", None, "all"]
    gen = [greedy(8)] * len(ps)
    plain = engine(tiny_model, loras=(("all", str(adapter)),))
    ref = [s.output_token_ids for s in plain.generate(ps, gen, lora=loras)]
    e = engine(tiny_model, loras=(("all", str(adapter)),), speculative=f"eagle3:{head}", num_speculative_tokens=3)
    assert [s.output_token_ids for s in e.generate(ps, gen, lora=loras)] == ref
    assert e.eagle3.rebuilt_tokens == 0
    e.scheduler.spec_prior = AcceptancePrior()
    assert [s.output_token_ids for s in e.generate(ps, gen, lora=loras)] == ref
    # every cached prompt's states were rebuilt, the adapter rows' too (all but each last block)
    assert e.eagle3.rebuilt_tokens >= sum(len(p) - 4 for p in ps) and e.scheduler.spec.drafted > 0

    fresh = prompts(4, seed=99)[3]  # cached nowhere
    seqs = [e.new_sequence(fresh, greedy(2), lora=name) for name in ("all", None)]
    for seq in seqs:
        e.add(seq)
    e.step()  # both prompts computed here: their states captured, the adapter's with it
    adapted, base = (e.eagle3.kv.row(seq) for seq in seqs)
    assert adapted.start == base.start == 0
    n = len(seqs[0].token_ids) - 1
    assert not torch.allclose(adapted.states[:n], base.states[:n], atol=1e-3)  # the adapter matters
    torch.testing.assert_close(e.eagle3._rebuild(seqs[0], 0, n), adapted.states[:n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(e.eagle3._rebuild(seqs[1], 0, n), base.states[:n], rtol=1e-4, atol=1e-4)


def test_capture_costs_nothing_without_eagle3(tiny_model, head):
    plain = engine(tiny_model)
    assert plain.model.aux_layers == () and plain.eagle3 is None
    ngram = engine(tiny_model, speculative="ngram")
    outputs(ngram, prompts(2))
    assert ngram.model.aux_hidden is None
    e = engine(tiny_model, speculative=f"eagle3:{head}")
    assert e.model.aux_layers == tuple(AUX)


@pytest.mark.parametrize(("fields", "message"), [
    ({"target_hidden_size": 32}, r"reads target hidden states of size 32, the target's are 64"),
    ({"vocab_size": 1000}, r"has a vocabulary of 1000 tokens, the target 4096"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}}, r"reads layers \[5\] of a target with 2"),
    ({"architectures": ["LlamaForCausalLM"]}, r"is not an EAGLE-3 checkpoint"),
    ({"num_hidden_layers": 2}, r"has 2 layers; the published format \(one midlayer\)"),
])
def test_a_checkpoint_for_another_target_is_refused_in_one_line(tiny_model, tmp_path, fields, message):
    ckpt = make_eagle3_checkpoint(tiny_model, tmp_path / "bad", aux_layers=AUX, **fields)
    with pytest.raises(ValueError, match=message) as e:
        engine(tiny_model, speculative=f"eagle3:{ckpt}")
    assert "\n" not in str(e.value)


def test_a_missing_tensor_or_directory_is_refused_in_one_line(tiny_model, tmp_path, head):
    with pytest.raises(ValueError, match=r"EAGLE-3 checkpoint directory .*nowhere does not exist"):
        engine(tiny_model, speculative=f"eagle3:{tmp_path / 'nowhere'}")
    with pytest.raises(ValueError, match=r"needs the EAGLE-3 checkpoint's directory"):
        engine(tiny_model, speculative="eagle3")
    weights = load_file(str(head / "model.safetensors"))
    del weights["midlayer.hidden_norm.weight"]
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text((head / "config.json").read_text())
    from safetensors.torch import save_file

    save_file(weights, str(tmp_path / "partial" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"has no tensor midlayer.hidden_norm.weight"):
        engine(tiny_model, speculative=f"eagle3:{tmp_path / 'partial'}")


def test_the_cli_refuses_a_mismatched_checkpoint_in_one_line(tiny_model, tmp_path):
    ckpt = make_eagle3_checkpoint(tiny_model, tmp_path / "wide", aux_layers=AUX, target_hidden_size=128)
    r = subprocess.run([sys.executable, "-m", "cli", "generate", "--model", str(tiny_model), "--device", "cpu",
                        "--speculative", f"eagle3:{ckpt}", "hello"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "target hidden states of size 128, the target's are 64" in lines[0], r.stderr
