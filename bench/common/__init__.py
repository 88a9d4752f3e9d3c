"""What every benchmark shares: its declaration and parser (``registry``), the result object it
ends with (``report``), the generated models (``models``), the load generators' HTTP client
(``sse_client``) and two simulated hosts (``netns_pair``)."""

from bench.common.registry import DRY_RUN_HELP, Benchmark, parse, parser
from bench.common.report import emit

__all__ = ["DRY_RUN_HELP", "Benchmark", "emit", "parse", "parser"]
