"""Memory of a local mesh: each process's RSS and PSS, idle and after a few requests.

Starts `pdmesh serve MODEL` as the quickstart does (`--kv-cache-memory 512MiB`, free ports),
waits for its ready line, reads every descendant's memory from /proc (RSS, and PSS from
/proc/PID/smaps_rollup: RSS counts a shared page, such as a library mapped by five processes,
in full in each of them; PSS splits it among them, so PSS sums to what the mesh really holds),
sends `--requests` chat completions through the OpenAI API (`--concurrency` at a time, small
`max_tokens`), reads them again, prints one table, and stops the mesh (SIGTERM, then SIGKILL).
Every wait is bounded. Whether a process has torch loaded (libtorch mapped) is shown too.

    .venv/bin/python bench/rss.py [--model smollm2] [--requests 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

MIB = 2**20
ROLE_ORDER = ("supervisor", "redis", "router", "gateway", "prefill service", "prefill core",
              "decode service", "decode core", "other")


@dataclass
class Mem:
    """One process's memory, in bytes (`torch`: libtorch is mapped in it)."""

    pid: int
    role: str
    rss: int
    pss: int
    uss: int
    torch: bool


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return kids


def descendants(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += _children(pid)
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def role_of(pid: int, root: int) -> str:
    """Which part of the mesh a process is, from its command line (and its parent's)."""
    if pid == root:
        return "supervisor"
    argv = _cmdline(pid)
    text = " ".join(argv)
    if "redis-server" in text:
        return "redis"
    if "pdmesh.engine.core.core_process" in argv:
        parent = role_of(_parent(pid), root)
        return parent.replace("service", "core") if "service" in parent else "other"
    if "pdmesh.cli" in argv:
        sub = argv[argv.index("pdmesh.cli") + 1] if argv.index("pdmesh.cli") + 1 < len(argv) else ""
        if sub in ("prefill", "decode"):
            return f"{sub} service"
        if sub in ("router", "gateway"):
            return sub
    return "other"


def _smaps_rollup(pid: int) -> dict[str, int]:
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            m = re.match(r"(\w+):\s+(\d+) kB", line)
            if m:
                fields[m.group(1)] = int(m.group(2)) * 1024
    return fields


def _has_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libtorch" in line for line in f)
    except OSError:
        return False


def measure(root: int) -> list[Mem]:
    mems = []
    for pid in descendants(root):
        try:
            s = _smaps_rollup(pid)
        except OSError:
            continue  # gone meanwhile
        mems.append(Mem(pid, role_of(pid, root), s.get("Rss", 0), s.get("Pss", 0),
                        s.get("Private_Clean", 0) + s.get("Private_Dirty", 0), _has_torch(pid)))
    return mems


def by_role(mems: list[Mem]) -> dict[str, list[Mem]]:
    roles: dict[str, list[Mem]] = {}
    for m in mems:
        roles.setdefault(m.role, []).append(m)
    return dict(sorted(roles.items(), key=lambda kv: ROLE_ORDER.index(kv[0])
                       if kv[0] in ROLE_ORDER else len(ROLE_ORDER)))


def start_mesh(model: str, log_path: str, extra: list[str]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "pdmesh.cli", "serve", model, "--port", "0",
            "--kv-cache-memory", "512MiB", "--local-prefill-threshold", "0", *extra]
    log = open(log_path, "wb")  # noqa: SIM115 - the child keeps it
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def wait_ready(proc: subprocess.Popen[bytes], log_path: str, timeout_s: float) -> str:
    """The gateway's base URL, from the mesh's `ready ... gateway=URL` line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log_path, errors="replace") as f:
            for line in f:
                if line.startswith("ready "):
                    m = re.search(r"gateway=(\S+)", line)
                    if not m:
                        raise RuntimeError(f"no gateway in the ready line: {line!r}")
                    return m.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"the mesh exited ({proc.returncode}) before it was ready")
        time.sleep(0.5)
    raise TimeoutError(f"the mesh was not ready within {timeout_s:g}s")


def one_request(url: str, model: str, i: int, max_tokens: int) -> bool:
    body = json.dumps({
        "model": model, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": f"Question {i}: name a color and a number."}],
    }).encode()
    req = urllib.request.Request(f"{url}/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status == 200 and bool(json.load(resp)["choices"])
    except OSError:
        return False


def send(url: str, model: str, n: int, concurrency: int, max_tokens: int) -> int:
    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(lambda i: one_request(url, model, i, max_tokens), range(n)))


def stop_mesh(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def table(idle: list[Mem], after: list[Mem]) -> str:
    """One row per role (several processes of a role summed, their count shown)."""
    rows = ["| process | n | torch | RSS idle MiB | PSS idle MiB | RSS after MiB | "
            "PSS after MiB |", "|---|---:|---|---:|---:|---:|---:|"]
    idle_roles, after_roles = by_role(idle), by_role(after)
    for role in dict.fromkeys([*idle_roles, *after_roles]):
        a, b = idle_roles.get(role, []), after_roles.get(role, [])
        torch = "yes" if any(m.torch for m in a + b) else "no"

        def mib(ms: list[Mem], key: str) -> str:
            return f"{sum(getattr(m, key) for m in ms) / MIB:.0f}" if ms else "-"

        rows.append(f"| {role} | {max(len(a), len(b))} | {torch} | {mib(a, 'rss')} | "
                    f"{mib(a, 'pss')} | {mib(b, 'rss')} | {mib(b, 'pss')} |")
    rows.append(f"| **total** | {len(idle)} | | **{sum(m.rss for m in idle) / MIB:.0f}** | "
                f"**{sum(m.pss for m in idle) / MIB:.0f}** | "
                f"**{sum(m.rss for m in after) / MIB:.0f}** | "
                f"**{sum(m.pss for m in after) / MIB:.0f}** |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--settle-s", type=float, default=5.0,
                        help="idle seconds before each measurement")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--json", default="", help="also write the raw numbers here")
    parser.add_argument("serve_args", nargs="*", help="more `pdmesh serve` flags (after --)")
    args = parser.parse_args()

    log_path = tempfile.mktemp(prefix="pdmesh-rss-", suffix=".log")
    proc = start_mesh(args.model, log_path, args.serve_args)
    ok = -1
    try:
        url = wait_ready(proc, log_path, args.startup_timeout_s)
        time.sleep(args.settle_s)
        idle = measure(proc.pid)
        started = time.monotonic()
        done = threading.Event()
        result: list[int] = []
        worker = threading.Thread(target=lambda: (result.append(
            send(url, args.model, args.requests, args.concurrency, args.max_tokens)),
            done.set()), daemon=True)
        worker.start()
        if not done.wait(timeout=600):
            raise TimeoutError("the requests did not finish within 600 s")
        ok, took = result[0], time.monotonic() - started
        time.sleep(args.settle_s)
        after = measure(proc.pid)
    except BaseException:
        with open(log_path, errors="replace") as f:
            sys.stderr.write(f.read()[-4000:])
        raise
    finally:
        stop_mesh(proc)
        os.unlink(log_path)
    print(f"{args.requests} requests ({ok} ok) in {took:.1f}s, max_tokens {args.max_tokens}, "
          f"{args.concurrency} at a time")
    print(table(idle, after))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"idle": [asdict(m) for m in idle], "after": [asdict(m) for m in after],
                       "ok": ok}, f, indent=1)
    return 0 if ok == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
