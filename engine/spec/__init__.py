"""Speculative decoding: drafters propose tokens, one forward pass of the target verifies them.

``drafter``: the ``Drafter`` protocol, which rows draft, counters; ``registry``: drafters by name
(``--speculative METHOD``); ``ngram``: prompt lookup; ``oracle``: the benchmark's drafter;
``verify``: which drafted tokens a row accepts; ``adaptive``: how many tokens a row drafts next.
``engine.verification`` applies them to a step's drafting rows (grammar masks, penalties,
min_tokens and logprobs per drafted position).
"""
