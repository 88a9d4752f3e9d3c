"""Drafters by name: ``--speculative METHOD`` (``name`` or ``name:ARG``) makes one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.spec.drafter import Drafter
from engine.spec.ngram import NgramDrafter


@dataclass(frozen=True)
class SpecConfig:
    """``--speculative METHOD`` and ``--num-speculative-tokens K``."""

    method: str
    num_tokens: int = 4

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got {self.num_tokens}")
        name = self.method.partition(":")[0]
        if name not in DRAFTERS:
            raise ValueError(f"unknown speculative method {self.method!r} (choose from {', '.join(sorted(DRAFTERS))})")


DRAFTERS: dict[str, Callable[[str], Drafter]] = {}  # method name -> factory of its argument ("draft:DIR" -> "DIR")


def register(name: str, factory: Callable[[str], Drafter]) -> None:
    DRAFTERS[name] = factory


def create_drafter(method: str) -> Drafter:
    """The drafter of ``--speculative METHOD`` (``name`` or ``name:ARG``)."""
    name, _, arg = method.partition(":")
    factory = DRAFTERS.get(name)
    if factory is None:
        raise ValueError(f"unknown speculative method {method!r} (choose from {', '.join(sorted(DRAFTERS))})")
    return factory(arg)


def _runs_a_model(name: str) -> Callable[[str], Drafter]:
    def refuse(arg: str) -> Drafter:
        raise ValueError(f"--speculative {name} runs a model: a model worker's engine makes it "
                         "(engine.draft_model, engine.eagle3_drafter, engine.mtp_drafter), not a torch-free core")
    return refuse


register("ngram", NgramDrafter.from_arg)
# named here so that flags are checked in one place
register("draft", _runs_a_model("draft"))
register("eagle3", _runs_a_model("eagle3"))
register("mtp", _runs_a_model("mtp"))  # DeepSeek-V3's multi-token-prediction layer
