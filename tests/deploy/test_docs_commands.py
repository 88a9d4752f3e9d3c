"""Every shell command in README.md and docs/quickstart.md is exercised by a test or by .ci/run.

``COVERAGE`` maps a command pattern to what runs it: ``.ci/run`` (the command must appear
there), a ``tests/...::test_name`` that must exist, or a test of this module, which runs the
quickstart's external-NATS section literally (ports and model paths substituted) and its
curl and Python snippets against that mesh. A new command in those documents that matches no
pattern fails here: add it to a test, then to ``COVERAGE``. Every ``mesh`` command must also
parse with the real CLI. The ``helm install`` commands of docs/operations.md are rendered with
the real chart.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import helm_python as helm
import httpx
import pytest

from cli import build_parser
from mesh.natsserver import find_binary, free_port
from tests.helpers.cluster import wait_http_ok

ROOT = Path(__file__).resolve().parents[2]
DOCS = {name: ROOT / name for name in ("README.md", "docs/quickstart.md")}
THIS = "tests/deploy/test_docs_commands.py"
LIVE = f"{THIS}::test_quickstart_external_nats_section_runs_as_written"

COVERAGE: list[tuple[str, str]] = [
    (r"python3 -m venv \.venv", ".ci/run"),
    (r"\. \.venv/bin/activate", ".ci/run"),
    (r"pip install (-q )?torch==2\.13\.0", ".ci/run"),
    (r"pip install (-q )?-e '\.\[dev(,nixl)?\]'", ".ci/run"),
    (r"python -m pytest( -q)?", ".ci/run"),
    (r"mesh model tiny \S+", "tests/e2e/test_cli.py::test_model_tiny_is_deterministic"),
    (r"mesh generate --model \S+ .+", "tests/e2e/test_cli.py::test_generate_json_matches_the_engine"),
    (r"mesh up", "tests/e2e/test_up.py::test_mesh_up_answers_and_stops_cleanly_on_ctrl_c"),
    (r"mesh up --mock( --(decode|prefill) \d+)*", "tests/e2e/test_up.py::test_mesh_up_mock_serves_the_mocker_and_stops_cleanly_on_sigterm"),
    (r"mesh up --model \S+", LIVE),  # the same command with --nats, below
    (r"curl -s (http://127\.0\.0\.1|localhost):8000/v1/.*", LIVE),
    (r"nats-server -js -p 4222", LIVE),
    (r"mesh up --nats nats://127\.0\.0\.1:4222 --model \S+", LIVE),
    (r"mesh (worker decode|worker prefill|gateway|planner) --nats nats://127\.0\.0\.1:4222( .*)?", LIVE),
    (r"python examples/custom_worker\.py --nats \S+ --tokenizer \S+",
     "tests/integration/test_custom_worker.py::test_completion_follows_the_rules"),
]


def fenced_blocks(text: str, languages=("bash", "sh", "shell", "console")) -> list[str]:
    return [m.group(2) for m in re.finditer(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", text, re.S | re.M)
            if m.group(1) in languages]


def commands(block: str) -> list[str]:
    """Each command of a shell block: continuations joined, ``&&`` chains split, comments dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ")
        if not line or line.startswith("#"):
            continue
        out += [c.strip() for c in line.split("&&") if c.strip()]
    return out


def documented_commands() -> list[tuple[str, str]]:
    return [(name, c) for name, path in DOCS.items() for b in fenced_blocks(path.read_text()) for c in commands(b)]


def section(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def covering(cmd: str) -> str | None:
    return next((ref for pattern, ref in COVERAGE if re.fullmatch(pattern, cmd)), None)


def _normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace(" -q ", " "))


def test_every_documented_command_is_exercised():
    cmds = documented_commands()
    assert len(cmds) >= 15, cmds
    ci = _normalized((ROOT / ".ci" / "run").read_text())
    uncovered = []
    for doc, cmd in cmds:
        ref = covering(cmd)
        if ref is None:
            uncovered.append(f"{doc}: {cmd}")
        elif ref == ".ci/run":
            assert _normalized(f" {cmd} ").strip() in ci, f"{doc}: {cmd!r} is not what .ci/run runs"
        else:
            path, name = ref.split("::")
            tree = ast.parse((ROOT / path).read_text())
            names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            assert name in names, f"{doc}: {cmd!r} is said to be run by {ref}, which does not exist"
    assert not uncovered, "commands no test runs:\n" + "\n".join(uncovered)


def test_every_documented_mesh_command_parses():
    parser = build_parser()
    for doc, cmd in documented_commands():
        argv = shlex.split(cmd)
        if argv[0] != "mesh":
            continue
        try:
            parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{doc}: `{cmd}` is not a valid mesh command")


def test_python_snippets_compile():
    for path in DOCS.values():
        for block in fenced_blocks(path.read_text(), ("python",)):
            compile(block, str(path), "exec")


def test_operations_helm_commands_render():
    text = (ROOT / "docs" / "operations.md").read_text()
    installs = [c for b in fenced_blocks(text) for c in commands(b) if c.startswith("helm install ")]
    assert len(installs) >= 2
    releases = {}
    for cmd in installs:
        argv = shlex.split(cmd)
        assert argv[3] == "helm/pdmesh", cmd
        values: dict = {}
        for i, a in enumerate(argv):
            if a == "--set":
                values = _merge(values, helm.parse_set_string(argv[i + 1]))
        with helm.Chart.load(ROOT / "helm" / "pdmesh") as chart:
            out = chart.render(values, name=argv[2], namespace="default")
        releases[argv[2]] = "\n".join(out.values())
    for c in [c for b in fenced_blocks(text) for c in commands(b) if c.startswith("kubectl port-forward ")]:
        service = shlex.split(c)[2].removeprefix("service/")
        assert any(f"kind: Service\nmetadata:\n  name: {service}\n" in r for r in releases.values()), c


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# -- the quickstart's external-NATS section, as written ----------------------------------------------


class Runner:
    """Runs documented commands with this machine's ports and the test model substituted."""

    def __init__(self, tmp: Path, model: Path):
        self.nats_port, self.http_port = free_port(), free_port()
        self.model = model
        self.tmp = tmp
        self.ran: set[str] = set()
        self.procs: list[subprocess.Popen] = []

    def argv(self, cmd: str) -> list[str]:
        self.ran.add(cmd)
        cmd = (cmd.replace("nats://127.0.0.1:4222", f"nats://127.0.0.1:{self.nats_port}")
               .replace("-p 4222", f"-p {self.nats_port}")
               .replace("127.0.0.1:8000", f"127.0.0.1:{self.http_port}").replace("--port 8000", f"--port {self.http_port}")
               .replace("localhost:8000", f"127.0.0.1:{self.http_port}")
               .replace("/path/to/Qwen2.5-0.5B-Instruct", str(self.model)).replace("models/tiny", str(self.model)))
        argv = shlex.split(cmd)
        head = {"mesh": [sys.executable, "-m", "cli"], "nats-server": [find_binary()],
                "python": [sys.executable]}.get(argv[0], [argv[0]])
        return head + argv[1:]

    def start(self, cmd: str, *extra: str, **kw) -> subprocess.Popen:
        proc = subprocess.Popen([*self.argv(cmd), *extra], cwd=self.tmp, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                                **{"stdout": subprocess.DEVNULL, **kw})
        self.procs.append(proc)
        return proc

    def stop(self, procs=None, sig=signal.SIGTERM) -> list[int | None]:
        procs = self.procs if procs is None else procs
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(30))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes


def test_quickstart_external_nats_section_runs_as_written(tmp_path, tiny_model):
    text = DOCS["docs/quickstart.md"].read_text()
    external = [commands(b) for b in fenced_blocks(section(text, "## 3. An external NATS"))]
    (start_nats,), (mesh_up,), roles = external
    curls = [c for b in fenced_blocks(section(text, "## 1. One machine")) for c in commands(b) if c.startswith("curl")]
    curls += [c for _, c in documented_commands() if c.startswith("curl") and c not in curls]  # README's too
    # the section's Python snippets run as one script, in order (the tools call uses the first's client)
    snippet = "\n".join(fenced_blocks(section(text, "## 1. One machine"), ("python",)))
    run = Runner(tmp_path, tiny_model)
    nats = run.start(start_nats, "-sd", str(tmp_path / "js"), stderr=subprocess.DEVNULL)
    try:
        # the roles one by one
        started = [run.start(c) for c in roles]
        wait_http_ok(f"http://127.0.0.1:{run.http_port}/health", 120)
        for c in curls:
            r = subprocess.run(run.argv(c), capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            body = json.loads(r.stdout)
            assert "error" not in body, (c, body)
            assert body["data"][0]["id"] == "tiny" if c.endswith("/v1/models") else body["usage"]["completion_tokens"] > 0
        script = tmp_path / "snippet.py"
        script.write_text(snippet.replace("127.0.0.1:8000", f"127.0.0.1:{run.http_port}"))
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "completion_tokens" in r.stdout and "get_weather" in r.stdout, r.stderr
        # clean exits (uvicorn re-raises the SIGTERM it handled: -15 is the gateway's clean exit)
        assert set(run.stop(started)) <= {0, -signal.SIGTERM}

        # mesh up on the same NATS; it must leave the NATS it did not start running
        up = run.start(mesh_up, "--port", str(run.http_port), stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        line = ""
        while "pdmesh is up" not in line and time.monotonic() < deadline and up.poll() is None:
            line = up.stdout.readline()
        assert "pdmesh is up" in line and f"NATS nats://127.0.0.1:{run.nats_port}" in line, line
        models = httpx.get(f"http://127.0.0.1:{run.http_port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert run.stop([up], signal.SIGINT) == [0]
        assert nats.poll() is None
    finally:
        run.stop()
    assert run.ran >= {start_nats, mesh_up, *roles, *curls}
