"""The start-up memory profile on CUDA: what the engine needs besides its KV cache, measured.

vLLM's `--gpu-memory-utilization` semantics: this engine may use `utilization x total` bytes
of its GPU, all told (its *share*); the KV cache gets what the rest leaves. The rest is
measured once, after the weights are loaded and before the cache exists:

- weights: the bytes of the model's parameters and buffers on the device (each storage once;
  a tied head shares the embedding's). Not an allocator delta: in a process that frees other
  tensors meanwhile (a test run, a restart in-process) the delta undercounts them;
- the activation peak: the growth of `torch.cuda.max_memory_allocated` over the largest step
  the config allows (`profile_lengths`: max_num_batched_tokens prompt tokens over up to
  max_num_seqs sequences), its LM head on every sequence's last row and the sampler on those
  rows in its most memory-hungry mode (a full-vocabulary sort, min-p, logprobs). The step
  writes a small temporary KV cache, which is not counted: the real one replaces it. Rows of
  prompt logprobs (every prompt row through the LM head) are not profiled, as in vLLM: they
  live in the (1 - utilization) headroom;
- CUDA graphs, captured later into a pool of their own (engine/worker/cuda_graphs.py), cannot
  be measured before the cache they read exists: `graph_allowance` estimates them from the
  profiled forward (vLLM leaves them to the headroom; this counts them);
- non-torch memory: device memory in use that torch's allocator does not hold (cuBLAS
  workspaces, Triton modules, ...), as its growth since the first snapshot. As in vLLM, the
  CUDA context (made before that snapshot) and other processes are outside the share, so
  start-up refuses when the memory free at start cannot hold the share; an engine starting
  beside another on the same GPU counts the other's growth meanwhile as its own (a smaller
  cache, never an overcommit).

`gpu_kv_budget` is the arithmetic, `measure_memory_profile` the measurement.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdmesh.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from pdmesh.engine.worker.cuda_graphs import capture_sizes
from pdmesh.engine.worker.models.llama import LlamaForCausalLM
from pdmesh.engine.worker.sampler import Sampler, SamplingMetadata
from pdmesh.kernels.backend import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

GRAPH_BYTES_PER_CAPTURE = 4 * 2**20
"""Device memory one captured CUDA graph holds outside torch's pools (the driver's graph and
its executable instance), an upper estimate: a few MiB each, as vLLM measured, times the ~35
batch sizes pdmesh captures at max_num_seqs=256. To be replaced by a measurement on a GPU."""

GiB = 2**30


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a CUDA device's memory."""

    free: int
    total: int
    torch_allocated: int  # bytes torch's tensors hold
    torch_reserved: int  # bytes torch's caching allocator holds (allocated or cached)

    @property
    def non_torch(self) -> int:
        """Memory in use on the device that torch's allocator does not hold."""
        return self.total - self.free - self.torch_reserved


@dataclass(frozen=True)
class MemoryProfile:
    """What the engine needs on its GPU besides the KV cache, in bytes."""

    total: int  # the GPU's memory
    free_at_start: int  # free before this engine loaded anything
    weights: int
    activation_peak: int  # the largest step's peak, LM head and sampler included
    graph_allowance: int  # CUDA graphs, captured later: estimated (0 when none are captured)
    non_torch: int  # growth of memory in use outside torch's allocator since start

    @property
    def non_kv(self) -> int:
        return self.weights + self.activation_peak + self.graph_allowance + self.non_torch

    def describe(self, utilization: float) -> str:
        return (f"sized by --gpu-memory-utilization {utilization} of {self.total / GiB:.1f} GiB "
                f"after a profile: weights {self.weights / GiB:.2f} GiB, activation peak "
                f"{self.activation_peak / GiB:.2f} GiB, CUDA graphs ~"
                f"{self.graph_allowance / GiB:.2f} GiB (allowance), non-torch "
                f"{self.non_torch / GiB:.2f} GiB")


def gpu_kv_budget(utilization: float, profile: MemoryProfile) -> int:
    """KV cache bytes: `utilization x total` minus everything else the profile measured.
    ValueError, naming the flags, when the share is not free at start or leaves nothing."""
    share = int(utilization * profile.total)
    if profile.free_at_start < share:
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: this engine's share is "
            f"{share / GiB:.2f} GiB of the GPU's {profile.total / GiB:.2f} GiB, but only "
            f"{profile.free_at_start / GiB:.2f} GiB were free at start-up (other processes "
            "hold the rest); lower --gpu-memory-utilization or give --kv-cache-memory")
    budget = share - profile.non_kv
    if budget <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} x {profile.total / GiB:.2f} GiB = "
            f"{share / GiB:.2f} GiB leaves nothing for the KV cache: weights "
            f"{profile.weights / GiB:.2f} GiB, activation peak "
            f"{profile.activation_peak / GiB:.2f} GiB, CUDA graphs "
            f"{profile.graph_allowance / GiB:.2f} GiB and non-torch memory "
            f"{profile.non_torch / GiB:.2f} GiB take {profile.non_kv / GiB:.2f} GiB; raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens or --max-num-seqs, "
            "or give --kv-cache-memory")
    return budget


def graph_allowance(forward_peak: int, profiled_tokens: int, max_num_seqs: int,
                    max_blocks_per_seq: int) -> int:
    """CUDA graphs' memory, estimated before they exist: their pool holds the activations of
    the largest bucket (`max_num_seqs` decode tokens; activations grow with the tokens of a
    step, so the profiled forward's peak scaled to them), their static inputs (the block
    table above all) and each graph's own driver memory."""
    scaled = forward_peak * min(1.0, max_num_seqs / max(1, profiled_tokens))
    static_inputs = max_num_seqs * (max_blocks_per_seq + 8) * 8  # int64 table, ids, lens, ...
    return int(scaled) + static_inputs + GRAPH_BYTES_PER_CAPTURE * len(capture_sizes(
        max_num_seqs))


def profile_lengths(max_num_batched_tokens: int, max_num_seqs: int,
                    max_model_len: int) -> list[int]:
    """Prompt lengths of the profiling step: the step's token budget spread over as many
    sequences as a step may hold (the LM head and sampler then see the most rows), none
    longer than a sequence may be."""
    seqs = min(max_num_seqs, max_num_batched_tokens)
    tokens = min(max_num_batched_tokens, seqs * max_model_len)
    base, extra = divmod(tokens, seqs)
    return [base + 1] * extra + [base] * (seqs - extra)


def blocks_for(lengths: list[int], block_size: int) -> int:
    """KV blocks that prompts of `lengths` occupy, none shared."""
    return sum(-(-n // block_size) for n in lengths)


def profile_kv_cache(model: LlamaForCausalLM, lengths: list[int], block_size: int,
                     dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The temporary KV cache the profiling step writes: just the blocks it needs."""
    cfg = model.cfg
    return torch.zeros((cfg.num_layers, 2, blocks_for(lengths, block_size), block_size,
                        model.shard.kv_heads.size, cfg.head_dim), dtype=dtype, device=device)


@torch.inference_mode()
def run_profile_step(model: LlamaForCausalLM, kv_cache: torch.Tensor, backend: AttentionBackend,
                     lengths: list[int], on_forward: Callable[[], None] | None = None,
                     ) -> list[int]:
    """One step of prompts of `lengths` (one chunk each, blocks 0.. of `kv_cache` in order),
    the LM head on each one's last row and the sampler on those rows; returns the sampled ids
    (the step waits for them, as a step with logprobs does).
    `on_forward()` runs between the forward and the LM head (where the forward's own peak is
    read)."""
    device = kv_cache.device
    block_size = kv_cache.shape[3]
    meta, positions = _prefill_metadata(lengths, block_size, device)
    tokens = len(positions)
    input_ids = torch.arange(tokens, device=device) % model.cfg.vocab_size
    hidden = model(input_ids, positions, kv_cache, meta, backend)
    if on_forward is not None:
        on_forward()
    last_rows = torch.tensor(lengths, device=device).cumsum(0) - 1
    logits = model.compute_logits(hidden.index_select(0, last_rows))
    del hidden
    return _sample_hungrily(logits)


def _prefill_metadata(lengths: list[int], block_size: int, device: torch.device
                      ) -> tuple[AttentionMetadata, torch.Tensor]:
    """Attention metadata of a step of whole prompts, the layout engine/worker/input_batch.py
    builds (int64 tensors), each prompt on blocks of its own, and the token positions."""
    widths = [-(-n // block_size) for n in lengths]
    width = max(widths)
    table = torch.zeros((len(lengths), width), dtype=torch.int64)
    slots, positions, first = [], [], 0
    for row, (n, w) in enumerate(zip(lengths, widths, strict=True)):
        blocks = torch.arange(first, first + w, dtype=torch.int64)
        table[row, :w] = blocks
        pos = torch.arange(n, dtype=torch.int64)
        positions.append(pos)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        first += w
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros((0, width), dtype=torch.int64, device=device),
        decode_seq_lens=torch.zeros((0,), dtype=torch.int64, device=device),
        prefill_query_start_loc=starts,
        prefill_seq_lens=list(lengths),
        prefill_block_tables=table.to(device),
    )
    return meta, torch.cat(positions).to(device)


def _sample_hungrily(logits: torch.Tensor) -> list[int]:
    """Sample `logits`' rows the way that takes the most memory: one row with neither top-k
    nor top-p makes the sampler sort the whole vocabulary, min-p takes a full softmax, and
    logprobs a log-softmax copy of the raw rows."""
    rows = logits.shape[0]
    hungry = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, logprobs=MAX_LOGPROBS)
    plain = SamplingParams(temperature=0.7, logprobs=MAX_LOGPROBS)
    params = [hungry] * (rows - 1) + [plain]
    meta = SamplingMetadata(params, [None] * rows, [[] for _ in range(rows)],
                            [[] for _ in range(rows)], set())
    sampled = Sampler(seed=0, device=logits.device)(logits, meta)
    return [s.token_id for s in sampled]


def read_device_memory(device: torch.device) -> DeviceMemory:
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(free, total, torch.cuda.memory_allocated(device),
                        torch.cuda.memory_reserved(device))


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (all on the engine's device), each storage
    counted once."""
    storages: dict[tuple[torch.device, int], int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def measure_memory_profile(model: LlamaForCausalLM, backend: AttentionBackend,
                           start: DeviceMemory, device: torch.device, *, block_size: int,
                           max_num_batched_tokens: int, max_num_seqs: int, max_positions: int,
                           graphs: bool) -> MemoryProfile:
    """Run the profiling step on `device` (CUDA, the weights loaded; `start`: the reading
    before they were) and measure what the engine needs besides its KV cache. `max_positions`:
    the model's position table (no sequence is longer; the graphs' block tables span it).
    `graphs`: whether decode steps will be captured as CUDA graphs."""
    lengths = profile_lengths(max_num_batched_tokens, max_num_seqs, max_positions)
    kv_cache = profile_kv_cache(model, lengths, block_size, model.embed_tokens.weight.dtype,
                                device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    forward_peak = 0

    def read_forward_peak() -> None:
        nonlocal forward_peak
        torch.cuda.synchronize(device)
        forward_peak = torch.cuda.max_memory_allocated(device) - before

    run_profile_step(model, kv_cache, backend, lengths, on_forward=read_forward_peak)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del kv_cache
    gc.collect()
    torch.cuda.empty_cache()
    after = read_device_memory(device)
    allowance = 0
    if graphs:
        max_blocks = -(-max_positions // block_size)
        allowance = graph_allowance(forward_peak, sum(lengths), max_num_seqs, max_blocks)
    profile = MemoryProfile(
        total=start.total,
        free_at_start=start.free,
        weights=model_bytes(model),
        activation_peak=max(0, peak),
        graph_allowance=allowance,
        non_torch=max(0, after.non_torch - start.non_torch),
    )
    logger.info("memory profile of a %d-token step over %d sequences: %s", sum(lengths),
                len(lengths), profile)
    return profile
