"""Constrained decoding: JSON schemas, regexes and grammars enforced token by token.

``spec`` (the ``Constraint`` a request carries; no heavy imports), ``backend``
(the grammar engine behind a Protocol: llguidance, xgrammar), ``cache``
(compiled grammars), ``state`` (one sequence's matcher), ``masks`` (one step's
bitmask, filled while the model runs), ``manager`` (the engine's entry point).
"""

from mesh.constraints.spec import Constraint, ConstraintError, ConstraintKind

__all__ = ["Constraint", "ConstraintError", "ConstraintKind"]
