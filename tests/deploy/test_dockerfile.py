"""The Dockerfile, checked without docker: it copies everything the package build reads (and
.dockerignore does not hide it), installs the torch CI tests against, has both variants, and
runs as the user the Helm chart expects."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
IGNORED = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
           if line.strip() and not line.startswith("#")]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def copied() -> list[str]:
    return [src for m in re.finditer(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE, re.M) for src in m.group(1).split()]


def ignored(path: str) -> bool:
    return any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") or path == p for p in IGNORED)


def test_every_package_and_build_input_is_copied():
    packages = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
    sources = copied()
    for pkg in packages:
        assert pkg in sources, f"the package {pkg} is not copied into the image"
    for needed in ("pyproject.toml", PYPROJECT["project"]["readme"]):
        assert needed in sources


def test_copied_paths_exist_and_are_not_ignored():
    for src in copied():
        assert (ROOT / src).exists(), src
        assert not ignored(src), f"{src} is copied but .dockerignore excludes it"


def test_torch_is_the_version_ci_tests():
    (ci_torch,) = set(re.findall(r"torch==([\d.]+)", (ROOT / ".ci" / "run").read_text()))
    assert f"ARG TORCH_VERSION={ci_torch}" in DOCKERFILE
    assert 'pip install "torch==${TORCH_VERSION}"' in DOCKERFILE


def test_both_variants_and_the_entrypoint():
    assert "ARG VARIANT=cpu" in DOCKERFILE and "FROM base-${VARIANT} AS runtime" in DOCKERFILE
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", DOCKERFILE, re.M))
    assert {"base-cpu", "base-cuda", "runtime"} <= stages
    for variant in DOCKERFILE.split("AS base-")[1:3]:  # cpu, cuda: every default extra exists
        extras = re.search(r'PDMESH_EXTRAS_DEFAULT="([\w,]*)"', variant).group(1)
        assert set(filter(None, extras.split(","))) <= set(PYPROJECT["project"]["optional-dependencies"])
    assert PYPROJECT["project"]["scripts"]["mesh"] == "cli:entry"
    assert 'ENTRYPOINT ["mesh"]' in DOCKERFILE
    assert re.search(r"^USER 10001:10001$", DOCKERFILE, re.M)  # the chart's runAsUser
