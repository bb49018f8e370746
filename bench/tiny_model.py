"""A tiny random-weight Llama with SmolLM2's tokenizer, written as an HF checkpoint.

Its steps cost next to nothing (2 layers, 64 wide), so a mesh serving it spends its CPU in
the serving path itself: gRPC, protobuf, detokenization, SSE. `bench/profile_serving.py
--model DIR` then measures what each hop costs per streamed token, which a real model hides
behind its GEMMs. The shape is `gpu_throughput.py`'s "tiny"; the weights are seeded.

    python bench/tiny_model.py /tmp/pdmesh-tiny
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_throughput import SHAPES, default_tokenizer_dir, write_model_dir


def write_tiny_model(dest: Path, seed: int = 0) -> Path:
    """`dest` as a loadable checkpoint: config, tokenizer files and seeded random weights."""
    write_model_dir("tiny", dest, default_tokenizer_dir())
    torch.manual_seed(seed)
    config = LlamaConfig(**{k: v for k, v in SHAPES["tiny"].items() if k != "architectures"})
    LlamaForCausalLM(config).save_pretrained(dest, safe_serialization=True)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_model(args.dest, args.seed))


if __name__ == "__main__":
    main()
