"""The router's queueing-delay rate from the engine's step-cost model: the model's exported
prefill throughput (engine/scheduling/step_cost.py), its way into the load report
(engine/core/load_snapshot.py, engine_svc/service.py), and admission by it
(router/queue_delay.py), falling back to the measured rates."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core.load_snapshot import load_snapshot
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduling.step_cost import (
    MIN_STEPS,
    StepCost,
    StepCostModel,
    attention_pairs,
    work_of,
)
from pdmesh.metrics import EngineCollector, EngineState
from pdmesh.router.admission import OverCapacity
from pdmesh.router.queue_delay import QueueDelay, Worker
from pdmesh.v1 import engine_pb2
from tests.unit.test_step_budget import TRUE, K

pytestmark = pytest.mark.fast



def trained_model(steps: int = 300) -> StepCostModel:
    """A model fed steps as serving makes them (decode rows, sometimes a prefill chunk) timed
    by `TRUE`, 2% noise."""
    rng = random.Random(3)
    model = StepCostModel(K)
    for _ in range(steps):
        rows = [(rng.randrange(16, 2000), 1) for _ in range(rng.randrange(1, 24))]
        if rng.random() < 0.4:
            rows.append((rng.randrange(0, 1500), rng.randrange(16, 1024)))
        work = work_of(rows)
        model.observe(work, TRUE.seconds(work) * (1 + rng.uniform(-0.02, 0.02)))
    return model


# -- the model's exported rate ---------------------------------------------------------------------


def test_the_rate_is_a_full_chunk_over_its_predicted_time() -> None:
    chunk = 2048
    seconds = (TRUE.base_s + TRUE.per_row_s + TRUE.per_token_s * chunk
               + TRUE.per_pair_s * attention_pairs(0, chunk))
    assert TRUE.prefill_tokens_per_s(chunk) == pytest.approx(chunk / seconds)
    # The per-step overhead is spread over the chunk (a small chunk is slower per token), and
    # attention grows with it (a long one is slower again).
    assert TRUE.prefill_tokens_per_s(64) < TRUE.prefill_tokens_per_s(512)
    assert TRUE.prefill_tokens_per_s(chunk) < TRUE.prefill_tokens_per_s(512)
    assert TRUE.prefill_tokens_per_s(0) == 0.0
    assert StepCost(0.0, 0.0, 0.0, 0.0).prefill_tokens_per_s(chunk) == 0.0


def test_a_fitted_model_exports_the_true_rate_and_nothing_before() -> None:
    assert StepCostModel(K).prefill_tokens_per_s(2048) == 0.0
    model = trained_model()
    assert model.ready
    for chunk in (512, 2048):
        assert model.prefill_tokens_per_s(chunk) == pytest.approx(
            TRUE.prefill_tokens_per_s(chunk), rel=0.05)


TINY_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_act": "silu", "vocab_size": 256, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False}


def test_an_engine_reports_its_model_rate_once_fitted(tmp_path: Path) -> None:
    """A real (tiny, random-weight) engine core: 0 in its load report until its step-cost
    model has fitted, then the model's rate for its own token budget, in the load proto."""
    from pdmesh.engine.core.engine_core import EngineCore

    (tmp_path / "config.json").write_text(json.dumps(TINY_SHAPE))
    core = EngineCore(EngineConfig(model=str(tmp_path), load_format="dummy", device="cpu",
                                   kv_cache_memory="4MiB", max_num_batched_tokens=128),
                      eos_token_ids=())
    try:
        assert load_snapshot(core).model_prefill_tokens_per_s == 0.0
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        rng = random.Random(5)
        steps = 0
        for i in range(12):  # a prompt, then its decodes beside the next prompt
            prompt = [rng.randrange(1, 256) for _ in range(rng.randrange(20, 100))]
            core.add(EngineRequest(f"r{i}", prompt, params))
            for _ in range(3):
                core.step()
                steps += 1
        assert steps >= MIN_STEPS and core.scheduler.step_cost.ready
        rate = load_snapshot(core).model_prefill_tokens_per_s
        assert rate > 0
        assert rate == core.scheduler.step_cost.prefill_tokens_per_s(128)
        load = engine_pb2.EngineLoad(model_prefill_tokens_per_s=rate)
        assert load.model_prefill_tokens_per_s == pytest.approx(rate, rel=1e-6)  # a float32
    finally:
        core.close()


def test_the_engine_exports_the_rate_as_a_gauge() -> None:
    registry = CollectorRegistry()
    registry.register(EngineCollector("prefill", lambda: EngineState(
        num_running=0, num_waiting=0, kv_usage=0.0, num_free_blocks=1, num_total_blocks=1,
        num_pinned_blocks=0, prefix_query_tokens=0, prefix_hit_tokens=0, index_up=None,
        model_prefill_tokens_per_s=1234.5), model_name="m"))
    text = generate_latest(registry).decode()
    assert ('pdmesh:engine_model_prefill_tokens_per_second{model_name="m",role="prefill"} '
            '1234.5') in text


# -- admission by the model's rate -----------------------------------------------------------------


def worker(name: str, *, model_rate: float = 0.0, tokens: int = 0, seconds: float = 0.0,
           prefills: bool = True, healthy: bool = True) -> Worker:
    return Worker(name, prefills, healthy, tokens, seconds, model_rate)


def test_model_rates_decide_from_the_first_poll_and_refuse_past_the_bound() -> None:
    delay = QueueDelay(max_delay_s=5)
    fleet = [worker("p1", model_rate=600.0), worker("p2", model_rate=400.0)]
    delay.observe(fleet, now=0)  # one poll: nothing measured, the models already know
    assert delay.rate(fleet) == pytest.approx(1000)
    delay.admit(50_000, fleet)  # alone: never refused for its own length
    delay.started(4000)
    assert delay.predict(1000, fleet) == pytest.approx(5.0)
    delay.admit(1000, fleet)  # (4,000 + 1,000) / 1,000 = 5 s: at the bound
    with pytest.raises(OverCapacity, match=r"~6s") as info:
        delay.admit(2000, fleet)  # (4,000 + 2,000) / 1,000 = 6 s
    assert info.value.reason == "predicted_delay"
    assert info.value.retry_after_s == pytest.approx(1.0)


def test_the_model_rate_wins_over_the_measured_one_which_stays_the_fallback() -> None:
    delay = QueueDelay(max_delay_s=5)
    delay.observe([worker("a"), worker("b")], now=0)
    # Between two polls a computed 2,000 tok/s and b 500 tok/s; only a reports a model rate.
    fleet = [worker("a", model_rate=800.0, tokens=2000, seconds=1.0),
             worker("b", tokens=500, seconds=1.0)]
    delay.observe(fleet, now=1)
    assert delay.instance_rate(fleet[0]) == pytest.approx(800)
    assert delay.instance_rate(fleet[1]) == pytest.approx(500)
    assert delay.rate(fleet) == pytest.approx(1300)
    delay.started(5200)
    with pytest.raises(OverCapacity):
        delay.admit(1400, fleet)  # 6,600 / 1,300 > 5 s (by a's measured rate it would pass)
    # a's model not fitted (an engine restarted, or an older one): its measured rate again.
    unfitted = [worker("a", tokens=2000, seconds=1.0), fleet[1]]
    assert delay.rate(unfitted) == pytest.approx(2500)
    delay.admit(1400, unfitted)


def test_an_instance_with_neither_rate_is_never_the_reason_to_refuse() -> None:
    delay = QueueDelay(max_delay_s=1)
    fresh = [worker("p")]
    delay.observe(fresh, now=0)
    delay.started(10**6)
    assert delay.predict(10**6, fresh) is None
    delay.admit(10**6, fresh)
    # Unhealthy instances' model rates do not count; decode instances prefill when no
    # prefill instance is healthy.
    fleet = [worker("p", model_rate=1000.0, healthy=False),
             worker("d", model_rate=300.0, prefills=False)]
    assert delay.rate(fleet) == pytest.approx(300)
