"""``--speculative mtp`` (issue 49): DeepSeek-V3's multi-token-prediction layer drafts from the
target's hidden states. Its drafts match the layer run as vLLM runs it, with transformers' own
DeepSeek-V3 decoder layer as its block and transformers' hidden states as the target's (also
after verifications that accepted some drafts and rejected others); greedy outputs are
token-identical to decoding without speculation (a batch, prefix-cache hits whose states are
rebuilt, preemption, FP8 weights), with the drafted tokens counted and reported; a checkpoint
without an MTP layer is refused in one line, in the engine and by the CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.sampling import SamplingParams

MTP = "model.layers.3."  # the tiny DeepSeek's MTP layer: after its 3 decoder layers


def engine(model, **kw):
    from engine.config import EngineConfig
    from engine.engine import Engine

    kw.setdefault("num_kv_blocks", 64)
    return Engine(EngineConfig(model, device="cpu", block_size=4, max_num_seqs=8, **kw))


def mtp_engine(model, k: int = 2, **kw):
    """A random MTP layer's drafts are almost never accepted: a fixed K keeps every row drafting."""
    return engine(model, speculative="mtp", num_speculative_tokens=k, spec_adaptive=False, **kw)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompts(count: int = 3, seed: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 4096) for _ in range(5 + 3 * i)] for i in range(count)]


def outputs(e, ps, n: int = 8) -> list[list[int]]:
    return [s.output_token_ids for s in e.generate(ps, [greedy(n - i) for i in range(len(ps))])]


# -- the layer as vLLM runs it, over transformers' states and decoder layer -----------------------

def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Reference:
    """transformers' DeepSeek-V3 with the MTP layer's decoder block as a fourth layer (its own
    tensors, ``model.layers.3.*``, as transformers loads a layer), run as three layers for the
    target's states."""

    def __init__(self, path):
        import transformers as tf

        self.hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                          num_hidden_layers=4).eval()
        self.hf.config.num_hidden_layers = 3  # the target: its three layers
        self.block = self.hf.model.layers[3]
        w = load_file(str(path / "model.safetensors"))
        self.own = {name[len(MTP):]: w[name] for name in w if name.startswith(MTP)}
        self.eps = self.hf.config.rms_norm_eps

    def states(self, tokens: list[int]) -> torch.Tensor:
        """The target's hidden states after its final norm, every position of ``tokens``."""
        with torch.no_grad():
            return self.hf.model(torch.tensor([tokens])).last_hidden_state[0]

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """Position i takes the token at i + 1 (its embedding zeroed at position 0) with the
        target's state at i; each drafted token then goes in at the next position with the layer's
        output before ``shared_head.norm``; logits from the model's own ``lm_head``."""
        w, eps, hf = self.own, self.eps, self.hf
        n = len(tokens)
        ids, hidden = list(tokens[1:]), self.states(tokens)[: n - 1]
        drafts = []
        with torch.no_grad():
            for _ in range(k):
                pos = torch.arange(len(ids))
                e = hf.model.embed_tokens(torch.tensor(ids))
                e[pos == 0] = 0
                x = torch.cat([rms(e, w["enorm.weight"], eps), rms(hidden, w["hnorm.weight"], eps)], -1) @ w[
                    "eh_proj.weight"].T
                mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
                out = self.block(x[None], attention_mask=mask, position_ids=pos[None],
                                 position_embeddings=hf.model.rotary_emb(x[None], pos[None]))[0]
                best = int(hf.lm_head(rms(out[-1], w["shared_head.norm.weight"], eps)).argmax())
                drafts.append(best)
                ids.append(best)
                hidden = torch.cat([hidden, out[-1:]])
        return drafts


@pytest.fixture(scope="module", params=["deepseek", "deepseek-yarn"])
def reference(request, deepseek_models):
    path = deepseek_models[request.param]
    return path, Reference(path)


def test_the_layer_drafts_as_the_reference(reference):
    path, ref = reference
    e = mtp_engine(path, k=4)
    seq = e.new_sequence(prompts(1, seed=9)[0] * 2, greedy(8))
    e.add(seq)
    e.step()  # the prompt: its states are captured
    tokens = seq.token_ids
    drafter = e.mtp
    row = drafter.kv.row(seq)
    states = ref.states(tokens)
    assert row.start == 0 and len(row.states) == len(tokens) - 1
    torch.testing.assert_close(row.states, states[: len(tokens) - 1], rtol=1e-4, atol=1e-4)
    # the states of tokens the target did not compute here, rebuilt from its KV, are the same
    torch.testing.assert_close(drafter._rebuild(seq, 0, len(tokens) - 1), row.states, rtol=1e-4, atol=1e-4)
    want = ref.drafts(tokens, 4)
    assert len(set(want)) > 1
    assert drafter.propose(seq, 4) == want
    assert drafter.propose(seq, 4) == want  # again, from the layer's KV it kept


class Mixed:
    """Runs the MTP drafter as the engine would (its KV kept, recomputed past rejections), but
    proposes the oracle's drafts (the target's own tokens, some corrupted): steps that accept
    some drafts and reject others, which a random layer's drafts never give."""

    def __init__(self, mtp, oracle):
        self.mtp, self.oracle, self.name = mtp, oracle, "mtp"

    def propose(self, seq, k):
        self.mtp.propose(seq, k)
        return self.oracle.propose(seq, k)


def test_after_verifications_that_accepted_some_drafts(deepseek_models):
    from engine.spec.oracle import OracleDrafter

    path = deepseek_models["deepseek"]
    ref = Reference(path)
    ps = prompts(2, seed=11)
    want = outputs(engine(path), ps, 12)
    e = mtp_engine(path, k=3)
    e.scheduler.drafter = Mixed(e.mtp, OracleDrafter({tuple(p): r for p, r in zip(ps, want, strict=True)}, 0.6,
                                                     e.vocab_size))
    seqs = e.generate(ps, [greedy(12 - i) for i in range(len(ps))])
    assert [s.output_token_ids for s in seqs] == want
    c = e.scheduler.spec
    assert 0 < c.accepted < c.drafted, c
    for seq in seqs:  # the states kept, and the layer's KV, are those of the tokens finally there
        tokens = seq.token_ids
        row = e.mtp.kv.row(seq)
        torch.testing.assert_close(row.states[: len(tokens) - 1 - row.start],
                                   ref.states(tokens)[row.start: len(tokens) - 1], rtol=1e-4, atol=1e-4)
        assert e.mtp.propose(seq, 3) == ref.drafts(tokens, 3)


# -- greedy outputs are the target's -------------------------------------------------------------

def test_greedy_outputs_are_token_identical_and_counted(deepseek_models):
    path = deepseek_models["deepseek"]
    ps, alone = prompts(), prompts(1, seed=21)
    plain = engine(path)
    ref, ref_alone = outputs(plain, ps), outputs(plain, alone, 6)
    e = mtp_engine(path)
    assert outputs(e, alone, 6) == ref_alone  # a batch of one
    assert outputs(e, ps) == ref  # and of several
    c = e.scheduler.spec
    assert c.drafted > 0 and c.steps > 0, c
    assert e.mtp.rebuilt_tokens == 0  # every token was computed here
    # the same prompts again: their blocks are cached, the target computes only the last token of
    # each prompt, and the layer's states for the cached ones are rebuilt
    drafted = c.drafted
    assert outputs(e, ps) == ref
    assert c.drafted > drafted
    assert e.mtp.rebuilt_tokens > 0
    assert_reported(e)


def assert_reported(e) -> None:
    """The worker's load report and the gateway's metrics carry the drafted, accepted and rebuilt
    tokens, and the acceptance rate, under the method ``mtp``."""
    from mesh.metrics import LoadCollector
    from mesh.protocol import LoadReport
    from worker.base import speculative_counters

    c = e.scheduler.spec
    counters = speculative_counters(e)
    assert counters["spec_drafted:mtp"] == c.drafted > 0
    assert counters["spec_accepted:mtp"] == c.accepted
    assert counters["spec_rebuilt:mtp"] == e.mtp.rebuilt_tokens
    report = LoadReport(worker_id="w", model="tiny", role="decode", timestamp=0.0, counters=counters)
    got = {(m.name, s.labels.get("method"), s.labels.get("kind", "")): s.value
           for m in LoadCollector(lambda: report).collect() for s in m.samples}
    assert got[("pdmesh_spec_tokens", "mtp", "drafted")] == c.drafted
    assert got[("pdmesh_spec_acceptance_rate", "mtp", "")] == pytest.approx(c.acceptance_rate)


def test_under_preemption(deepseek_models):
    path = deepseek_models["deepseek"]
    ps = prompts(3, seed=6)
    ref = outputs(engine(path, num_kv_blocks=12), ps, 12)
    e = mtp_engine(path, num_kv_blocks=12)
    assert outputs(e, ps, 12) == ref
    assert e.scheduler.num_preemptions > 0
    assert e.scheduler.spec.drafted > 0


def test_fp8_weights_and_overlapped_scheduling(deepseek_models):
    """The MTP layer of an FP8 checkpoint loads as the model's do (dequantized on CPU); a step may
    launch before the last one's tokens reached the host."""
    path = deepseek_models["deepseek-fp8"]
    ps = prompts(2, seed=8)
    ref = outputs(engine(path), ps, 8)
    e = mtp_engine(path, async_scheduling=True)
    assert outputs(e, ps, 8) == ref
    assert e.scheduler.spec.drafted > 0


# -- refused in one line -------------------------------------------------------------------------

def without_mtp(src, dst, config: dict | None = None, drop_weights: bool = False):
    """A copy of ``src`` with ``config`` changes, and (``drop_weights``) its MTP tensors dropped."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name == "model.safetensors" and drop_weights:
            w = load_file(str(f))
            save_file({k: v for k, v in w.items() if not k.startswith(MTP)}, str(dst / f.name))
        elif f.name == "config.json":
            f2 = json.loads(f.read_text())
            (dst / f.name).write_text(json.dumps({**f2, **(config or {})}))
        else:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_checkpoint_without_an_mtp_layer_is_refused_in_one_line(tiny_model, deepseek_models, tmp_path):
    ds = deepseek_models["deepseek"]
    cases = [
        (tiny_model, "mtp", r"is a llama checkpoint, which has none"),
        (without_mtp(ds, tmp_path / "zero", {"num_nextn_predict_layers": 0}), "mtp",
         r"needs a multi-token-prediction layer: .* has none \(num_nextn_predict_layers 0\)"),
        (without_mtp(ds, tmp_path / "stripped", drop_weights=True), "mtp",
         r"declares num_nextn_predict_layers 1 but has no weights for its MTP layer \(model.layers.3.eh_proj"),
        (ds, "mtp:2", r"--speculative mtp takes no argument"),
    ]
    for model, method, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            engine(model, speculative=method)
        assert "\n" not in str(e.value)


def test_the_cli_refuses_it_in_one_line(tiny_model):
    """``mesh generate``, and the flags every model worker reads (``mesh worker decode``, ``mesh up``)."""
    import argparse

    from engine.flags import add_args, from_args

    r = subprocess.run([sys.executable, "-m", "cli", "generate", "--model", str(tiny_model), "--device", "cpu",
                        "--speculative", "mtp", "hello"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "is a llama checkpoint, which has none" in lines[0], r.stderr
    p = argparse.ArgumentParser()
    add_args(p)
    with pytest.raises(ValueError, match="is a llama checkpoint, which has none"):
        from_args(p.parse_args(["--model", str(tiny_model), "--speculative", "mtp"]))


def test_the_mocker_simulates_it():
    """A mock worker with ``--speculative mtp`` drafts as with any method (``mocker.spec``)."""
    from mocker.engine import MockConfig, MockEngine

    e = MockEngine(MockConfig(speedup=1e9, num_blocks=64, speculative="mtp", spec_acceptance=0.5))
    e.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert e.scheduler.drafter.name == "mtp" and e.scheduler.spec.drafted > 0
