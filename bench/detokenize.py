"""Detokenization per token: what the output processor spends on each streamed token.

A serving process detokenizes every output token of every request (a stop string must be found
as soon as it appears), so this cost scales with the tokens a core produces: ~13k a second on a
GPU at batch 128. This times `IncrementalDetokenizer` as the output processor drives it at
`--stream-interval 1` (update, then the cumulative `output_text`, one token at a time, after a
256-token prompt) with the two token decoders of engine/frontend/token_decoder.py: the Rust
`DecodeStream` (fast tokenizers, the default) and the Python window (slow tokenizers, and the
fallback), on text in several scripts, with and without stop strings. The table is microseconds
per token, the median of --repeats.

    python bench/detokenize.py                   # SmolLM2's tokenizer (`pdmesh model path`)
    python bench/detokenize.py --model /tmp/tiny # any local model directory
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from pdmesh.engine.frontend.detokenizer import IncrementalDetokenizer
from pdmesh.engine.frontend.token_decoder import StreamDecoder, WindowDecoder, make_token_decoder
from pdmesh.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]

TEXT = {
    "English (this repository's docs)": (ROOT / "docs/ARCHITECTURE.md").read_text()[:12000],
    "mixed scripts and emoji": (
        "Héllo wörld — crème brûlée. 日本語のテキスト、中文字符测试，한국어 문장입니다。"
        " Ελληνικά, русский текст 😀🎉 👨\u200d👩\u200d👧\u200d👦 🇯🇵🇫🇷! ") * 40,
}


class PythonOnly:
    """The tokenizer with its Rust backend out of view, so the Python window decodes."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self._inner.decode(*args, **kwargs)


def per_token_us(tokenizer: Any, prompt: list[int], ids: list[int],
                 params: SamplingParams) -> float:
    det = IncrementalDetokenizer(tokenizer, prompt, params)
    start = time.perf_counter()
    for token_id in ids:
        det.update([token_id])
        _ = det.output_text  # what the output processor reads for each output it hands out
        if det.finished:
            raise RuntimeError("a stop string of the benchmark matched its text")
    return (time.perf_counter() - start) / len(ids) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model = args.model or subprocess.run(
        [str(ROOT / ".venv/bin/pdmesh"), "model", "path", "smollm2"],
        check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert isinstance(make_token_decoder(tokenizer, [], True), StreamDecoder)
    assert isinstance(make_token_decoder(PythonOnly(tokenizer), [], True), WindowDecoder)
    prompt = tokenizer.encode(TEXT["English (this repository's docs)"][-4000:],
                              add_special_tokens=False)[-256:]
    settings = {"no stop strings": SamplingParams(),
                "two stop strings": SamplingParams(stop=["\n\n\n\n", "<|never|>"])}

    print(f"tokenizer: {model}; {args.tokens} output tokens, median of {args.repeats}\n")
    print("| text | stop strings | Rust `DecodeStream` us/token | Python window us/token "
          "| ratio |")
    print("|---|---|---:|---:|---:|")
    for name, text in TEXT.items():
        ids = tokenizer.encode(text, add_special_tokens=False)[: args.tokens]
        for label, params in settings.items():
            fast = statistics.median(per_token_us(tokenizer, prompt, ids, params)
                                     for _ in range(args.repeats))
            slow = statistics.median(per_token_us(PythonOnly(tokenizer), prompt, ids, params)
                                     for _ in range(args.repeats))
            print(f"| {name} | {label} | {fast:.1f} | {slow:.1f} | {slow / fast:.1f}x |")


if __name__ == "__main__":
    main()
