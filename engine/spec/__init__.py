"""Speculative decoding: drafters propose tokens, one forward pass of the target verifies them.

``drafter``: the ``Drafter`` protocol and the registry by name (``--speculative METHOD``);
``ngram``: prompt lookup; ``oracle``: the benchmark's drafter; ``verify``: which drafted tokens
a row accepts.
"""
