"""KV moves worker to worker: what a P/D request moves when its decode instance already holds a
prefix, and what the two serving processes spend on KV bytes (issue "KV moves worker to worker").

Starts a real mesh (`LocalMesh`: redis-server, 1 prefill, 1 decode, router; local prefill off,
so every prompt's KV moves; `--kv-backend shm|tcp`), then:

* the decode instance is warmed with the first --held-tokens of the prompt (rounded down to whole
  16-token blocks), by a Decode call straight to it (it prefills them itself and caches them);
* row "decode holds H tokens": the whole --prompt-tokens prompt through the router (greedy,
  4 tokens), checked to be served P/D (prefill instance != decode instance), no KV fallback;
* row "decode holds nothing": a prompt of the same length that shares no block with anything
  cached (the same token stream shifted by one token), the same way;
* row "idle": nothing sent, for as long as the first row's window and with as many snapshots:
  the serving processes' background CPU (router load polls, heartbeats, this script's own
  GetLoad calls and metric scrapes), the floor the other rows are read against.

Per row: blocks pulled / reused (the decode's `pdmesh:kv_blocks_loaded_total{source}`), bytes
moved (the decode's GetLoad `kv_bytes_received` delta), the whole prompt's KV for comparison
(blocks x layers x 2 x 16 x kv_heads x head_dim x itemsize, from the model's config.json; float32
on CPU: 737,280 bytes per block for SmolLM2-135M), the prefill's `kv_bytes_sent` delta (the
export it published), the router's TTFT and KV-transfer time, and the user+system CPU seconds
in the window of the prefill and decode serving processes and, separately, of their engine-core
processes (`pdmesh.engine.core.core_process`, the only code that touches KV bytes).

Provenance rule: run it on a quiet machine (nothing else running: the CPU columns are small
numbers); the numbers go to bench/README.md with the date, the commit and the machine, which
the script prints above its table.

    .venv/bin/python bench/kv_handoff.py [--prompt-tokens 3000] [--held-tokens 2000] \\
        [--kv-backend shm] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdmesh.serve import Child, LocalMesh

BLOCK = 16
MAX_TOKENS = 4
CPU_KEYS = ("prefill_svc", "decode_svc", "prefill_core", "decode_core")
TEXT = ("The harbour town woke early: fishermen checked their nets, bakers pulled the first "
        "loaves from stone ovens, and the ferry to the mainland sounded its horn twice before "
        "leaving the pier. Children ran along the sea wall while the old lighthouse keeper "
        "wrote the morning's weather into a logbook that had filled forty winters. ")


@dataclass
class Snapshot:
    pulled: float
    reused: float
    fallbacks: float
    received: int
    received_n: int
    sent: int
    sent_n: int
    cpu: dict[str, float]
    at: float


@dataclass
class Row:
    label: str
    held_tokens: int
    prompt_tokens: int
    blocks_pulled: int
    blocks_reused: int
    bytes_moved: int
    prompt_kv_bytes: int
    prefill_bytes_sent: int
    ttft_ms: float
    kv_transfer_ms: float
    wall_s: float
    cpu_s: dict[str, float]
    polls: int


def metric_sums(child: Child) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(child.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdmesh:kv_blocks_loaded_total":
                key = s.labels.get("source", "")
                out[key] = out.get(key, 0.0) + s.value
            elif s.name == "pdmesh:kv_load_fallbacks_total":
                out["fallbacks"] = out.get("fallbacks", 0.0) + s.value
    return out


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(serving process, its engine core(s)) user+system CPU seconds."""
    import psutil

    proc = psutil.Process(pid)
    own = proc.cpu_times()
    core, found = 0.0, False
    for child in proc.children():
        try:
            if "pdmesh.engine.core.core_process" in " ".join(child.cmdline()):
                times = child.cpu_times()
                core, found = core + times.user + times.system, True
        except psutil.NoSuchProcess:  # a short-lived helper (grammar sandbox) that just ended
            continue
    if not found:
        raise RuntimeError(f"no engine-core child under pid {pid}")
    return own.user + own.system, core


class Probe:
    def __init__(self, mesh: LocalMesh, timeout_s: float) -> None:
        import grpc

        from pdmesh.v1 import engine_pb2_grpc, router_pb2_grpc

        self.mesh, self.timeout_s = mesh, timeout_s
        self.prefill, self.decode = mesh.prefill[0], mesh.decode[0]
        assert self.prefill.address and self.decode.address
        self.channels = [grpc.insecure_channel(a) for a in
                         (mesh.router_address, self.prefill.address, self.decode.address)]
        self.router = router_pb2_grpc.RouterStub(self.channels[0])
        self.prefill_stub = engine_pb2_grpc.PrefillStub(self.channels[1])
        self.decode_stub = engine_pb2_grpc.DecodeStub(self.channels[2])

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def snapshot(self) -> Snapshot:
        from pdmesh.v1 import engine_pb2

        m = metric_sums(self.decode)
        dl = self.decode_stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
        pl = self.prefill_stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
        (ps, pc), (ds, dc) = cpu_seconds(self.prefill.pid), cpu_seconds(self.decode.pid)
        return Snapshot(m.get("pulled", 0.0), m.get("reused", 0.0), m.get("fallbacks", 0.0),
                        dl.kv_bytes_received, dl.kv_transfers_received, pl.kv_bytes_sent,
                        pl.kv_transfers_sent, dict(zip(CPU_KEYS, (ps, ds, pc, dc), strict=True)),
                        time.monotonic())

    def wait_routable(self) -> None:
        from pdmesh.v1 import router_pb2

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = self.router.GetStatus(router_pb2.GetStatusRequest(), timeout=5)
            if sum(i.healthy for i in status.instances) >= 2:
                return
            time.sleep(0.2)
        raise RuntimeError("prefill and decode not both routable within 60 s")

    def warm_decode(self, ids: list[int]) -> None:
        from pdmesh.v1 import common_pb2, engine_pb2

        request = engine_pb2.DecodeRequest(request_id=f"warm-{time.time_ns()}",
                                           prompt_token_ids=ids, sampling=common_pb2.
                                           SamplingParams(temperature=0.0, max_tokens=1))
        replies = list(self.decode_stub.Decode(request, timeout=self.timeout_s))
        if not any(r.HasField("result") for r in replies):
            raise RuntimeError("the warm-up Decode call ended without a result")

    def generate(self, ids: list[int]) -> Any:
        from pdmesh.v1 import common_pb2, router_pb2

        request = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        replies = list(self.router.Generate(request, timeout=self.timeout_s))
        result = next(r.result for r in replies if r.HasField("result"))
        if result.served_by.prefill_instance_id == result.served_by.decode_instance_id:
            raise RuntimeError(f"not served P/D: {result.served_by}")
        return result

    def settle(self, before: Snapshot) -> tuple[Snapshot, int]:
        """Once the transfer's ack reached both sides' counters (bounded); and the snapshots
        it took (each costs the serving processes a GetLoad and a scrape: `idle` repeats them)."""
        deadline, polls = time.monotonic() + 30, 0
        while True:
            now, polls = self.snapshot(), polls + 1
            done = now.received_n > before.received_n and now.sent_n > before.sent_n
            if done or time.monotonic() > deadline:
                return now, polls
            time.sleep(0.05)

    def measure(self, label: str, ids: list[int], held: int, block_bytes: int) -> Row:
        before = self.snapshot()
        result = self.generate(ids)
        after, polls = self.settle(before)
        if after.fallbacks != before.fallbacks:
            raise RuntimeError(f"{label}: the KV pull failed and the decode recomputed")
        return Row(label, held, len(ids), round(after.pulled - before.pulled),
                   round(after.reused - before.reused), after.received - before.received,
                   -(-len(ids) // BLOCK) * block_bytes, after.sent - before.sent,
                   result.timing.ttft_ms, result.timing.kv_transfer_ms, after.at - before.at,
                   {k: after.cpu[k] - before.cpu[k] for k in CPU_KEYS}, polls)

    def idle(self, wall_s: float, polls: int) -> Row:
        before = self.snapshot()
        time.sleep(max(0.0, wall_s - 0.05 * polls))
        for _ in range(polls - 1):
            self.snapshot()
            time.sleep(0.05)
        after = self.snapshot()
        return Row("idle (same wall time)", 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, after.at - before.at,
                   {k: after.cpu[k] - before.cpu[k] for k in CPU_KEYS}, polls)


def git_revision() -> str:
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--held-tokens", type=int, default=2000,
                    help="prompt tokens the decode instance holds (rounded down to blocks)")
    ap.add_argument("--kv-backend", choices=("shm", "tcp"), default="shm")
    ap.add_argument("--kv-cache-memory", default="512MiB", help="KV budget per engine")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="bound of each request")
    ap.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = ap.parse_args()
    held = (args.held_tokens // BLOCK) * BLOCK
    if not 0 < held < args.prompt_tokens:
        ap.error("--held-tokens must hold at least one block and be below --prompt-tokens")

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from pdmesh.engine.config import EngineConfig
    from pdmesh.engine.model_store import resolve_model
    from pdmesh.serve import LocalMesh, MeshConfig

    model_dir = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    piece = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    stream = tokenizer(TEXT * (args.prompt_tokens // len(piece) + 3),
                       add_special_tokens=False)["input_ids"]
    held_prompt, other = stream[: args.prompt_tokens], stream[1: args.prompt_tokens + 1]
    hf = AutoConfig.from_pretrained(model_dir)
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    itemsize = 2 if torch.cuda.is_available() else 4  # the engine's dtype "auto"
    block_bytes = hf.num_hidden_layers * 2 * BLOCK * kv_heads * head_dim * itemsize

    config = MeshConfig(model="smollm2", num_prefill=1, num_decode=1,
                        kv_cache_memory=args.kv_cache_memory, local_prefill_threshold=0,
                        kv_backend=args.kv_backend, port=-1,
                        engine=EngineConfig(max_model_len=max(4096,
                                                              args.prompt_tokens + MAX_TOKENS)))
    mesh = LocalMesh(config, router_args=["--poll-interval-s", "0.2"])
    probe: Probe | None = None
    try:
        mesh.start()
        probe = Probe(mesh, args.timeout_s)
        probe.wait_routable()
        probe.generate(stream[2:66])  # first P/D request: connections, maps; not measured
        probe.warm_decode(held_prompt[:held])
        rows = [probe.measure(f"decode holds {held} tokens", held_prompt, held, block_bytes),
                probe.measure("decode holds nothing", other, 0, block_bytes)]
        rows.append(probe.idle(rows[0].wall_s, rows[0].polls))
    finally:
        if probe is not None:
            probe.close()
        mesh.stop()

    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{when}, commit {git_revision()}, {platform.machine()}, torch {torch.__version__}, "
          f"kv-backend {args.kv_backend}, {block_bytes:,} bytes per KV block")
    print("\n| row | prompt | pulled | reused | bytes moved | prompt KV bytes | "
          "prefill sent | TTFT ms | KV ms | CPU s prefill svc | decode svc | prefill core | "
          "decode core |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        cpu = " | ".join(f"{r.cpu_s[k]:.3f}" for k in CPU_KEYS)
        kv = (f"{r.prompt_tokens} | {r.blocks_pulled} | {r.blocks_reused} | {r.bytes_moved:,} | "
              f"{r.prompt_kv_bytes:,} | {r.prefill_bytes_sent:,} | {r.ttft_ms:.1f} | "
              f"{r.kv_transfer_ms:.1f}" if r.prompt_tokens else " | ".join(["-"] * 8))
        print(f"| {r.label} | {kv} | {cpu} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": when, "commit": git_revision(), "kv_backend": args.kv_backend,
                       "block_bytes": block_bytes, "rows": [dataclasses.asdict(r) for r in rows]},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
