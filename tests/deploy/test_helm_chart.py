"""The Helm chart (helm/pdmesh), rendered by a real Helm engine and checked like a cluster would.

Helm is ``helm-python-sdk``: Helm v4's own Go code (chart loading, values coalescing,
values.schema.json, template rendering, lint) behind a C ABI, in-process and offline. Every
manifest of every variant is validated against the Kubernetes OpenAPI schemas of the oldest
and newest supported versions (``kubernetes-validate`` ships them), strict: an unknown field
fails. Then the wiring: the URL every process dials is the NATS Service, the planner may
touch exactly the two pool Deployments, GPUs appear where asked and nowhere else, every
command line is one the ``mesh`` CLI accepts, the NATS config is one nats-server accepts,
and the readiness probe script answers from a real registry.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from cli import build_parser
from mesh.natsperms import ROLES, chart_table, permissions
from mesh.natsserver import EmbeddedNats, find_binary, free_port

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdmesh"
RELEASE, NAMESPACE = "demo", "llm"
KUBE_VERSIONS = ("1.25", kubernetes_validate.utils.latest_version())
CRDS = {"ServiceMonitor", "PodMonitor"}  # not in the core schemas: checked by hand below

VARIANTS: dict[str, dict] = {
    "default": {},
    "gpu": {
        "image": {"tag": "0.1.0-cuda"},
        "model": {"source": "pvc", "path": "Llama-3.1-8B-Instruct", "servedName": "llama-8b",
                  "pvc": {"claimName": "models"}},
        "prefill": {"gpus": 1, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "decode": {"gpus": 2, "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "128Gi"}},
                   "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
                   "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                   "hostKvGb": 64, "deviceKvBlocks": 100000},
        "workers": {"dtype": "bfloat16"},
    },
    "external-nats": {"nats": {"external": {"url": "nats://nats.infra.svc:4222"}}, "mesh": {"namespace": "team-a"}},
    "single-nats": {"nats": {"replicas": 1}},
    "nats-no-auth": {"nats": {"auth": {"enabled": False}}},
    "secured": {
        "nats": {"tls": {"secretName": "nats-tls"}, "auth": {"existingSecret": "nats-passwords"}},
        "gateway": {"apiKeys": {"existingSecret": "api-keys", "key": "keys.txt", "maxConcurrent": 4, "rpm": 600,
                                "metricsAuth": True}},
        "model": {"servedName": "Qwen/Qwen2.5-7B"}, "mesh": {"namespace": "team-b", "jsReplicas": 5,
                                                                       "hashKey": {"existingSecret": "hash-key"}},
    },
    "external-creds": {"nats": {"external": {"url": "tls://n1.infra:4222,tls://n2.infra:4222", "credsSecret": "creds"},
                                "tls": {"secretName": "nats-ca"}}, "embed": {"replicas": 1}},
    "planner-off": {"planner": {"enabled": False}, "prefill": {"replicas": 2}, "decode": {"replicas": 3}},
    "everything": {
        "workers": {"mock": True}, "nats": {"replicas": 3, "jetstream": {"fileStore": {"enabled": False}}},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "otel": {"endpoint": "http://otel-collector.observability:4318", "resourceAttributes": "deployment.environment=prod"},
        "imagePullSecrets": [{"name": "regcred"}], "mesh": {"extraEnv": [{"name": "EXTRA", "value": "1"}]},
    },
    "aggregated-hostpath": {
        "prefill": {"enabled": False}, "planner": {"enabled": False},
        "model": {"source": "hostPath", "path": "qwen", "hostPath": {"path": "/data/models"}},
    },
    "embed": {
        "embed": {"replicas": 2, "pooling": "mean", "gpus": 1, "extraArgs": ["--device=cuda"]},
        "model": {"servedName": "qwen-embed"}, "nats": {"tls": {"secretName": "nats-tls"}},
        "metrics": {"serviceMonitor": {"enabled": True}}, "otel": {"endpoint": "http://otel:4318"},
    },
}


@cache
def render(variant: str) -> tuple[dict, ...]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(copy.deepcopy(VARIANTS[variant]), name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text)]
    return tuple(d for d in docs if d)


def find(docs, kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs, kind: str, name: str) -> dict:
    (doc,) = find(docs, kind, name)
    return doc


def component(name: str) -> str:
    return f"{RELEASE}-pdmesh-{name}"


def containers(doc: dict, init: bool = False) -> list[dict]:
    spec = doc["spec"]["template"]["spec"]
    return spec["containers"] + (spec.get("initContainers", []) if init else [])


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def pdmesh_containers(docs, init: bool = False) -> list[tuple[dict, dict]]:
    return [(d, c) for d in docs if d["kind"] in ("Deployment", "StatefulSet")
            for c in containers(d, init) if c.get("command") == ["mesh"]]


# -- the engine and the schemas ----------------------------------------------------------------


def test_helm_engine_is_real_helm():
    assert helm.helm_sdk_version().startswith("v4."), helm.helm_sdk_version()


@pytest.mark.parametrize("variant", VARIANTS)
def test_chart_lints_clean(variant):
    report = helm.lint(CHART, VARIANTS[variant], strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_manifest_is_valid_kubernetes(variant):
    docs = render(variant)
    assert docs
    for doc in docs:
        if doc["kind"] in CRDS:
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} on {version}: {e.message} at {list(e.path)}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_selectors_match_and_names_are_unique(variant):
    docs = render(variant)
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), keys
    workloads = find(docs, "Deployment") + find(docs, "StatefulSet")
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items(), w["metadata"]["name"]
    for svc in find(docs, "Service"):
        sel = svc["spec"]["selector"]
        matched = [w for w in workloads if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, (svc["metadata"]["name"], [m["metadata"]["name"] for m in matched])
        ports = {p["name"] for c in containers(matched[0]) for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, (svc["metadata"]["name"], port)


@pytest.mark.parametrize(("values", "error"), [
    ({"decode": {"gpu": 1}}, "additional properties 'gpu'"),
    ({"model": {"source": "s3"}}, "/model/source"),
    ({"model": {"source": "pvc"}}, "claimName"),
    ({"nats": {"replicas": 2}}, "/nats/replicas"),
    ({"nats": {"external": {"url": "http://nats:4222"}}}, "/nats/external/url"),
    ({"gateway": {"router": "fastest"}}, "/gateway/router"),
    ({"decode": {"resources": {"limits": {"memory": "lots"}}}}, "/decode/resources/limits/memory"),
    ({"workers": {"transports": "carrier-pigeon"}}, "/workers/transports"),
    ({"planner": {"minDecode": 0}}, "/planner/minDecode"),
    ({"embed": {"pooling": "max"}}, "/embed/pooling"),
    ({"embed": {"replicas": -1}}, "/embed/replicas"),
])
def test_schema_rejects_bad_values(values, error):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError) as e:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert error in str(e.value)


def test_default_values_match_the_schema():
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema({})
        defaults = chart.values
    assert yaml.safe_load((CHART / "values.yaml").read_text()) == defaults


def test_planner_without_a_prefill_pool_is_refused():
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError, match=r"needs prefill\.enabled"):
        chart.render({"prefill": {"enabled": False}}, name=RELEASE, namespace=NAMESPACE)


# -- NATS wiring -------------------------------------------------------------------------------------


def role_of(doc: dict) -> str:
    return doc["metadata"]["name"].removeprefix(f"{RELEASE}-pdmesh-")


def nats_user(doc: dict) -> str:
    """The NATS user a component joins as: its own, but an embed worker is a decode worker."""
    return {"embed": "decode"}.get(role_of(doc), role_of(doc))


def nats_values(variant: str) -> dict:
    return VARIANTS[variant].get("nats", {})


@pytest.mark.parametrize("variant", ["default", "gpu", "planner-off", "everything", "nats-no-auth", "secured", "embed"])
def test_every_process_dials_the_charts_nats_service_as_its_role(variant):
    docs = render(variant)
    svc = one(docs, "Service", component("nats"))
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "client")
    sts = one(docs, "StatefulSet", component("nats"))
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    auth = nats_values(variant).get("auth", {}).get("enabled", True)
    secret = nats_values(variant).get("auth", {}).get("existingSecret") or component("nats-auth")
    tls = bool(nats_values(variant).get("tls", {}).get("secretName"))
    roles = set()
    for d, c in pdmesh_containers(docs):
        role = nats_user(d)
        roles.add(role_of(d))
        url = urlsplit(env(c)["MESH_NATS_URL"])
        assert (url.scheme, url.hostname, url.port) == ("tls" if tls else "nats", svc["metadata"]["name"], port)
        if auth:  # its role's user; the password from the Secret, expanded by Kubernetes
            assert (url.username, url.password) == (role, "$(NATS_PASSWORD)")
            names = [e["name"] for e in c["env"]]
            assert names.index("NATS_PASSWORD") < names.index("MESH_NATS_URL")  # $(VAR) needs it first
            ref = next(e for e in c["env"] if e["name"] == "NATS_PASSWORD")["valueFrom"]["secretKeyRef"]
            assert ref == {"name": secret, "key": role}
        else:
            assert url.username is None and "NATS_PASSWORD" not in env(c)
        if tls:
            assert env(c)["MESH_NATS_TLS_CA"] == "/etc/pdmesh/nats-ca/ca.crt"
            assert {"name": "nats-ca", "mountPath": "/etc/pdmesh/nats-ca", "readOnly": True} in c["volumeMounts"]
            vol = next(v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "nats-ca")
            assert vol["secret"] == {"secretName": "nats-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert roles >= {"gateway", "decode", "prefill"}


def test_external_nats_deploys_no_nats_and_everyone_dials_it():
    docs = render("external-nats")
    assert not find(docs, "StatefulSet")
    assert not [d for d in docs if "nats" in d["metadata"]["name"]]
    pairs = pdmesh_containers(docs)
    assert {d["metadata"]["name"] for d, _ in pairs} == {component(n) for n in ("gateway", "prefill", "decode", "planner")}
    for _, c in pairs:
        assert env(c)["MESH_NATS_URL"] == "nats://nats.infra.svc:4222"
        assert env(c)["MESH_NS"] == "team-a"


def _nats_conf(docs) -> str:
    return one(docs, "ConfigMap", component("nats"))["data"]["nats.conf"]


PASSWORDS = {f"PDMESH_{role.upper()}_PASSWORD": f"pw-{role}-{i}" for i, role in enumerate((*ROLES, "route"))}


def nats_server_env(docs) -> dict[str, str]:
    """The NATS container's environment as Kubernetes gives it: Secret keys from ``PASSWORDS``,
    ``$(VAR)`` expanded from the variables before it."""
    (nats,) = containers(one(docs, "StatefulSet", component("nats")))
    out: dict[str, str] = {}
    for e in nats["env"]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            out[e["name"]] = PASSWORDS[f"PDMESH_{ref['key'].upper()}_PASSWORD"]
        elif "value" in e:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out[m.group(1)], e["value"])
    return out


@pytest.mark.parametrize("variant", ["default", "everything", "single-nats", "nats-no-auth", "secured"])
def test_nats_config_is_accepted_by_nats_server(variant, tmp_path):
    text = _nats_conf(render(variant))
    if "/etc/nats-tls/" in text:  # the Secret's files, as a cert-manager Certificate would give
        import trustme

        ca = trustme.CA()
        cert = ca.issue_cert(component("nats"))
        cert.cert_chain_pems[0].write_to_path(tmp_path / "tls.crt")
        cert.private_key_pem.write_to_path(tmp_path / "tls.key")
        ca.cert_pem.write_to_path(tmp_path / "ca.crt")
        text = text.replace("/etc/nats-tls/", f"{tmp_path}/")
    conf = tmp_path / "nats.conf"
    conf.write_text(text)
    r = subprocess.run([find_binary(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30,
                       env={**os.environ, **nats_server_env(render(variant)), "SERVER_NAME": f"{component('nats')}-0"})
    assert r.returncode == 0, r.stdout + r.stderr


def test_nats_has_jetstream_and_a_route_per_replica():
    single = _nats_conf(render("single-nats"))
    assert "jetstream {" in single and "cluster {" not in single
    sts = one(render("single-nats"), "StatefulSet", component("nats"))
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["data"]
    for variant in ("default", "everything"):  # the chart's default is a 3-node JetStream cluster
        clustered = _nats_conf(render(variant))
        # each route logs in with the routes' password, which only the environment holds
        names = [line.strip() for line in clustered.splitlines() if line.strip().startswith("$PDMESH_ROUTE_")]
        assert names == [f"$PDMESH_ROUTE_{i}" for i in range(3)] and "pw-route" not in clustered
        routes = [nats_server_env(render(variant))[n[1:]] for n in names]
        headless = component("nats-headless")
        assert routes == [f"nats://route:pw-route-4@{component('nats')}-{i}.{headless}:6222" for i in range(3)]
        sts = one(render(variant), "StatefulSet", component("nats"))
        assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == headless
    assert "volumeClaimTemplates" not in one(render("everything"), "StatefulSet", component("nats"))["spec"]


@pytest.mark.parametrize(("variant", "replicas"), [("default", "3"), ("single-nats", "1"), ("external-nats", "1"),
                                                   ("secured", "5")])
def test_jetstream_replicas_follow_the_nats_cluster(variant, replicas):
    for _, c in pdmesh_containers(render(variant)):
        assert env(c)["MESH_JS_REPLICAS"] == replicas
        assert env(c)["MESH_NATS_CONNECT_TIMEOUT"] == "120"  # NATS may still be starting at install


def _users(conf: str) -> dict[str, tuple[str, dict]]:
    """user -> (password variable, permissions) of the rendered authorization block."""
    found = re.findall(r"\{user: (\w+), password: \$(\w+), permissions: (\{.*\})\}$", conf, re.M)
    return {user: (var, json.loads(perms)) for user, var, perms in found}


@pytest.mark.parametrize(("variant", "ns", "model"), [("default", "mesh", "tiny"), ("everything", "mesh", "mock"),
                                                      ("secured", "team-b", "Qwen/Qwen2.5-7B")])
def test_nats_users_have_exactly_their_roles_permissions(variant, ns, model):
    docs = render(variant)
    users = _users(_nats_conf(docs))
    assert set(users) == set(ROLES)
    for role, (var, perms) in users.items():
        assert perms == permissions(role, ns, [model]).to_dict(), role
        assert var == f"PDMESH_{role.upper()}_PASSWORD"
    secret = nats_values(variant).get("auth", {}).get("existingSecret") or component("nats-auth")
    (nats,) = containers(one(docs, "StatefulSet", component("nats")))
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in nats["env"] if "valueFrom" in e and
            "secretKeyRef" in e["valueFrom"]}
    assert refs == {f"PDMESH_{r.upper()}_PASSWORD": {"name": secret, "key": r} for r in (*ROLES, "route")}
    created = find(docs, "Secret", component("nats-auth"))
    if secret == component("nats-auth"):  # the chart's own: five random passwords (the routes' too)
        (doc,) = created
        assert set(doc["data"]) == {*ROLES, "route"} and len(set(doc["data"].values())) == 5
        assert doc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    else:
        assert not created
    assert "authorization" not in _nats_conf(render("nats-no-auth")) and not find(render("nats-no-auth"), "Secret")


def test_chart_permission_table_is_mesh_natsperms():
    # regenerate with: python -m mesh.natsperms > helm/pdmesh/files/nats-permissions.json
    assert json.loads((CHART / "files" / "nats-permissions.json").read_text()) == chart_table()


async def test_rendered_nats_users_on_a_real_server(tmp_path):
    """The chart's NATS config, run: each role logs in with its password and only its subjects."""
    conf = _nats_conf(render("single-nats"))
    port, http = free_port(), free_port()
    conf = (conf.replace("store_dir: /data", f'store_dir: "{tmp_path / "js"}"')
            .replace("pid_file: /var/run/nats/nats.pid", f'pid_file: "{tmp_path / "nats.pid"}"')
            .replace("port: 4222", f"port: {port}").replace("http_port: 8222", f"http_port: {http}"))
    (tmp_path / "nats.conf").write_text(conf)
    proc = subprocess.Popen([find_binary(), "-a", "127.0.0.1", "-c", str(tmp_path / "nats.conf")],  # noqa: ASYNC220
                            env={**os.environ, "SERVER_NAME": "n0", **PASSWORDS},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def url(role: str) -> str:
            return f"nats://{role}:{PASSWORDS[f'PDMESH_{role.upper()}_PASSWORD']}@127.0.0.1:{port}"

        from mesh.bus import Bus
        from mesh.natsauth import NatsConfig, NatsError
        from mesh.registry import open_bucket

        buses = {}
        for role in ROLES:  # each joins (JetStream answers), the workers can open the registry
            buses[role] = await Bus.connect(url(role), role, config=NatsConfig.build(url(role), role=role))
        await open_bucket(buses["decode"])
        with pytest.raises(NatsError, match="refused our credentials"):
            wrong = url("gateway").replace("pw-", "nope-")
            await Bus.connect(wrong, "x", config=NatsConfig.build(wrong, role="gateway", connect_timeout=2))
        errors = []

        async def on_error(e):
            errors.append(str(e).lower())

        decode = buses["decode"].nc
        decode._error_cb = on_error
        await decode.publish("mesh.tiny.decode.w.generate", b"forged")
        await decode.flush()
        for _ in range(50):
            if errors:
                break
            await asyncio.sleep(0.05)
        assert any('permissions violation for publish to "mesh.tiny.decode.w.generate"' in e for e in errors), errors
        # the readiness probe joins as the worker does (its user and inbox) and reads the registry
        script = tmp_path / "worker_ready.py"
        script.write_text((CHART / "files" / "worker_ready.py").read_text())
        r = await asyncio.to_thread(_probe, script, url("decode"), "nobody")
        assert r.returncode == 1 and "not in the registry" in r.stderr, r.stderr
        for bus in buses.values():
            await bus.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_network_policy_opens_routes_to_nats_pods_and_clients_to_the_release():
    docs = render("default")
    nats_pods = {"app.kubernetes.io/name": "pdmesh", "app.kubernetes.io/instance": RELEASE,
                 "app.kubernetes.io/component": "nats"}
    policy = one(docs, "NetworkPolicy", component("nats"))
    assert policy["spec"]["podSelector"] == {"matchLabels": nats_pods}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = {r["ports"][0]["port"]: r["from"] for r in policy["spec"]["ingress"]}
    assert all(len(r["ports"]) == 1 for r in policy["spec"]["ingress"])
    assert rules == {6222: [{"podSelector": {"matchLabels": nats_pods}}],
                     4222: [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pdmesh",
                                                             "app.kubernetes.io/instance": RELEASE}}}]}
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(policy, version, strict=True)
    # every pod that dials NATS carries the labels the client rule selects
    for doc, _ in pdmesh_containers(docs):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "pdmesh" and labels["app.kubernetes.io/instance"] == RELEASE
    # monitoring stays on the pods: no Service exposes 8222
    for svc in find(docs, "Service"):
        assert 8222 not in [p["port"] for p in svc["spec"]["ports"]], svc["metadata"]["name"]
    assert not find(render("external-nats"), "NetworkPolicy")
    with helm.Chart.load(CHART) as chart:
        off = chart.render({"nats": {"networkPolicy": {"enabled": False}}}, name=RELEASE, namespace=NAMESPACE,
                           is_install=True)
    assert "NetworkPolicy" not in "".join(off.values())


async def test_a_nats_server_without_the_route_password_cannot_join_the_cluster(tmp_path):
    """The chart's clustered NATS config, run by real nats-servers: two with the routes' password
    form a cluster; a third in the same slot with another password is refused by both (and
    refuses them); with the password it joins."""
    import httpx

    conf = _nats_conf(render("default"))
    cport = {i: free_port() for i in range(3)}

    def start(i: int, password: str) -> tuple[subprocess.Popen, int]:
        port, http = free_port(), free_port()
        d = tmp_path / f"n{i}-{password}"
        d.mkdir()
        text = (conf.replace("store_dir: /data", f'store_dir: "{d / "js"}"')
                .replace("pid_file: /var/run/nats/nats.pid", f'pid_file: "{d / "nats.pid"}"')
                .replace("http_port: 8222", f"http_port: {http}").replace("port: 4222", f"port: {port}")
                .replace("port: 6222", f"port: {cport[i]}"))
        (d / "nats.conf").write_text(text)
        env = {**os.environ, **PASSWORDS, "SERVER_NAME": f"n{i}", "PDMESH_ROUTE_PASSWORD": password,
               **{f"PDMESH_ROUTE_{j}": f"nats://route:{password}@127.0.0.1:{cport[j]}" for j in range(3)}}
        proc = subprocess.Popen([find_binary(), "-a", "127.0.0.1", "-c", str(d / "nats.conf")], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return proc, http

    async def peers(http: int) -> set[str]:
        async with httpx.AsyncClient(timeout=2) as client:
            try:
                routes = (await client.get(f"http://127.0.0.1:{http}/routez")).json().get("routes") or []
            except httpx.HTTPError:
                return set()
        return {r.get("remote_name", "") for r in routes}

    async def wait(cond, what: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await cond():
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}")

    right = PASSWORDS["PDMESH_ROUTE_PASSWORD"]
    procs = []
    try:
        (n0, h0), (n1, h1) = start(0, right), start(1, right)
        procs += [n0, n1]
        await wait(lambda: _has(peers(h0), {"n1"}), "n0 and n1 to form a cluster")
        intruder, hx = start(2, "not-the-route-password")
        procs.append(intruder)
        await asyncio.sleep(3)  # several route attempts each way
        assert "n2" not in await peers(h0) and "n2" not in await peers(h1)
        assert await peers(hx) == set()
        intruder.terminate()
        intruder.wait(10)
        member, h2 = start(2, right)
        procs.append(member)
        await wait(lambda: _has(peers(h2), {"n0", "n1"}), "n2 to join with the password")
        assert "n2" in await peers(h0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)


async def _has(found, want: set[str]) -> bool:
    return want <= await found


def test_gateway_takes_its_api_keys_from_a_secret():
    c = containers(one(render("secured"), "Deployment", component("gateway")))[0]
    for flag in ("--api-key-file=/etc/pdmesh/api-keys/keys.txt", "--api-key-max-concurrent=4", "--api-key-rpm=600",
                 "--metrics-auth"):
        assert flag in c["args"]
    # a directory mount, not subPath: Kubernetes updates the file when the Secret changes
    assert {"name": "api-keys", "mountPath": "/etc/pdmesh/api-keys", "readOnly": True} in c["volumeMounts"]
    spec = one(render("secured"), "Deployment", component("gateway"))["spec"]["template"]["spec"]
    assert {"name": "api-keys", "secret": {"secretName": "api-keys"}} in spec["volumes"]
    c = containers(one(render("default"), "Deployment", component("gateway")))[0]
    assert not [a for a in c["args"] if a.startswith("--api-key")]
    # no admin key and no --insecure-admin: the chart's admin routes (LoRA loading) are closed
    for variant in VARIANTS:
        c = containers(one(render(variant), "Deployment", component("gateway")))[0]
        assert "--insecure-admin" not in c["args"] and not [a for a in c["args"] if a.startswith("--admin-api-key")]
        assert "MESH_ADMIN_API_KEYS" not in env(c)


def test_the_block_hash_secret_reaches_the_gateway_and_workers_only():
    ref = {"name": "MESH_HASH_KEY", "valueFrom": {"secretKeyRef": {"name": "hash-key", "key": "hash-key"}}}
    docs = render("secured")
    for name in ("gateway", "prefill", "decode"):
        assert ref in containers(one(docs, "Deployment", component(name)))[0]["env"]
    assert "MESH_HASH_KEY" not in env(containers(one(docs, "Deployment", component("planner")))[0])
    assert not [c for _, c in pdmesh_containers(render("default")) if "MESH_HASH_KEY" in env(c)]


def test_worker_metrics_listen_on_the_pod_ip():
    for pool in ("prefill", "decode"):
        c = containers(one(render("default"), "Deployment", component(pool)))[0]
        assert "--metrics-host=$(POD_IP)" in c["args"]
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]


def test_external_nats_with_a_creds_file_per_role():
    docs = render("external-creds")
    assert not find(docs, "StatefulSet") and not find(docs, "Secret")
    assert find(docs, "Deployment", component("embed"))
    for d, c in pdmesh_containers(docs):
        role = nats_user(d)
        e = env(c)
        assert e["MESH_NATS_URL"] == "tls://n1.infra:4222,tls://n2.infra:4222" and "NATS_PASSWORD" not in e
        assert e["MESH_NATS_CREDS"] == f"/etc/pdmesh/nats-creds/{role}.creds"
        assert e["MESH_NATS_TLS_CA"] == "/etc/pdmesh/nats-ca/ca.crt"
        assert {"name": "nats-creds", "mountPath": "/etc/pdmesh/nats-creds", "readOnly": True} in c["volumeMounts"]
        vols = d["spec"]["template"]["spec"]["volumes"]
        assert {"name": "nats-creds", "secret": {"secretName": "creds"}} in vols


# -- the planner's permissions -----------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["default", "gpu", "external-nats", "everything", "embed"])
def test_planner_may_get_and_patch_exactly_the_pool_scales(variant):
    docs = render(variant)
    pools = {component("prefill"), component("decode")}
    assert {d["metadata"]["name"] for d in find(docs, "Deployment")} >= pools
    (role,) = find(docs, "Role")
    (rule,) = role["rules"]
    assert rule == {"apiGroups": ["apps"], "resources": ["deployments/scale"],
                    "resourceNames": sorted(pools, reverse=True), "verbs": ["get", "patch"]}
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    binding = one(docs, "RoleBinding", component("planner"))
    sa = one(docs, "ServiceAccount", component("planner"))
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}]
    planner = one(docs, "Deployment", component("planner"))
    spec = planner["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == sa["metadata"]["name"] and spec["automountServiceAccountToken"] is True
    args = containers(planner)[0]["args"]
    assert f"--prefill-deployment={component('prefill')}" in args
    assert f"--decode-deployment={component('decode')}" in args
    assert f"--k8s-namespace={NAMESPACE}" in args and "--connector=kubernetes" in args
    # nobody else gets an API token
    others = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and d is not planner]
    assert all(d["spec"]["template"]["spec"]["automountServiceAccountToken"] is False for d in others)


def test_planner_owns_the_pool_sizes_and_off_means_fixed_pools():
    on = render("default")
    for pool in ("prefill", "decode"):
        assert "replicas" not in one(on, "Deployment", component(pool))["spec"]  # an upgrade must not reset them
    off = render("planner-off")
    assert not find(off, "Role") and not find(off, "ServiceAccount")
    assert not find(off, "Deployment", component("planner"))
    assert one(off, "Deployment", component("prefill"))["spec"]["replicas"] == 2
    assert one(off, "Deployment", component("decode"))["spec"]["replicas"] == 3


def test_planner_plans_the_served_model():
    args = containers(one(render("gpu"), "Deployment", component("planner")))[0]["args"]
    assert "--model-name=llama-8b" in args
    args = containers(one(render("everything"), "Deployment", component("planner")))[0]["args"]
    assert "--model-name=mock" in args


# -- GPUs, scheduling, the model ---------------------------------------------------------------------


def _limits(doc) -> dict:
    return containers(doc)[0]["resources"].get("limits", {})


def test_gpu_limits_appear_when_asked_and_only_there():
    docs = render("gpu")
    decode, prefill = one(docs, "Deployment", component("decode")), one(docs, "Deployment", component("prefill"))
    assert _limits(decode) == {"nvidia.com/gpu": 2, "memory": "128Gi"}
    assert _limits(prefill)["nvidia.com/gpu"] == 1
    assert containers(decode)[0]["resources"]["requests"] == {"cpu": "8", "memory": "64Gi"}
    for pool in (decode, prefill):
        spec = pool["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
        assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert "--transports=nccl,nixl,nats" in containers(pool)[0]["args"]
        assert containers(pool)[0]["image"] == "pdmesh:0.1.0-cuda"
    for name in ("gateway", "planner"):
        assert "nvidia.com/gpu" not in _limits(one(docs, "Deployment", component(name)))
    for variant in ("default", "planner-off", "everything"):
        for d, c in pdmesh_containers(render(variant), init=True):
            assert "nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}), d["metadata"]["name"]
            assert "--transports=nccl,nats" not in c.get("args", [])


def test_decode_flags_follow_the_values():
    args = containers(one(render("gpu"), "Deployment", component("decode")))[0]["args"]
    for flag in ("--host-kv-gb=64", "--device-kv-blocks=100000", "--dtype=bfloat16", "--served-name=llama-8b",
                 "--disagg-threshold=512"):
        assert flag in args
    # without a prefill pool a decode worker never tries to disaggregate
    args = containers(one(render("aggregated-hostpath"), "Deployment", component("decode")))[0]["args"]
    assert "--disagg-threshold=1000000000" in args
    assert not find(render("aggregated-hostpath"), "Deployment", component("prefill"))


def test_an_embed_pool_is_a_fixed_pool_of_decode_workers_with_task_embed():
    from cli.worker import role_of as cli_role

    assert not [d for v in VARIANTS if v != "embed" and "embed" not in VARIANTS[v]
                for d in find(render(v), "Deployment", component("embed"))]  # none unless asked
    docs = render("embed")
    d = one(docs, "Deployment", component("embed"))
    assert d["spec"]["replicas"] == 2  # the planner is on, but sizes only prefill and decode
    c = containers(d)[0]
    args = [a.replace("$(POD_NAME)", "embed-0") for a in c["args"]]
    assert cli_role(build_parser().parse_args(args)) == "embed"
    assert args[:2] == ["worker", "decode"] and "--task=embed" in args and "--pooling=mean" in args
    assert "--served-name=qwen-embed" in args and args[-1] == "--device=cuda"
    assert not [a for a in args if a.startswith(("--transports", "--block-size", "--disagg", "--prefill"))]
    assert "UCX_TLS" not in env(c)  # no KV moves between embed workers
    assert env(c)["OTEL_SERVICE_NAME"] == "pdmesh-embed" and env(c)["MESH_MODEL"] == "/models/tiny"
    assert c["readinessProbe"]["exec"]["command"][-1] == "decode"  # the probe joins NATS as the worker does
    assert _limits(d)["nvidia.com/gpu"] == 1
    (pm,) = find(docs, "PodMonitor")
    assert "embed" in pm["spec"]["selector"]["matchExpressions"][0]["values"]
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError, match=r"embed workers do not run on the mocker"):
        chart.render({"embed": {"replicas": 1}, "workers": {"mock": True}}, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize(("variant", "volume", "model_dir"), [
    ("default", {"emptyDir": {"sizeLimit": "1Gi"}}, "/models/tiny"),
    ("gpu", {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}, "/models/Llama-3.1-8B-Instruct"),
    ("aggregated-hostpath", {"hostPath": {"path": "/data/models", "type": "Directory"}}, "/models/qwen"),
])
def test_model_volume_reaches_every_process_that_reads_the_model(variant, volume, model_dir):
    docs = render(variant)
    readers = [d for d in find(docs, "Deployment") if d["metadata"]["name"] != component("planner")]
    for d in readers:
        spec = d["spec"]["template"]["spec"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "model"]
        assert {k: v for k, v in vol.items() if k != "name"} == volume
        c = containers(d)[0]
        assert env(c)["MESH_MODEL"] == model_dir
        assert {"name": "model", "mountPath": "/models", "readOnly": variant != "default"} in c["volumeMounts"]
        init = spec.get("initContainers", [])
        if variant == "default":  # the tiny model is written before the process starts
            assert init[0]["args"] == ["model", "tiny", model_dir]
        else:
            assert not init
    assert "MESH_MODEL" not in env(containers(one(docs, "Deployment", component("planner")))[0]) if \
        find(docs, "Deployment", component("planner")) else True


def test_mocker_release_mounts_no_model():
    for d, c in pdmesh_containers(render("everything"), init=True):
        assert "MESH_MODEL" not in env(c)
        assert "model" not in {m["name"] for m in c.get("volumeMounts", [])}
        if d["metadata"]["name"] in (component("prefill"), component("decode")):
            assert "--mock" in c["args"]


# -- what runs in the containers -------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_command_line_is_one_the_cli_accepts(variant):
    parser = build_parser()
    seen = set()
    for d, c in pdmesh_containers(render(variant), init=True):
        # Kubernetes expands $(VAR) from the container's env before the process starts
        args = [a.replace("$(POD_NAME)", f"{d['metadata']['name']}-abc12") for a in c["args"]]
        try:
            parsed = parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{d['metadata']['name']}/{c['name']}: mesh {' '.join(args)} is not a valid command")
        seen.add(parsed.cmd)
        if "--worker-id=$(POD_NAME)" in c["args"]:
            assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]
    assert {"gateway", "worker"} <= seen


def test_workers_are_ready_when_their_card_is_and_drain_in_time():
    docs = render("default")
    probe_map = one(docs, "ConfigMap", component("probe"))
    script = probe_map["data"]["worker_ready.py"]
    assert script == (CHART / "files" / "worker_ready.py").read_text()
    for pool in ("prefill", "decode"):
        d = one(docs, "Deployment", component(pool))
        spec = d["spec"]["template"]["spec"]
        c = containers(d)[0]
        assert c["readinessProbe"]["exec"]["command"] == ["python", "/etc/pdmesh/probe/worker_ready.py", pool]
        assert {"name": "probe", "mountPath": "/etc/pdmesh/probe", "readOnly": True} in c["volumeMounts"]
        assert {"name": "probe", "configMap": {"name": probe_map["metadata"]["name"]}} in spec["volumes"]
        assert "--worker-id=$(POD_NAME)" in c["args"]
        assert spec["terminationGracePeriodSeconds"] > 30  # the worker's own drain timeout
    gateway = containers(one(docs, "Deployment", component("gateway")))[0]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}


def test_otel_wiring_per_role():
    endpoint = VARIANTS["everything"]["otel"]["endpoint"]
    for d, c in pdmesh_containers(render("everything")):
        e = env(c)
        role = d["metadata"]["name"].removeprefix(f"{RELEASE}-pdmesh-")
        assert e["OTEL_SERVICE_NAME"] == f"pdmesh-{role}"
        assert e["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint and e["OTEL_TRACES_EXPORTER"] == "otlp"
        assert e["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
        assert e["OTEL_RESOURCE_ATTRIBUTES"].endswith(",deployment.environment=prod")
        assert e["EXTRA"] == "1"
    for _, c in pdmesh_containers(render("default")):
        e = env(c)
        assert e["OTEL_TRACES_EXPORTER"] == "none" and "OTEL_EXPORTER_OTLP_ENDPOINT" not in e


def test_monitors_scrape_the_gateway_and_every_worker():
    docs = render("everything")
    (sm,) = find(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    svc = one(docs, "Service", component("gateway"))
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}]
    assert {p["name"] for p in svc["spec"]["ports"]} == {"http"}
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (pm,) = find(docs, "PodMonitor")
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    selected = []
    for d in find(docs, "Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        sel = pm["spec"]["selector"]
        if sel["matchLabels"].items() <= labels.items() and all(
                labels.get(e["key"]) in e["values"] for e in sel["matchExpressions"]):
            selected.append(d["metadata"]["name"])
            c = containers(d)[0]
            (port,) = [p for p in c["ports"] if p["name"] == "metrics"]
            assert f"--metrics-port={port['containerPort']}" in c["args"]
    assert sorted(selected) == sorted([component("decode"), component("prefill")])
    assert not find(render("default"), "ServiceMonitor") and not find(render("default"), "PodMonitor")


def test_scrape_annotations_name_the_metrics_ports():
    docs = render("default")
    for name, port in (("gateway", "8000"), ("prefill", "9090"), ("decode", "9090")):
        ann = one(docs, "Deployment", component(name))["spec"]["template"]["metadata"]["annotations"]
        assert (ann["prometheus.io/scrape"], ann["prometheus.io/port"], ann["prometheus.io/path"]) == \
            ("true", port, "/metrics")


def test_image_user_matches_the_pod_security_context():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "USER 10001:10001" in dockerfile
    for d, _ in pdmesh_containers(render("default")):
        sc = d["spec"]["template"]["spec"]["securityContext"]
        assert sc["runAsUser"] == 10001 and sc["runAsNonRoot"] is True


# -- the readiness probe against a real registry ----------------------------------------------------------


def _probe(script: Path, url: str, pod: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), "decode"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "MESH_NATS_URL": url, "MESH_NS": "mesh", "POD_NAME": pod})


async def test_probe_script_reads_the_registry(tmp_path):
    from mesh.bus import Bus
    from mesh.protocol import WorkerCard
    from mesh.registry import CardPublisher

    script = tmp_path / "worker_ready.py"
    script.write_text(one(render("default"), "ConfigMap", component("probe"))["data"]["worker_ready.py"])
    pod = f"{component('decode')}-7d9f-abcde"
    status = "ready"

    def card() -> WorkerCard:
        now = time.time()
        return WorkerCard(pod, "decode", "tiny", 16, 64, 1024, "h", 1, now, now, status=status)

    async def probe(url: str, who: str = pod) -> subprocess.CompletedProcess:
        return await asyncio.to_thread(_probe, script, url, who)

    with EmbeddedNats() as server:
        bus = await Bus.connect(server.url, "probe-test")
        try:
            assert (await probe(server.url)).returncode == 1  # no registry yet
            cards = CardPublisher(bus, card)
            await cards.start()
            r = await probe(server.url)
            assert r.returncode == 0, r.stderr
            assert (await probe(server.url, "someone-else")).returncode == 1
            status = "draining"
            await cards.put()
            r = await probe(server.url)
            assert r.returncode == 1 and "draining" in r.stderr
            await cards.stop()  # a clean exit deletes the card
            assert (await probe(server.url)).returncode == 1
        finally:
            await bus.close()
        url = server.url
    assert (await probe(url)).returncode == 2  # NATS gone


def test_workers_use_nixl_between_pods_with_the_ucx_environment():
    for variant in ("default", "gpu"):
        for role in ("decode", "prefill"):
            c = containers(one(render(variant), "Deployment", component(role)))[0]
            want = "--transports=nccl,nixl,nats" if variant == "gpu" else "--transports=nixl,nats"
            assert want in c["args"], c["args"]
            assert {"name": "UCX_TLS", "value": "tcp"} in c["env"]
    with helm.Chart.load(CHART) as chart:  # nixl off: nats between pods, no UCX environment
        out = chart.render({"workers": {"nixl": {"enabled": False}}}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = [d for p, t in out.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d]
    c = containers(one(docs, "Deployment", component("decode")))[0]
    assert "--transports=nats" in c["args"] and not any(e["name"] == "UCX_TLS" for e in c["env"])
