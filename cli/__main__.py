"""``python -m cli``: the ``mesh`` command."""

from cli.main import entry

entry()
