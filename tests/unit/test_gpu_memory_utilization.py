"""`--gpu-memory-utilization`: the KV budget a profiling run leaves on CUDA, and its flag.

- CPU (always): the budget arithmetic with numbers, its errors (naming the flags), the graph
  allowance, the profiling step's shape and layout (its attention metadata against each prompt
  run alone, on a tiny random model), which budget applies when (`--kv-cache-memory` wins when
  given; auto on CPU keeps 1GiB), and the flag reaching every layer that builds an
  `EngineConfig` (engine services, `pdmesh serve`, its share per engine on one GPU).
- CUDA (where present): an engine on random weights of Llama-3.2-1B's shape with
  gpu_memory_utilization=0.5 keeps weights + KV cache + the largest step's peak within half the
  GPU, and so does the whole engine core once its CUDA graphs are captured.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from pdmesh.config import parse_config
from pdmesh.decode_svc.config import DecodeConfig
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core.memory_profile import (
    GRAPH_BYTES_PER_CAPTURE,
    MemoryProfile,
    _prefill_metadata,
    blocks_for,
    gpu_kv_budget,
    graph_allowance,
    model_bytes,
    profile_kv_cache,
    profile_lengths,
    run_profile_step,
)
from pdmesh.engine.core.startup import set_up_engine
from pdmesh.engine.worker.cuda_graphs import capture_sizes
from pdmesh.engine.worker.model_loader import load_model
from pdmesh.kernels.backend import AttentionMetadata, TorchAttentionBackend
from pdmesh.kernels.backend_selection import get_attention_backend
from pdmesh.prefill_svc.config import PrefillConfig

pytestmark = pytest.mark.fast

GiB = 2**30
CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "attention_bias": False,
         "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2}
SHAPES: dict[str, dict[str, object]] = {
    "llama3.2-1b": {**LLAMA, "vocab_size": 128256, "hidden_size": 2048,
                    "intermediate_size": 8192, "num_hidden_layers": 16,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                    "max_position_embeddings": 131072, "tie_word_embeddings": True},
    "tiny": {**LLAMA, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 4096, "tie_word_embeddings": False},
}


def write_shape(path: Path, shape: str) -> Path:
    """A model directory holding only the config.json of a shape (random weights)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SHAPES[shape]))
    return path


def profile(**fields: int) -> MemoryProfile:
    numbers = dict(total=80 * GiB, free_at_start=79 * GiB, weights=16 * GiB,
                   activation_peak=2 * GiB, graph_allowance=GiB // 2, non_torch=GiB // 2)
    return MemoryProfile(**{**numbers, **fields})


# -- the arithmetic ------------------------------------------------------------------------------


def test_the_kv_cache_gets_the_share_less_everything_the_profile_measured() -> None:
    # 0.9 x 80 = 72 GiB; 16 + 2 + 0.5 + 0.5 = 19 GiB of it are not KV.
    assert gpu_kv_budget(0.9, profile()) == int(0.9 * 80 * GiB) - 19 * GiB
    assert gpu_kv_budget(0.5, profile()) == 40 * GiB - 19 * GiB
    # Utilization is this engine's share, whatever other processes hold beside it.
    assert gpu_kv_budget(0.5, profile(free_at_start=41 * GiB)) == 21 * GiB


def test_a_share_that_leaves_no_kv_cache_is_refused_naming_the_flags() -> None:
    with pytest.raises(ValueError, match="leaves nothing for the KV cache") as err:
        gpu_kv_budget(0.2, profile())  # 16 GiB share, 19 GiB needed besides the cache
    message = str(err.value)
    assert "--gpu-memory-utilization 0.2" in message and "--kv-cache-memory" in message
    assert "weights 16.00 GiB" in message and "--max-num-batched-tokens" in message
    with pytest.raises(ValueError, match="leaves nothing"):  # exactly nothing left
        gpu_kv_budget(0.25, profile(total=76 * GiB))


def test_a_share_that_was_not_free_at_start_is_refused() -> None:
    with pytest.raises(ValueError, match=r"only 30\.00 GiB were free at start-up") as err:
        gpu_kv_budget(0.9, profile(free_at_start=30 * GiB))
    assert "lower --gpu-memory-utilization or give --kv-cache-memory" in str(err.value)


def test_the_weights_are_the_models_own_bytes_a_tied_head_counted_once() -> None:
    """Not an allocator delta: on a lent H100, in a pytest process that had run other CUDA
    tests, the delta read 0.78 GiB for a 2.0 GiB model, and 0 for the next engine."""
    embed = torch.nn.Embedding(100, 8)
    head = torch.nn.Linear(8, 100, bias=False)
    head.weight = embed.weight  # tied
    model = torch.nn.ModuleDict({"embed": embed, "head": head, "norm": torch.nn.LayerNorm(8)})
    model.register_buffer("cos", torch.zeros(16, 4))
    assert model_bytes(model) == (100 * 8 + 8 + 8 + 16 * 4) * 4
    assert model_bytes(model.to(torch.bfloat16)) == (100 * 8 + 8 + 8 + 16 * 4) * 2


def test_graph_allowance_scales_the_forward_peak_to_the_largest_bucket() -> None:
    graphs = len(capture_sizes(256)) * GRAPH_BYTES_PER_CAPTURE
    table = 256 * (512 + 8) * 8
    assert graph_allowance(2048 * 1000, 2048, 256, 512) == 256 * 1000 + table + graphs
    # A step budget below max_num_seqs: the whole forward peak, never more.
    assert graph_allowance(64 * 1000, 64, 256, 512) == 64 * 1000 + table + graphs


def test_the_profiling_step_fills_the_token_budget_over_the_most_sequences() -> None:
    assert profile_lengths(2048, 256, 8192) == [8] * 256
    assert profile_lengths(2048, 3, 8192) == [683, 683, 682]
    assert profile_lengths(100, 256, 8192) == [1] * 100  # one sampled row per token at most
    assert profile_lengths(2048, 1, 1024) == [1024]  # no sequence outgrows the model
    assert blocks_for([17, 16, 1], 16) == 2 + 1 + 1


# -- which budget, and the flag ------------------------------------------------------------------


def test_cuda_profiles_unless_a_kv_budget_is_given_and_cpu_keeps_1gib() -> None:
    cuda, cpu = torch.device("cuda", 0), CPU
    config = EngineConfig()
    assert config.kv_cache_memory == "auto" and config.memory_utilization == 0.9
    assert config.profiles_memory(cuda) and not config.profiles_memory(cpu)
    assert config.kv_budget(free=64 * GiB) == GiB  # CPU's auto: today's 1GiB
    given = EngineConfig(kv_cache_memory="2GiB", gpu_memory_utilization=0.5)
    assert not given.profiles_memory(cuda)  # --kv-cache-memory wins when given
    assert given.kv_budget(free=64 * GiB) == 2 * GiB
    assert EngineConfig(kv_cache_memory=0.25).kv_budget(free=8 * GiB) == 2 * GiB
    assert EngineConfig(gpu_memory_utilization=0.5).memory_utilization == 0.5
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="cannot parse 'lots'"):
        EngineConfig(kv_cache_memory="lots")


def test_the_flag_reaches_the_engine_services() -> None:
    for cls in (PrefillConfig, DecodeConfig):
        config = parse_config(cls, ["--gpu-memory-utilization", "0.6"], prog="engine", env={})
        assert config.engine.gpu_memory_utilization == 0.6
        assert config.engine.kv_cache_memory == "auto"
    from_env = parse_config(DecodeConfig, [], prog="decode",
                            env={"PDMESH_GPU_MEMORY_UTILIZATION": "0.7"})
    assert from_env.engine.gpu_memory_utilization == 0.7
    with pytest.raises(SystemExit):
        parse_config(DecodeConfig, ["--gpu-memory-utilization", "2"], prog="decode", env={})


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_serve_hands_the_flag_on_and_shares_the_default_among_engines_on_one_gpu() -> None:
    # Imported here: the gateway's web stack is not on a lent GPU machine (bench/gpu_check.sh).
    from pdmesh.serve import LocalMesh, MeshConfig
    from pdmesh.serve.child_config import SERVE_CPU_KV_CACHE_MEMORY, engine_memory

    redis = ["--redis-url", "redis://127.0.0.1:1/0"]
    mesh = LocalMesh(parse_config(MeshConfig, [*redis, "--gpu-memory-utilization", "0.4"],
                                  prog="serve", env={}), env={})
    decode = parse_config(DecodeConfig, mesh.engine_args("decode"), prog="decode", env={})
    assert decode.engine.gpu_memory_utilization == 0.4
    # auto: 512MiB per engine on CPU; on CUDA 0.9 split among the engines sharing the GPU,
    # or each engine's own --gpu-memory-utilization (vLLM's per-instance meaning).
    default = parse_config(MeshConfig, redis, prog="serve", env={})
    assert engine_memory(default, on_cuda=False) == {"kv_cache_memory": SERVE_CPU_KV_CACHE_MEMORY}
    assert engine_memory(default, on_cuda=True) == {"gpu_memory_utilization": 0.45}
    three = parse_config(MeshConfig, [*redis, "--num-decode", "2"], prog="serve", env={})
    assert engine_memory(three, on_cuda=True) == {"gpu_memory_utilization": 0.3}
    assert engine_memory(mesh.config, on_cuda=True) == {}
    given = parse_config(MeshConfig, [*redis, "--kv-cache-memory", "2GiB"], prog="serve",
                         env={})
    assert engine_memory(given, on_cuda=True) == {}
    cpu_mesh = LocalMesh(parse_config(MeshConfig, [*redis, "--device", "cpu"], prog="serve",
                                      env={}), env={})
    assert flag(cpu_mesh.engine_args("prefill"), "--kv-cache-memory") == "512MiB"


# -- the profiling step, on CPU ------------------------------------------------------------------


@pytest.fixture(name="tiny", scope="module")
def tiny_fixture(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    model_dir = write_shape(tmp_path_factory.mktemp("tiny"), "tiny")
    model, _, _ = load_model(model_dir, torch.float32, CPU, 256, load_format="dummy")
    return model


def test_the_profiling_metadata_lays_each_prompt_out_on_its_own_blocks(tiny) -> None:  # type: ignore[no-untyped-def]
    """The step's last row of every prompt equals that prompt run alone: positions, slots,
    block tables and query offsets of the profiling step are the engine's layout."""
    lengths, block_size = [5, 17, 3, 16], 4
    backend = TorchAttentionBackend()
    cache = profile_kv_cache(tiny, lengths, block_size, torch.float32, CPU)
    meta, positions = _prefill_metadata(lengths, block_size, CPU)
    ids = torch.arange(sum(lengths)) % tiny.cfg.vocab_size
    together = tiny(ids, positions, cache, meta, backend)
    first = 0
    for row, n in enumerate(lengths):
        alone_cache = profile_kv_cache(tiny, [n], block_size, torch.float32, CPU)
        alone_meta, alone_pos = _prefill_metadata([n], block_size, CPU)
        alone = tiny(ids[first:first + n], alone_pos, alone_cache, alone_meta, backend)
        torch.testing.assert_close(together[first:first + n], alone, rtol=1e-4, atol=1e-5)
        # Its K/V went where its block-table row says: what attention reads back later.
        width = -(-n // block_size)
        blocks = meta.prefill_block_tables[row, :width]
        kv = cache[:, :, blocks].flatten(2, 3)[:, :, :n]
        torch.testing.assert_close(kv, alone_cache.flatten(2, 3)[:, :, :n], rtol=1e-4,
                                   atol=1e-5)
        first += n
    assert isinstance(meta, AttentionMetadata) and meta.num_decode_tokens == 0
    used = [b for row, n in enumerate(lengths)
            for b in meta.prefill_block_tables[row, :-(-n // block_size)].tolist()]
    assert sorted(used) == list(range(blocks_for(lengths, block_size)))  # none shared


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_the_profiling_step_runs_forward_head_and_sampler(tiny, backend_name: str) -> None:  # type: ignore[no-untyped-def]
    lengths = profile_lengths(96, 8, 256)
    cache = profile_kv_cache(tiny, lengths, 16, torch.float32, CPU)
    seen = []
    ids = run_profile_step(tiny, cache, get_attention_backend(backend_name, CPU), lengths,
                           on_forward=lambda: seen.append(True))
    assert seen == [True] and len(ids) == 8
    assert all(0 <= i < tiny.cfg.vocab_size for i in ids)


def test_a_cpu_engine_sizes_by_kv_cache_memory_and_profiles_nothing(tmp_path: Path) -> None:
    model_dir = write_shape(tmp_path / "m", "tiny")
    config = EngineConfig(model=str(model_dir), load_format="dummy", device="cpu",
                          gpu_memory_utilization=0.5)
    setup = set_up_engine(config)
    mc = setup.model_config
    per_block = mc.num_layers * 2 * 16 * mc.num_kv_heads * mc.head_dim * 4
    assert setup.num_blocks == GiB // per_block  # auto on CPU: 1GiB, as before
    assert setup.memory_profile is None and "profile" not in setup.capacity_summary


# -- CUDA ----------------------------------------------------------------------------------------


@needs_cuda
def test_half_the_gpu_holds_weights_kv_and_the_largest_step(tmp_path: Path) -> None:
    model_dir = write_shape(tmp_path / "llama1b", "llama3.2-1b")
    config = EngineConfig(model=str(model_dir), load_format="dummy", device="cuda:0",
                          gpu_memory_utilization=0.5, max_num_seqs=256,
                          max_num_batched_tokens=2048)
    setup = set_up_engine(config)
    profile = setup.memory_profile
    assert profile is not None and "--gpu-memory-utilization 0.5" in setup.capacity_summary
    share = 0.5 * profile.total
    tolerance = 256 * 2**20
    # 1,073,809,408 parameters in bf16: 2.0001 GiB (the tied head counted once).
    assert profile.weights > 2 * GiB and profile.activation_peak > 0
    assert profile.graph_allowance > 0  # triton on CUDA captures graphs
    kv_bytes = setup.kv_cache.numel() * setup.kv_cache.element_size()
    assert kv_bytes + profile.weights + profile.activation_peak <= share + tolerance
    # The largest step again, now over the real cache: the process never passes its share.
    lengths = profile_lengths(config.max_num_batched_tokens, config.max_num_seqs, 8192)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run_profile_step(setup.model, setup.kv_cache, get_attention_backend("auto", setup.device),
                     lengths)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() <= share + tolerance
    del setup


@needs_cuda
def test_the_engine_core_with_its_graphs_stays_within_its_share(tmp_path: Path) -> None:
    from pdmesh.engine.core.engine_core import EngineCore

    model_dir = write_shape(tmp_path / "llama1b", "llama3.2-1b")
    gc.collect()  # earlier tests' engines (reference cycles) give their memory back first
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    core = EngineCore(EngineConfig(model=str(model_dir), load_format="dummy", device="cuda:0",
                                   gpu_memory_utilization=0.5), eos_token_ids=[2])
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    # Everything this engine took since (torch's pools, graphs, cuBLAS, Triton): its share,
    # give or take what the profile cannot see (the allocator's rounding).
    assert free_before - free_after <= 0.5 * total + 512 * 2**20
    assert "sized by --gpu-memory-utilization 0.5" in core.info().capacity_summary
    core.close()
