"""The scheduler, driven by hand: schedule a step, then do what the engine does with it.

`run_step` plays the engine: every scheduled sequence computes its `num_new_tokens`; one that
has caught up with its tokens samples one more (and finishes at `max_tokens`). After each step
the block accounting is checked against the pool: a block's ref count equals the number of
sequences holding it, and exactly the unreferenced blocks sit in the free queue.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest

from pdmesh.engine.block_hash import HashScheme
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.scheduler import (
    Policy,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    WaitingQueue,
)
from pdmesh.engine.scheduling.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.fast

BS = 4


def make_scheduler(
    num_blocks: int,
    *,
    budget: int = 64,
    max_num_seqs: int = 16,
    chunked: bool = True,
    policy: Policy = "fcfs",
    max_model_len: int = 64,
    prefix_caching: bool = True,
    threshold: int = 0,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, HashScheme(block_size=BS), prefix_caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        policy=policy,
        long_prefill_token_threshold=threshold,
    )
    return Scheduler(config, kv, max_model_len)


def prompt(tag: int, n: int) -> list[int]:
    """`n` prompt tokens that no other tag shares."""
    return [tag * 1000 + i for i in range(n)]


def make_seq(
    seq_id: str,
    tokens: list[int],
    *,
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival: float = 0.0,
    salt: str | None = None,
    index: int = 0,
) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=seq_id.split("/")[0],
        index=index,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=SamplingParams(max_tokens=max_tokens),
        priority=priority,
        arrival_time=arrival,
        cache_salt=salt,
    )


def sampled_token(seq: Sequence) -> int:
    """Deterministic 'sampling'; samples of one request (index) diverge."""
    return 50_000 + 100 * seq.index + seq.num_tokens


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    pool = kv.pool
    holders: Counter[int] = Counter()
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        ids = kv.block_ids(seq.seq_id)
        assert len(ids) >= kv.num_blocks_for(seq.num_computed_tokens), seq.seq_id
        assert len(set(ids)) == len(ids)
        holders.update(ids)
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert not kv.has_blocks(seq.seq_id), f"waiting {seq.seq_id} still holds blocks"
        assert seq.num_computed_tokens == 0
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], block
    free_ids = [b.block_id for b in pool.free_queue]
    assert sorted(free_ids) == [b.block_id for b in pool.blocks if b.ref_cnt == 0]
    assert pool.num_free_blocks == len(free_ids)
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash


def check_output(sched: Scheduler, out: SchedulerOutput, running_before: set[str]) -> None:
    config = sched.config
    assert out.num_batched_tokens <= config.max_num_batched_tokens
    ids = [e.seq.seq_id for e in out.scheduled]
    assert len(ids) == len(set(ids)), "a sequence was scheduled twice"
    if any(i not in running_before for i in ids):  # something was admitted
        assert len(sched.running) <= config.max_num_seqs
    for entry in out.scheduled:
        seq = entry.seq
        assert entry.num_new_tokens >= 1
        assert seq in sched.running
        end = seq.num_computed_tokens + entry.num_new_tokens
        assert end <= seq.num_tokens
        assert len(sched.kv.block_ids(seq.seq_id)) * BS >= end, "no slot for a new token"
        if not config.enable_chunked_prefill and seq.num_computed_tokens < seq.num_prompt_tokens:
            assert end == seq.num_tokens, "a prompt was chunked with chunking disabled"


def run_step(
    sched: Scheduler, on_caught_up: Callable[[Sequence], None] | None = None
) -> SchedulerOutput:
    """One engine step: schedule, compute, sample; returns what the scheduler decided."""
    running_before = {s.seq_id for s in sched.running}
    out = sched.schedule()
    check_output(sched, out, running_before)
    for entry in out.scheduled:
        seq = entry.seq
        seq.num_computed_tokens += entry.num_new_tokens
        if seq.num_computed_tokens < seq.num_tokens:
            continue  # a prompt chunk (or recompute) still in progress
        if on_caught_up is not None:
            on_caught_up(seq)
        append_token(sched, seq, sampled_token(seq))
    check_invariants(sched)
    return out


def append_token(sched: Scheduler, seq: Sequence, token: int) -> None:
    seq.token_ids.append(token)
    max_tokens = seq.params.max_tokens
    if max_tokens is not None and seq.num_output_tokens >= max_tokens:
        sched.finish(seq, SequenceStatus.FINISHED_LENGTH)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled]


def assert_all_blocks_returned(sched: Scheduler, seqs: list[Sequence]) -> None:
    kv = sched.kv
    assert sched.num_unfinished == 0
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not any(kv.has_blocks(s.seq_id) for s in seqs)


# -- budgets ------------------------------------------------------------------------------------


def test_empty_scheduler_schedules_nothing() -> None:
    sched = make_scheduler(4)
    out = sched.schedule()
    assert out.is_empty and out.preempted == [] and out.num_batched_tokens == 0


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(policy="lifo")  # type: ignore[arg-type]


def test_token_budget_and_max_num_seqs_are_respected() -> None:
    sched = make_scheduler(32, budget=10, max_num_seqs=3)
    seqs = [make_seq(f"s{i}", prompt(i, 5), max_tokens=3) for i in range(6)]
    for seq in seqs:
        sched.add(seq)

    assert plan(run_step(sched)) == [("s0", 5), ("s1", 5)]  # budget exhausted
    assert plan(run_step(sched)) == [("s0", 1), ("s1", 1), ("s2", 5)]  # 3 running: no more
    assert len(sched.running) == 3
    assert plan(run_step(sched)) == [("s0", 1), ("s1", 1), ("s2", 1)]
    # s0 and s1 finished (3 tokens each): two slots open.
    assert plan(run_step(sched)) == [("s2", 1), ("s3", 5), ("s4", 4)]
    for _ in range(20):
        if not sched.num_unfinished:
            break
        run_step(sched)
    assert all(s.num_output_tokens == 3 for s in seqs)
    assert_all_blocks_returned(sched, seqs)


def test_chunked_prefill_splits_a_long_prompt_and_mixes_it_with_decodes() -> None:
    sched = make_scheduler(32, budget=8)
    short = make_seq("short", prompt(1, 3), max_tokens=10)
    long = make_seq("long", prompt(2, 20), max_tokens=2)
    sched.add(short)
    sched.add(long)

    assert plan(run_step(sched)) == [("short", 3), ("long", 5)]
    assert len(sched.kv.block_ids("long")) == 2  # blocks only for the chunk
    assert long.num_output_tokens == 0
    assert plan(run_step(sched)) == [("short", 1), ("long", 7)]
    assert len(sched.kv.block_ids("long")) == 3
    assert plan(run_step(sched)) == [("short", 1), ("long", 7)]
    assert long.num_output_tokens == 0
    assert plan(run_step(sched)) == [("short", 1), ("long", 1)]  # the last prompt token
    assert long.num_output_tokens == 1
    assert plan(run_step(sched)) == [("short", 1), ("long", 1)]  # decodes together
    assert long.status is SequenceStatus.FINISHED_LENGTH
    assert plan(run_step(sched)) == [("short", 1)]


def test_long_prefill_token_threshold_lets_prompts_share_a_step() -> None:
    """vLLM's long_prefill_token_threshold: no prompt takes more than that many tokens a step,
    so a second prompt starts beside a long one instead of waiting for all of it."""
    sched = make_scheduler(32, budget=16, threshold=6)
    long = make_seq("long", prompt(1, 20), max_tokens=2)
    other = make_seq("other", prompt(2, 9), max_tokens=2)
    sched.add(long)
    sched.add(other)
    assert plan(run_step(sched)) == [("long", 6), ("other", 6)]
    assert plan(run_step(sched)) == [("long", 6), ("other", 3)]  # decodes are not capped
    assert plan(run_step(sched)) == [("long", 6), ("other", 1)]
    assert plan(run_step(sched)) == [("long", 2)]
    for _ in range(5):
        if not sched.num_unfinished:
            break
        run_step(sched)
    assert_all_blocks_returned(sched, [long, other])
    uncapped = make_scheduler(32, budget=16)
    uncapped.add(make_seq("long", prompt(1, 20), max_tokens=2))
    uncapped.add(make_seq("other", prompt(2, 9), max_tokens=2))
    assert plan(run_step(uncapped)) == [("long", 16)]  # the whole budget, the other waits
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        SchedulerConfig(long_prefill_token_threshold=8, enable_chunked_prefill=False)


def test_no_chunking_when_disabled() -> None:
    sched = make_scheduler(32, budget=16, chunked=False, max_model_len=16)
    first = make_seq("first", prompt(1, 10), max_tokens=4)
    second = make_seq("second", prompt(2, 10), max_tokens=4)
    third = make_seq("third", prompt(3, 3), max_tokens=4)
    for seq in (first, second, third):
        sched.add(seq)

    # 6 tokens of budget remain, but `second` is not split; FCFS keeps `third` behind it.
    assert plan(run_step(sched)) == [("first", 10)]
    assert second.num_computed_tokens == 0 and not sched.kv.has_blocks("second")
    assert plan(run_step(sched)) == [("first", 1), ("second", 10), ("third", 3)]
    for _ in range(10):
        if not sched.num_unfinished:
            break
        run_step(sched)
    assert_all_blocks_returned(sched, [first, second, third])


def test_disabling_chunked_prefill_requires_a_budget_covering_max_model_len() -> None:
    """Regression: with chunking off, a prompt longer than the token budget
    is never admitted and, FCFS, blocks every request queued behind it; the engine only notices
    once nothing else runs ("scheduler made no progress"). Such a config must be refused."""
    kv = KVCacheManager(64, HashScheme(block_size=BS))
    config = SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(config, kv, max_model_len=64)


# -- prefix caching through the scheduler ----------------------------------------------------------


def test_prefix_hits_skip_cached_blocks_and_are_counted_once() -> None:
    sched = make_scheduler(32)
    first = make_seq("first", prompt(1, 10), max_tokens=5)
    sched.add(first)
    assert plan(run_step(sched)) == [("first", 10)]

    same = make_seq("same", prompt(1, 10), max_tokens=2)
    aligned = make_seq("aligned", prompt(1, 8), max_tokens=2)
    sched.add(same)
    sched.add(aligned)
    out = run_step(sched)
    # 8 of 10 tokens cached; for the block-aligned prompt the last block is recomputed.
    assert plan(out) == [("first", 1), ("same", 2), ("aligned", 4)]
    assert (same.num_cached_tokens, aligned.num_cached_tokens) == (8, 4)
    first_ids = sched.kv.block_ids("first")
    assert sched.kv.block_ids("same")[:2] == first_ids[:2]
    assert sched.kv.block_ids("aligned")[:1] == first_ids[:1]
    stats = sched.kv.stats
    assert (stats.queries, stats.hits) == (10 + 10 + 8, 8 + 4)
    assert stats.hit_rate == pytest.approx(12 / 28)


def test_preempted_sequence_recomputes_from_its_own_cached_blocks() -> None:
    sched = make_scheduler(5)
    older = make_seq("older", prompt(1, 8), max_tokens=2, arrival=0.0)
    newer = make_seq("newer", prompt(2, 8), max_tokens=4, arrival=1.0)
    sched.add(older)
    sched.add(newer)
    run_step(sched)  # both prefilled: 9 tokens each, 4 of 5 blocks used
    out = run_step(sched)  # both need a third block: only one is free
    assert out.preempted == [newer]
    assert plan(out) == [("older", 1)]
    assert older.status is SequenceStatus.FINISHED_LENGTH

    out = run_step(sched)
    # Both of newer's full blocks were still cached: only the last token is recomputed.
    assert plan(out) == [("newer", 1)]
    assert newer.num_computed_tokens == 9
    assert newer.num_output_tokens == 2
    # Counters count each request once, at its first schedule.
    assert (sched.kv.stats.queries, sched.kv.stats.hits) == (16, 0)
    assert newer.num_cached_tokens == 0


# -- preemption ---------------------------------------------------------------------------------


def test_fcfs_preempts_the_newest_running_sequence() -> None:
    sched = make_scheduler(6)
    preempted: list[Sequence] = []
    sched.on_preempt = preempted.append
    a = make_seq("a", prompt(1, 7), max_tokens=3, arrival=0.0)
    b = make_seq("b", prompt(2, 7), max_tokens=8, arrival=1.0)
    c = make_seq("c", prompt(3, 7), max_tokens=4, arrival=2.0)
    d = make_seq("d", prompt(4, 7), max_tokens=2, arrival=3.0)
    for seq in (a, b, c, d):
        sched.add(seq)

    assert plan(run_step(sched)) == [("a", 7), ("b", 7), ("c", 7)]  # d: no blocks left
    assert plan(run_step(sched)) == [("a", 1), ("b", 1), ("c", 1)]  # token 8 fits block 2
    c_blocks = sched.kv.block_ids("c")
    assert len(c_blocks) == 2

    out = run_step(sched)  # everyone needs a third block; none is free
    assert out.preempted == [c]
    assert preempted == [c]
    assert plan(out) == [("a", 1), ("b", 1)]
    assert c.status is SequenceStatus.WAITING
    assert c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert c.num_output_tokens == 2  # generated tokens survive; they are recomputed
    assert not sched.kv.has_blocks("c")
    # c's blocks were freed tail-first, so a got c's second block and b its first; a then
    # finished (3 tokens) and returned its 3 blocks.
    assert sched.kv.block_ids("b")[2] == c_blocks[0]
    assert a.status is SequenceStatus.FINISHED_LENGTH
    assert sched.kv.num_free_blocks == 3
    assert list(sched.waiting) == [c, d]  # back to the front, ahead of d

    # a finished (3 tokens): its 3 blocks let c back in, recomputing prompt + outputs.
    out = run_step(sched)
    assert plan(out) == [("b", 1), ("c", 9)]
    assert out.preempted == []
    assert list(sched.waiting) == [d]
    for _ in range(30):
        if not sched.num_unfinished:
            break
        run_step(sched)
    assert [s.num_output_tokens for s in (a, b, c, d)] == [3, 8, 4, 2]
    assert preempted == [c]  # no further preemption was needed
    assert_all_blocks_returned(sched, [a, b, c, d])


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "newest"), ("priority", "unimportant")])
def test_victim_is_the_newest_or_the_least_important(policy: Policy, victim: str) -> None:
    sched = make_scheduler(3, policy=policy)
    seqs = {
        "first": make_seq("first", prompt(1, 4), priority=0, arrival=0.0),
        "unimportant": make_seq("unimportant", prompt(2, 3), priority=5, arrival=1.0),
        "newest": make_seq("newest", prompt(3, 3), priority=1, arrival=2.0),
    }
    for seq in seqs.values():
        sched.add(seq)
    run_step(sched)  # all three prefilled, one block each; "first" needs a second block next

    out = run_step(sched)
    assert out.preempted == [seqs[victim]]
    survivor = "newest" if victim == "unimportant" else "unimportant"
    assert sorted(plan(out)) == sorted([("first", 1), (survivor, 1)])
    assert seqs[victim].status is SequenceStatus.WAITING
    assert not sched.kv.has_blocks(victim)


def test_priority_preempts_the_less_important_sequence_even_if_it_runs_first() -> None:
    """Regression: running sequences are served in admission order and a
    sequence already served this step cannot be a victim, so a more important sequence that was
    admitted later is preempted in favour of a less important one (priority inversion)."""
    sched = make_scheduler(3, policy="priority")
    low = make_seq("low", prompt(1, 4), priority=5, arrival=0.0)
    high = make_seq("high", prompt(2, 4), priority=0, arrival=1.0)
    sched.add(low)
    run_step(sched)  # low runs alone
    sched.add(high)
    assert plan(run_step(sched)) == [("low", 1), ("high", 4)]  # now no block is free

    out = run_step(sched)  # both need a second block
    assert out.preempted == [low]
    assert ("high", 1) in plan(out)


def test_priority_waiting_sequence_preempts_a_less_important_running_one() -> None:
    """Regression: `_preempt_for` promises that a more important waiting
    sequence may evict a running one, but it only considers running sequences not served this
    step, and every running sequence with work is served first, so it never fires."""
    sched = make_scheduler(4, policy="priority")
    low = make_seq("low", prompt(1, 12), priority=5, arrival=0.0, max_tokens=40)
    high = make_seq("high", prompt(2, 8), priority=0, arrival=1.0)
    sched.add(low)
    run_step(sched)  # low: 3 of 4 blocks
    sched.add(high)  # needs 2 blocks

    out = run_step(sched)
    assert out.preempted == [low]
    assert ("high", 8) in plan(out)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", ["a", "b", "c", "d"]), ("priority", ["b", "d", "c", "a"])],
)
def test_admission_order(policy: Policy, expected: list[str]) -> None:
    sched = make_scheduler(16, max_num_seqs=1, policy=policy)
    priorities = {"a": 2, "b": 0, "c": 1, "d": 0}
    for arrival, (name, priority) in enumerate(priorities.items()):
        sched.add(
            make_seq(
                name, prompt(arrival, 3), max_tokens=1, priority=priority, arrival=float(arrival)
            )
        )
    order = []
    for _ in range(4):
        (entry,) = run_step(sched).scheduled
        order.append(entry.seq.seq_id)
    assert order == expected
    assert sched.num_unfinished == 0


def test_priority_waiting_queue_keeps_preempted_sequences_in_priority_order() -> None:
    queue = WaitingQueue("priority")
    late_important = make_seq("late-important", [1], priority=0, arrival=5.0)
    early = make_seq("early", [1], priority=1, arrival=1.0)
    preempted = make_seq("preempted", [1], priority=1, arrival=0.0)
    queue.add(early)
    queue.add(late_important)
    queue.add(preempted, front=True)  # priority order wins over "front"
    assert list(queue) == [late_important, preempted, early]
    assert queue.remove(early) and not queue.remove(early)
    assert queue.pop() is late_important
    assert queue.peek() is preempted and len(queue) == 1


# -- finish and abort -----------------------------------------------------------------------------


def test_finish_and_abort_return_every_block() -> None:
    sched = make_scheduler(12, budget=8)
    shared = prompt(1, 9)
    done = make_seq("done", shared, max_tokens=2)
    sharer = make_seq("sharer", [*shared, 5], max_tokens=50)
    mid_prefill = make_seq("mid-prefill", prompt(2, 20), max_tokens=50)
    queued = make_seq("queued", prompt(3, 5), max_tokens=50)
    seqs = [done, sharer, mid_prefill, queued]
    for seq in seqs:
        sched.add(seq)
    for _ in range(3):
        run_step(sched)
    assert done.status is SequenceStatus.FINISHED_LENGTH
    assert sharer.num_cached_tokens == 8
    assert 0 < mid_prefill.num_computed_tokens < mid_prefill.num_prompt_tokens
    assert queued.status is SequenceStatus.WAITING

    for seq in (queued, mid_prefill, sharer):
        sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        check_invariants(sched)
    assert queued.status is SequenceStatus.FINISHED_ABORTED
    assert_all_blocks_returned(sched, seqs)
    assert sched.schedule().is_empty
    # The computed full blocks are still findable for the next request.
    again = make_seq("again", [*shared, 5])
    assert len(sched.kv.find_cached_prefix(again)) == 2


# -- a random workload against a simulated KV cache ---------------------------------------------


class SimulatedKV:
    """What each KV slot holds: the identity of the token prefix computed there.

    A step first writes the new tokens of every scheduled sequence, then checks that each one
    reads back exactly its own prefix — as a model writes a layer's KV before attending. A
    prefix hit on a wrong block, a block freed while still in use, or a fork sharing a block that
    is then written would all show up as a wrong read.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.slots: dict[tuple[int, int], tuple[str | None, tuple[int, ...]]] = {}

    @staticmethod
    def key(seq: Sequence, pos: int) -> tuple[str | None, tuple[int, ...]]:
        return seq.cache_salt, tuple(seq.token_ids[: pos + 1])

    def _slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return self.kv.block_ids(seq.seq_id)[pos // BS], pos % BS

    def run(self, out: SchedulerOutput) -> None:
        for entry in out.scheduled:
            seq, start = entry.seq, entry.seq.num_computed_tokens
            for pos in range(start, start + entry.num_new_tokens):
                self.slots[self._slot(seq, pos)] = self.key(seq, pos)
        for entry in out.scheduled:
            seq = entry.seq
            for pos in range(seq.num_computed_tokens + entry.num_new_tokens):
                got = self.slots.get(self._slot(seq, pos))
                assert got == self.key(seq, pos), f"{seq.seq_id} reads a wrong KV at {pos}"

    def copy_block(self, src: int, dst: int) -> None:
        for offset in range(BS):
            if (src, offset) in self.slots:
                self.slots[(dst, offset)] = self.slots[(src, offset)]
            else:
                self.slots.pop((dst, offset), None)


class Workload:
    """Engine stand-in for the random test: runs steps and fans `n = 2` requests out by forking."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.sim = SimulatedKV(sched.kv)
        self.all: list[Sequence] = []
        self.num_forks = 0

    def step(self) -> SchedulerOutput:
        running_before = {s.seq_id for s in self.sched.running}
        out = self.sched.schedule()
        check_output(self.sched, out, running_before)
        self.sim.run(out)
        for entry in out.scheduled:
            seq = entry.seq
            seq.num_computed_tokens += entry.num_new_tokens
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            if seq.fork_into > 1 and seq.num_output_tokens == 0:
                self._fork(seq)
            append_token(self.sched, seq, sampled_token(seq))
        check_invariants(self.sched)
        return out

    def _fork(self, parent: Sequence) -> None:
        parent.fork_into = 1
        child = make_seq(
            f"{parent.request_id}/1",
            parent.token_ids,
            max_tokens=parent.params.max_tokens,
            priority=parent.priority,
            arrival=parent.arrival_time,
            salt=parent.cache_salt,
            index=1,
        )
        child.num_prompt_tokens = parent.num_prompt_tokens
        self.all.append(child)
        try:
            copy = self.sched.kv.fork(parent, child)
        except RuntimeError:
            self.sched.add(child)  # no block for copy-on-write: recompute later
            return
        if copy is not None:
            self.sim.copy_block(*copy)
        child.num_computed_tokens = parent.num_computed_tokens
        child.scheduled_once = True
        self.sched.add_running(child)
        self.num_forks += 1
        append_token(self.sched, child, sampled_token(child))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_keeps_the_kv_cache_consistent(policy: Policy, seed: int) -> None:
    rng = random.Random(seed)
    sched = make_scheduler(12, budget=16, max_num_seqs=6, policy=policy, max_model_len=40)
    work = Workload(sched)
    bases = [prompt(100 + t, 12) for t in range(3)]
    arrivals: dict[int, list[Sequence]] = {}
    for i in range(30):
        tokens = rng.choice(bases)[: rng.randint(0, 12)] + prompt(200 + i, rng.randint(1, 8))
        seq = make_seq(
            f"r{i}",
            tokens,
            max_tokens=rng.randint(1, 12),
            priority=rng.randint(0, 3),
            arrival=float(i),
            salt=rng.choice([None, None, "tenant"]),
        )
        seq.fork_into = 2 if rng.random() < 0.25 else 1
        arrivals.setdefault(rng.randrange(40), []).append(seq)
    work.all = [s for group in arrivals.values() for s in group]
    aborted: set[str] = set()

    for step in range(2000):
        for seq in arrivals.pop(step, []):
            sched.add(seq)
        unfinished = [*sched.running, *sched.waiting]
        if unfinished and rng.random() < 0.03:
            victim = rng.choice(unfinished)
            sched.finish(victim, SequenceStatus.FINISHED_ABORTED)
            aborted.add(victim.seq_id)
            check_invariants(sched)
        if not arrivals and not sched.num_unfinished:
            break
        out = work.step()
        assert not (out.is_empty and sched.waiting and not sched.running), "no progress"
    else:
        pytest.fail("the workload did not finish")

    for seq in work.all:
        if seq.seq_id not in aborted:
            assert seq.status is SequenceStatus.FINISHED_LENGTH, seq.seq_id
            assert seq.num_output_tokens == seq.params.max_tokens, seq.seq_id
    assert_all_blocks_returned(sched, work.all)
    # The workload must actually exercise what it claims to.
    assert sched.num_preemptions > 0
    assert sched.kv.stats.hits > 0
    assert work.num_forks > 0
