"""What a worker reports in its heartbeats: produced on the engine thread, read
on the event loop, with no lock and nothing lost between the two.

The engine thread publishes immutable `EngineSnapshot`s; publishing is one
attribute assignment, so a reader sees the old snapshot or the new one, never
a mix. Step samples (pdd.api.StepSample) and published block hashes go into
`Journal`s: bounded logs that count every entry ever appended.
A snapshot carries each journal's newest entries with that count, and the
heartbeat (`HeartbeatReader`) remembers how far it has read, so it sends each
entry once. The reader never clears what the writer appends: a take-and-clear
across threads loses whatever is appended between the take and the clear.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdd import ops
from pdd.api import StepSample
from pdd.protocol import messages as m

# Entries a journal keeps: more than a heartbeat interval produces at any
# realistic step rate. Past that the oldest are dropped, not queued forever.
_MAX_SAMPLES = 2048
_MAX_HASHES = 4096


@dataclass(frozen=True)
class JournalView:
    end: int = 0                 # entries ever appended
    items: tuple = ()            # the newest of them, oldest first


class Journal:
    """Append-only for its one writer (the engine thread); see JournalView."""

    def __init__(self, maxlen: int):
        self._items: deque = deque(maxlen=maxlen)
        self._end = 0

    def extend(self, items: Sequence) -> None:
        self._items.extend(items)
        self._end += len(items)

    def view(self) -> JournalView:
        return JournalView(self._end, tuple(self._items))


class JournalCursor:
    """A reader's position in a journal."""

    def __init__(self):
        self.position = 0

    def take(self, view: JournalView) -> list:
        """The entries of `view` not taken yet (those the journal still keeps)."""
        new = min(view.end - self.position, len(view.items))
        if new <= 0:
            return []   # nothing new, or an older view than one already read
        self.position = view.end
        return list(view.items[len(view.items) - new:])


@dataclass(frozen=True)
class EngineSnapshot:
    running: int = 0
    decoding: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    prefix_hit_rate: float = 0.0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    num_preemptions: int = 0
    steps_completed: int = 0
    steps: JournalView = JournalView()            # StepSamples of the steps that computed tokens
    prefill_tokens_pending: int = 0
    long_prefill_tokens_pending: int = 0       # of those, long prompts' (PromptsPending)
    long_prefills_pending: int = 0
    recent_hashes: JournalView = JournalView()
    transfer: dict = field(default_factory=dict)
    kernels_compiled_in_service: int = 0


class EngineStats:
    """The engine thread's side: records each step, builds snapshots."""

    def __init__(self):
        self.steps_completed = 0
        self.steps = Journal(_MAX_SAMPLES)
        self.recent_hashes = Journal(_MAX_HASHES)

    def record(self, step: StepSample) -> None:
        self.steps_completed += 1
        if step.num_tokens:   # a step that computed nothing only took the results of the one before
            self.steps.extend((step,))

    def snapshot(self, engine, transfer: dict) -> EngineSnapshot:
        """Called on the engine's thread, which is also the one to take the
        hashes the prefix cache published (by steps, or by a request whose KV landed)."""
        sched, kv = engine.scheduler, engine.kv
        self.recent_hashes.extend(kv.take_recent_hashes())
        pending = PromptsPending.of(sched)
        return EngineSnapshot(
            running=len(sched.running), decoding=sum(1 for r in sched.running if r.decoding),
            waiting=sched.num_waiting(), free_blocks=kv.num_free_blocks,
            total_blocks=kv.pool.num_usable_blocks, prefix_hit_rate=kv.hit_rate(),
            prefix_hit_tokens=kv.num_hit_tokens, prefix_query_tokens=kv.num_queried_tokens,
            num_preemptions=sched.num_preemptions, steps_completed=self.steps_completed,
            steps=self.steps.view(), prefill_tokens_pending=pending.tokens,
            long_prefill_tokens_pending=pending.long_tokens, long_prefills_pending=pending.long_prompts,
            recent_hashes=self.recent_hashes.view(),
            transfer=transfer, kernels_compiled_in_service=ops.compiles_reported())


@dataclass(frozen=True)
class PromptsPending:
    """Prompt tokens this engine has yet to compute, and of them the long
    prompts' (more than engine.long_prefill_token_threshold left, as the
    scheduler tells them apart): the router's queue-wait estimate. A waiting
    prompt counts whole, prefix-cache hits included (they are found only when
    it is admitted)."""
    tokens: int = 0
    long_tokens: int = 0
    long_prompts: int = 0

    @classmethod
    def of(cls, sched) -> PromptsPending:
        """One pass over the queues, made per snapshot (while busy at most
        every engine_thread.SNAPSHOT_PERIOD_S, not every step)."""
        threshold = sched.cfg.long_prefill_token_threshold or 0
        tokens = long_tokens = long_prompts = 0
        for q in (sched.waiting, sched.running):
            for r in q:
                left = max(0, r.num_prompt_tokens - r.num_computed_tokens)
                tokens += left
                if threshold and left > threshold:
                    long_tokens += left
                    long_prompts += 1
        return cls(tokens, long_tokens, long_prompts)


class HeartbeatReader:
    """The event loop's side: a heartbeat from the latest snapshot, with the
    journal entries that no earlier heartbeat carried."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self._steps, self._hashes = JournalCursor(), JournalCursor()

    def heartbeat(self, snap: EngineSnapshot, step_running_s: float, draining: bool,
                  faults: dict[str, float] | None = None) -> m.Heartbeat:
        return m.Heartbeat(
            worker_id=self.worker_id, running=snap.running, waiting=snap.waiting,
            free_blocks=snap.free_blocks, total_blocks=snap.total_blocks,
            prefix_hit_rate=snap.prefix_hit_rate, num_preemptions=snap.num_preemptions,
            prefix_hit_tokens=snap.prefix_hit_tokens, prefix_query_tokens=snap.prefix_query_tokens,
            steps=self._steps.take(snap.steps), prefill_tokens_pending=snap.prefill_tokens_pending,
            decoding=snap.decoding, recent_hashes=self._hashes.take(snap.recent_hashes), transfer=snap.transfer,
            draining=draining, steps_completed=snap.steps_completed, step_running_s=step_running_s,
            faults=faults or {}, kernels_compiled_in_service=snap.kernels_compiled_in_service,
            long_prefill_tokens_pending=snap.long_prefill_tokens_pending,
            long_prefills_pending=snap.long_prefills_pending)
