"""Hugging Face Hub ids as model names, as in vLLM: resolved through huggingface_hub's cache
(HF_HOME / HF_HUB_CACHE / --download-dir), at --revision, offline without touching the network,
with errors that say what to do; and the settings reaching every process that resolves the
model (`pdmesh serve`'s engines and router).

The Hub itself is out of reach here: each test builds a cache in huggingface_hub's layout
(tests/hub_cache.py) of tiny files, or serves a repo from a fake Hub on 127.0.0.1;
tests/engine/test_hub_id_tokenizers.py loads the real tokenizer so.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import huggingface_hub.constants
import pytest

from pdmesh.config import parse_config
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.model_store import (
    hub_cache_dir,
    model_dir_for,
    resolve_model,
    resolve_tokenizer,
    tokenizer_dir_for,
    tokenizer_source,
)
from pdmesh.router.config import RouterConfig
from pdmesh.serve import MeshConfig
from pdmesh.serve.child_config import (
    ENGINE_CONFIGS,
    child_config,
    engine_placement,
    router_placement,
)
from tests.hub_cache import commit_of, put_snapshot

pytestmark = pytest.mark.fast

REPO = "org/tiny-llama"
TINY = {"config.json": '{"model_type": "llama"}', "tokenizer.json": "{}",
        "generation_config.json": "{}", "model.safetensors": b"\0" * 8}
"""A model repo as `resolve_model` sees one (it checks the files, never loads them)."""


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME in tmp_path, offline, no other cache variable; returns its hub cache."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any outgoing connection fails the test (offline means not even trying)."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network touched: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield


def test_an_id_resolves_offline_from_the_cache(hf_home: Path, no_network: None) -> None:
    snapshot = put_snapshot(hf_home, REPO, commit_of("v1"), TINY)
    assert hub_cache_dir() == hf_home
    assert resolve_model(REPO) == snapshot
    # The tokenizer is the model's own unless --tokenizer says otherwise.
    config = EngineConfig(model=REPO)
    assert model_dir_for(config) == tokenizer_dir_for(config) == snapshot


def test_a_revision_picks_its_snapshot(hf_home: Path, no_network: None) -> None:
    main = put_snapshot(hf_home, REPO, commit_of("v1"), TINY)
    v2 = put_snapshot(hf_home, REPO, commit_of("v2"), TINY, refs=("v2",))
    assert resolve_model(REPO, revision="v2") == v2  # a tag or branch, through refs/
    assert resolve_model(REPO, revision=commit_of("v2")) == v2  # a commit
    assert resolve_model(REPO, revision="main") == resolve_model(REPO) == main
    config = EngineConfig(model=REPO, revision="v2")
    assert model_dir_for(config) == tokenizer_dir_for(config) == v2
    with pytest.raises(ValueError, match="v3") as info:
        resolve_model(REPO, revision="v3")
    assert "HF_HUB_OFFLINE" in str(info.value)


def test_download_dir_is_the_cache(tmp_path: Path, hf_home: Path, no_network: None) -> None:
    download_dir = tmp_path / "models"
    snapshot = put_snapshot(download_dir, REPO, commit_of("v1"), TINY)
    assert hub_cache_dir(str(download_dir)) == download_dir
    assert resolve_model(REPO, download_dir=str(download_dir)) == snapshot
    assert model_dir_for(EngineConfig(model=REPO, download_dir=str(download_dir))) == snapshot
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        resolve_model(REPO)  # HF_HOME's cache does not hold it


def test_hf_hub_cache_wins_over_hf_home(tmp_path: Path, hf_home: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    snapshot = put_snapshot(tmp_path / "hub-cache", REPO, commit_of("v1"), TINY)
    assert resolve_model(REPO) == snapshot


def test_a_missing_id_offline_says_so(hf_home: Path, no_network: None) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model("org/not-downloaded")
    message = str(info.value)
    assert "'org/not-downloaded'" in message and "HF_HUB_OFFLINE" in message, message
    assert str(hf_home) in message and "local directory" in message, message


def test_a_repo_without_safetensors_is_refused(hf_home: Path) -> None:
    files = {**TINY, "pytorch_model.bin": b"\0"}
    del files["model.safetensors"]
    put_snapshot(hf_home, REPO, commit_of("v1"), files)
    with pytest.raises(ValueError, match="pdmesh loads safetensors"):
        resolve_model(REPO)
    # Without weights it is still a tokenizer, and a config for --load-format dummy.
    assert resolve_tokenizer(REPO).name == commit_of("v1")
    assert resolve_model(REPO, "dummy").name == commit_of("v1")


def test_a_separate_tokenizer_needs_no_weights_or_config(hf_home: Path) -> None:
    model = put_snapshot(hf_home, REPO, commit_of("v1"), TINY)
    tok = put_snapshot(hf_home, "org/tok", commit_of("t1"), {"tokenizer.json": "{}"})
    config = EngineConfig(model=REPO, revision="main", tokenizer="org/tok")
    assert (model_dir_for(config), tokenizer_dir_for(config)) == (model, tok)


def test_names_that_are_no_id_keep_the_old_message(tmp_path: Path, hf_home: Path) -> None:
    with pytest.raises(ValueError, match="neither a known alias") as info:
        resolve_model(str(tmp_path / "no" / "such" / "model"))
    assert "Hub id" in str(info.value)


def test_an_unreachable_hub_says_so(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online, with the Hub's endpoint a local port that refuses connections (bound, not
    listening): the error says the Hub could not be reached and how to do without it."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT",
                            f"http://127.0.0.1:{closed.getsockname()[1]}")
        with pytest.raises(ValueError) as info:
            resolve_model("org/unreachable")
    message = str(info.value)
    assert "could not be reached" in message and "local directory" in message, message


def test_serve_hands_the_hub_settings_to_engines_and_router(tmp_path: Path) -> None:
    """`pdmesh serve ID --revision R --download-dir D --tokenizer T` (vLLM's flags, no longer
    refused) reaches every process that resolves the model."""
    mesh = parse_config(MeshConfig, [
        "--model", REPO, "--revision", "v2", "--download-dir", str(tmp_path),
        "--tokenizer", "org/tok", "--tokenizer-revision", "t2"], prog="serve", env={})
    redis = "redis://127.0.0.1:1/0"
    for kind in ("prefill", "decode"):
        engine = child_config(ENGINE_CONFIGS[kind], mesh,
                              engine_placement(kind, mesh, redis_url=redis)).engine
        assert (engine.model, engine.revision, engine.download_dir, engine.tokenizer,
                engine.tokenizer_revision) == (REPO, "v2", str(tmp_path), "org/tok", "t2")
    router = child_config(RouterConfig, mesh, router_placement(
        mesh, redis_url=redis, port=0, metrics_port=0, prefill=[], decode=["127.0.0.1:1"]))
    assert (router.model, router.revision, router.download_dir, router.tokenizer,
            router.tokenizer_revision) == (REPO, "v2", str(tmp_path), "org/tok", "t2")
    assert tokenizer_source(router) == tokenizer_source(engine) == ("org/tok", "t2")


def test_a_tokenizer_revision_picks_the_tokenizer_snapshot(hf_home: Path,
                                                           no_network: None) -> None:
    """vLLM's --tokenizer-revision: --tokenizer's revision, else the model repo's tokenizer
    at it (the model's weights stay at --revision)."""
    put_snapshot(hf_home, REPO, commit_of("v1"), TINY)
    v2 = put_snapshot(hf_home, REPO, commit_of("v2"), TINY, refs=("v2",))
    tok = put_snapshot(hf_home, "org/tok", commit_of("t1"), {"tokenizer.json": "{}"})
    tok2 = put_snapshot(hf_home, "org/tok", commit_of("t2"), {"tokenizer.json": "{}"},
                        refs=("t2",))
    assert tokenizer_dir_for(EngineConfig(model=REPO, tokenizer="org/tok")) == tok
    assert tokenizer_dir_for(EngineConfig(model=REPO, tokenizer="org/tok",
                                          tokenizer_revision="t2")) == tok2
    config = EngineConfig(model=REPO, tokenizer_revision="v2")
    assert (model_dir_for(config).name, tokenizer_dir_for(config)) == (commit_of("v1"), v2)
    assert tokenizer_dir_for(EngineConfig(model=REPO, revision="v2")) == v2  # the model's


class FakeHub(BaseHTTPRequestHandler):
    """The few Hub endpoints `snapshot_download` calls (repo info, tree, file HEAD/GET), for
    one repo at one commit, recording every request."""

    repo = "org/sharded"
    commit = commit_of("sharded")
    files: ClassVar[dict[str, bytes]] = {
        "config.json": b"{}", "tokenizer.json": b"{}", "README.md": b"#",
        "model.safetensors.index.json": json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
        }}).encode(),
        "model-00001-of-00002.safetensors": b"1", "model-00002-of-00002.safetensors": b"2",
        "consolidated.safetensors": b"12",  # the same weights in another layout
        "pytorch_model.bin": b"pickle", "original/model.safetensors": b"o",
    }
    requests: ClassVar[list[str]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self.answer(body=False)

    def do_GET(self) -> None:
        self.answer(body=True)

    def answer(self, body: bool) -> None:
        path = self.path.split("?")[0]
        FakeHub.requests.append(f"{self.command} {path}")
        api, resolve = f"/api/models/{self.repo}/", f"/{self.repo}/resolve/{self.commit}/"
        headers = {"Content-Type": "application/json"}
        if path.startswith(api + "revision/"):
            data = json.dumps({"id": self.repo, "sha": self.commit}).encode()
        elif path.startswith(api + "tree/"):
            data = json.dumps([{"type": "file", "path": name, "size": len(blob),
                                "oid": hashlib.sha1(blob).hexdigest()}
                               for name, blob in self.files.items()]).encode()
        elif path.startswith(resolve) and path[len(resolve):] in self.files:
            data = self.files[path[len(resolve):]]
            headers = {"X-Repo-Commit": self.commit,
                       "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
        else:
            data, headers = b"{}", {"X-Error-Code": "RepoNotFound"}
        self.send_response(200 if "X-Error-Code" not in headers else 404)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)


@pytest.fixture
def fake_hub(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeHub]]:
    """Online, with huggingface_hub pointed at a FakeHub on 127.0.0.1."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    FakeHub.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    try:
        yield FakeHub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_online_only_what_pdmesh_loads_is_downloaded(
    hf_home: Path, fake_hub: type[FakeHub], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Configs, tokenizer files and the safetensors the index names: no pickle, no second
    layout of the weights, nothing from subfolders; then offline, the same snapshot without a
    request."""
    snapshot = resolve_model(fake_hub.repo, revision="v2")
    assert snapshot == hf_home / "models--org--sharded" / "snapshots" / fake_hub.commit
    assert sorted(p.name for p in snapshot.iterdir()) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json"]
    assert f"GET /api/models/{fake_hub.repo}/revision/v2" in fake_hub.requests
    fake_hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(fake_hub.repo, revision="v2", download_dir=str(hf_home)) == snapshot
    assert fake_hub.requests == []
