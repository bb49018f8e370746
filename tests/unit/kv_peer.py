"""A KV sender in its own process, driven by JSON lines on stdin (test helper, not a test).

Events go to stdout as JSON lines: ready, published, release (from `on_release`), state,
and a final summary of every release. Used by test_kv_transfer.py to move KV between two
real processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections import defaultdict

import torch

from pdmesh.kvstore.transfer.layout import DTYPES_BY_NAME
from pdmesh.kvstore.transfer.sender import KVSender, KVSenderConfig
from pdmesh.kvstore.transfer.state import TransferState

_print_lock = threading.Lock()


def emit(event: str, **fields: object) -> None:
    with _print_lock:
        sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
        sys.stdout.flush()


def make_kv(seed: int, shape: list[int], dtype: str) -> torch.Tensor:
    """Deterministic KV; the test regenerates the same tensor to compare bit for bit."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(DTYPES_BY_NAME[dtype])


async def wait_for_state(sender: KVSender, transfer_id: str, state: TransferState) -> bool:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if sender.state(transfer_id) is state:
            return True
        await asyncio.sleep(0.0005)  # polling a state with a deadline
    return False


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="tcp")
    parser.add_argument("--shm-dir", default="/dev/shm")
    args = parser.parse_args()

    releases: dict[str, list[str]] = defaultdict(list)

    def on_release(request_id: str, reason: str) -> None:
        releases[request_id].append(str(reason))
        emit("release", request_id=request_id, reason=str(reason))

    config = KVSenderConfig(backends=tuple(args.backends.split(",")), shm_dir=args.shm_dir)
    sender = KVSender(config, on_release)
    await sender.start()
    published: dict[str, torch.Tensor] = {}
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[dict] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, json.loads(line))
        loop.call_soon_threadsafe(commands.put_nowait, {"cmd": "exit"})

    threading.Thread(target=read_stdin, daemon=True).start()
    emit("ready", address=sender.address, pid=os.getpid())
    background: set[asyncio.Task] = set()

    while True:
        cmd = await commands.get()
        name = cmd["cmd"]
        if name == "publish":
            kv = make_kv(cmd["seed"], cmd["shape"], cmd["dtype"])
            handle = sender.publish(cmd["request_id"], kv, cmd["num_tokens"],
                                    lease_s=cmd.get("lease_s"))
            published[handle.transfer_id] = kv
            emit("published", handle=handle.to_dict())
        elif name == "corrupt":
            # Simulates blocks freed and reused while still published.
            published[cmd["transfer_id"]].view(-1)[0] += 1
            emit("corrupted", transfer_id=cmd["transfer_id"])
        elif name == "cancel":
            state = sender.cancel(cmd["transfer_id"])
            emit("cancelled", transfer_id=cmd["transfer_id"], state=state.name)
        elif name in ("cancel_when_transferring", "die_when_transferring"):
            tid = cmd["transfer_id"]

            async def act(tid: str = tid, name: str = name) -> None:
                seen = await wait_for_state(sender, tid, TransferState.TRANSFERRING)
                if name == "die_when_transferring":
                    os.kill(os.getpid(), signal.SIGKILL)
                state = sender.cancel(tid)
                emit("cancelled", transfer_id=tid, state=state.name, seen_transferring=seen)

            task = asyncio.create_task(act())
            background.add(task)
            task.add_done_callback(background.discard)
            emit("armed", transfer_id=tid)
        elif name == "state":
            emit("state", transfer_id=cmd["transfer_id"],
                 state=sender.state(cmd["transfer_id"]).name, pinned=sender.pinned_count())
        elif name == "exit":
            await sender.stop()
            emit("summary", releases=dict(releases), pinned=sender.pinned_count())
            return


if __name__ == "__main__":
    asyncio.run(main())
