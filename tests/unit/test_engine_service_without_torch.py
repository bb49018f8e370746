"""An engine service whose core runs in its own process imports no torch.

`pdmesh prefill` / `pdmesh decode` run their engine core in a process of its own (the default)
and, on the worker-to-worker KV path, that core moves the KV bytes itself: torch in the
service cost ~240 MiB of RSS each for as long as it served (bench/README.md, "RSS"). Checked
in a fresh interpreter (this test process has torch already): importing what the commands
import at start-up, and what serving calls on the default path (which KV planes exist, a KV
handle's layout sent and read back, the export's layout, the tokenizer and the output
processor), leave `torch` out of `sys.modules`. The in-process core and the staged transports
still load torch where they are used (their own tests).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

NO_TORCH = """
import sys
import pdmesh.cli
import pdmesh.engines
import pdmesh.engine_svc.process as process
from pdmesh.config import parse_config
from pdmesh.decode_svc.config import DecodeConfig
from pdmesh.engine.core_types import CoreInfo
from pdmesh.engine.core_protocol import TensorHeader, tensor_from_frame
from pdmesh.kvstore.transfer.backends import limit_torch_threads
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.layout import KVLayout
from pdmesh.kvstore.transfer.wire import WireHeader, decode_header, encode_header
from pdmesh.kvstore.transfer.worker_planes import core_backends

limit_torch_threads(1)  # what start_engine does; torch stays out until a staged plane loads it
config = parse_config(DecodeConfig, ["--model", "smollm2"], prog="pdmesh decode")
assert process._kv_backends(config, "decode")
assert "tcp" in core_backends("cache", "127.0.0.1:1")
handle = KVHandle(transfer_id="0" * 32, request_id="r", sender_address="127.0.0.1:1",
                  backends=("shm", "tcp"), host_key="h", sender_id="s",
                  layout=KVLayout(2, 3, 16, 4, 8, "bfloat16", 40),
                  checksum_algo=ChecksumAlgo.CRC32, checksum=0, block_checksums=(1, 2, 3))
assert KVHandle.from_proto(handle.to_proto()) == handle
assert KVHandle.from_dict(handle.to_dict()) == handle
assert decode_header(encode_header(WireHeader.for_handle(handle))).layout == handle.layout
try:
    tensor_from_frame(TensorHeader([2], "float32"), b"short")
except ValueError:
    pass
else:
    raise AssertionError("a short frame was accepted")
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, loaded
"""

TOKENIZER = """
import sys
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.model_store import model_dir_for
from pdmesh.engine.frontend.output_processor import OutputProcessor
from pdmesh.engine.tokenizing import eos_token_ids, load_tokenizer, tokenize_prompt

config = EngineConfig(model="smollm2")
tokenizer = load_tokenizer(config)
eos = eos_token_ids(tokenizer, model_dir_for(config))
OutputProcessor(tokenizer, eos, 1)
assert tokenize_prompt(tokenizer, "Hello")[1]
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, loaded
"""


def _run(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.processes
def test_the_engine_service_runs_without_torch() -> None:
    _run(NO_TORCH)


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.weights
def test_its_tokenizer_loads_without_torch_as_the_engines_do(model_dir) -> None:
    _run(TOKENIZER)
    from transformers import AutoTokenizer

    from pdmesh.engine.config import EngineConfig
    from pdmesh.engine.tokenizing import load_tokenizer

    ours = load_tokenizer(EngineConfig(model="smollm2"))
    theirs = AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(theirs)
    assert ours.eos_token_id == theirs.eos_token_id
    text = "emoji 🎉 and CJK 漢字 <|im_start|>user\nhi<|im_end|>"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
