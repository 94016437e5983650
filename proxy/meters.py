"""Every family ``/metrics`` shows, declared once: the engine's (``EngineMeter``, counted
on the engine thread), the HTTP side's (``ApiMeter``), and the checkpoint pool's report
(``pool_families``: ``CheckpointPool.stats()`` read at each scrape, mapped field by
field).
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.meter import Counter, Family, Gauge, Histogram
from statecache.pool import PoolStats
from statecache.tiers.tier import StoreStats

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_BUCKETS = (1.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)


class EngineMeter:
    """The engine's counters (and its gauges, set when read)."""

    def __init__(self) -> None:
        self.requests = Counter("statecache_requests_total", "Generation requests finished.")
        self.by_source = Counter(
            "statecache_requests_by_source_total",
            "Requests by where their starting state came from (cold, lane, ram, disk).",
            ["source"])
        self.hits = Counter("statecache_cache_hits_total",
                            "Requests that reused state, by source and role of the checkpoint "
                            "used.", ["source", "role"])
        self.misses = Counter("statecache_misses_total",
                              "Requests that reused less than an earlier request held, by "
                              "cause.", ["cause"])
        self.tokens_prompt = _Untyped("statecache_tokens_prompt",
                                      "Engine metric 'tokens_prompt'.")
        self.tokens_prefilled = Counter("statecache_prefilled_tokens_total",
                                        "Prompt tokens run through the model.")
        self.tokens_reused = Counter("statecache_reused_tokens_total",
                                     "Prompt tokens served from a kept or restored state.")
        self.tokens_generated = Counter("statecache_generated_tokens_total", "Tokens generated.")
        self.spec_tokens = Counter(
            "statecache_speculative_tokens_total",
            "Speculative decoding: tokens drafted, and those the target accepted.", ["what"])
        self.spec_verifications = Counter("statecache_speculative_verifications_total",
                                          "Decode steps of a lane that verified drafts.")
        self.spec_replays = Counter(
            "statecache_speculative_replays_total",
            "Rejections undone by restoring a staged state (memories without rollback).")
        self.draft_events = Counter(
            "statecache_draft_lane_events_total",
            "The draft model's lanes: rollbacks, restores of its partial checkpoints, clears, "
            "checkpoints saved.", ["event"])
        self.draft_total = Counter(
            "statecache_draft_total",
            "The draft model: tokens it decoded, bytes of its partial checkpoints saved.",
            ["what"])
        self.share_points = Counter(
            "statecache_share_points_total",
            "FULL checkpoints published where a prompt's first-turn messages start, for new "
            "conversations that share them.")
        self.ttft = Histogram("statecache_ttft_seconds",
                              "Time to first token of generation requests, from arrival at "
                              "the engine (queue, restore and prefill).", TTFT_BUCKETS)
        self.decode_rate = Histogram("statecache_decode_tokens_per_second",
                                     "Decode rate of each request that generated two tokens or "
                                     "more, from its first token to its last.", RATE_BUCKETS)
        self.queue_depth = Gauge("statecache_queue_depth", "Requests waiting for a lane.")
        self.active_requests = Gauge("statecache_active_requests",
                                     "Requests holding a lane now.")
        self.lanes = Gauge("statecache_lanes", "Lanes (llama.cpp sequences).")
        self.rejected_busy = Counter("statecache_rejected_busy_total",
                                     "Requests refused with 503: lanes and queue full.")
        self.checkpoints_saved = Counter("statecache_checkpoints_saved_total",
                                         "Checkpoints published.")
        self.checkpoint_bytes_saved = Counter("statecache_checkpoint_bytes_saved_total",
                                              "Bytes of checkpoints published.")
        self.restore_failures = Counter("statecache_restore_failures_total",
                                        "Checkpoint restores that failed (fell back cold).")
        self.handoffs = Counter("statecache_handoffs_total",
                                "Lane states handed to the pool to free a lane.")
        self.owed_checkpoints = Counter(
            "statecache_owed_checkpoints_total",
            "Checkpoints a prefill passed without stopping (a lane cut back anywhere), taken "
            "from the lane when it was cut back or replaced.")
        self.owed_checkpoints_lost = Counter(
            "statecache_owed_checkpoints_lost_total",
            "Checkpoints a lane owed and could no longer take: its cells no longer reach "
            "back there (a window-sized SWA lane gone on, a restored SWA state's floor).")
        self.behind_checkpoints = Counter(
            "statecache_behind_checkpoints_total",
            "Checkpoints inside a prefill step of a window-sized SWA cache, saved after the "
            "step from the saves around it (no step ended there).")
        self.behind_checkpoints_lost = Counter(
            "statecache_behind_checkpoints_lost_total",
            "Checkpoints inside a step that the saves around it could not make: the lane's "
            "cells did not reach a window back from them.")
        self.share_points_on_grid = Counter(
            "statecache_share_points_on_grid_total",
            "A hybrid's first-turn and share points moved down to a step's end "
            "(cache.share_grid_tokens), or dropped there.")
        self.replaced_replies = Counter("statecache_replaced_replies_total",
                                        "Lane states cut back unsaved: the request held the last "
                                        "one's history and replaced its turn.")
        self.replies_spliced = Counter("statecache_replies_spliced_total",
                                       "Replies whose generated ids were spliced in.")
        self.steps = Counter("statecache_steps_total",
                             "Engine steps: one llama_decode each, for every lane.")
        self.step_tokens = Counter("statecache_step_tokens_total",
                                   "Tokens decoded in engine steps (all lanes).")
        self.step_lane_work = Counter("statecache_step_lane_work_total",
                                      "Lanes served by engine steps, summed over steps.")
        self.steps_multi_lane = Counter("statecache_steps_multi_lane_total",
                                        "Engine steps that carried more than one lane.")
        self.steps_alone = Counter("statecache_steps_alone_total",
                                   "Engine steps of a lone decoding stream, run without planning "
                                   "each one.")
        self.idle_saves = Counter("statecache_idle_saves_total",
                                  "Idle lanes whose state was saved in full.")
        self.lanes_kept_in_line = Counter("statecache_lanes_kept_in_line_total",
                                          "Requests started in another free lane than their "
                                          "plan's, so the busy lanes stay one run of ids.")
        self.lane_copies = Counter("statecache_lane_copies_total",
                                   "Live lane states copied to such a lane at the start of a "
                                   "request.")
        self.lane_moves = Counter("statecache_lane_moves_total",
                                  "Decoding requests moved into the gap a finished request left "
                                  "among the busy lanes.")
        self.cancelled_queued = Counter("statecache_cancelled_queued_total",
                                        "Requests whose client left while queued.")
        self.waits_for_shared_prefix = Counter("statecache_waits_for_shared_prefix_total",
                                               "Requests that waited for another one's checkpoint "
                                               "of a prefix they share.")
        self.fetches_in_background = Counter("statecache_fetches_in_background_total",
                                             "Checkpoints read from disk or the shared store on "
                                             "the fetch thread while other requests ran.")
        self.prewarms = Counter("statecache_prewarms_total",
                                "Pre-warm requests (max_tokens 0) served: prefilled and cached, "
                                "nothing generated.")
        self.prewarms_dropped = Counter("statecache_prewarms_dropped_total",
                                        "Waiting pre-warms dropped (503) to make room in a full "
                                        "queue for a request that generates.")
        self.spec_rests = Counter("statecache_spec_rests_total",
                                  "Lanes that stopped drafting: drafts did not pay there (or "
                                  "prompt lookup kept finding nothing).")
        self.spec_probes = Counter("statecache_spec_probes_total",
                                   "Drafts a resting lane tried, to see whether drafting pays "
                                   "again.")

    def families(self) -> list[Family]:
        return [v for v in vars(self).values() if isinstance(v, Family)]


class _Untyped(Counter):
    """A counter shown as ``untyped``, as it always was."""

    kind = "untyped"


class ApiMeter:
    """The HTTP side's counters."""

    def __init__(self) -> None:
        self.http = Counter("statecache_http_requests_total",
                            "HTTP requests answered, by route and status code.",
                            ["route", "code"])
        self.hosted_tools = Counter(
            "statecache_hosted_tools_ignored_total",
            "Hosted tools (run by the API's own servers) left out of prompts, by type.",
            ["type"])
        self.volatile = Counter(
            "statecache_volatile_replacements_total",
            "Volatile fragments replaced in message text, per [[server.volatile]] rule.",
            ["rule"])

    def families(self) -> list[Family]:
        return [self.http, self.hosted_tools, self.volatile]


# -- the pool's report ------------------------------------------------------------------

Spec = tuple[str, str, str, tuple[str, ...]]  # (kind, name, help, label names)


def _c(name: str, help_: str, labels: tuple[str, ...] = ()) -> Spec:
    return ("counter", name, help_, labels)


def _g(name: str, help_: str, labels: tuple[str, ...] = ()) -> Spec:
    return ("gauge", name, help_, labels)


_POOL_HITS = _c("statecache_pool_hits_total", "Checkpoint pool hits, per tier.", ("tier",))
_ROLE_HITS = _c("statecache_pool_hits_by_role_total", "Checkpoint pool hits, by checkpoint role.",
                ("role",))
_DROPPED = _c("statecache_pool_dropped_total", "Checkpoints dropped because a KV page they "
              "need went missing or was refused, by reason.", ("reason",))
_BYTES = _g("statecache_checkpoint_bytes", "Bytes of checkpoints held, per tier.", ("tier",))
_BUDGET = _g("statecache_checkpoint_budget_bytes", "Checkpoint budget, per tier.", ("tier",))
_ENTRIES = _g("statecache_checkpoints", "Checkpoints held, per tier.", ("tier",))
_EVICTIONS = _c("statecache_evictions_total", "Checkpoints evicted, per tier.", ("tier",))
_PAGES = _g("statecache_kv_pages", "KV pages held once for the checkpoints that name them, "
            "per tier.", ("tier",))
_PAGE_BYTES = _g("statecache_kv_page_bytes", "Bytes of the KV pages held, per tier (part of "
                 "statecache_checkpoint_bytes).", ("tier",))
_REMOTE = _c("statecache_remote_total",
             "Shared (Redis/Valkey) tier events: probes, hits, writes, write_dupes, "
             "write_drops (queue full), write_skipped, errors, reconnects, rejected.", ("event",))
_REMOTE_BYTES = _c("statecache_remote_bytes_total",
                   "Bytes read from and written to the shared tier.", ("direction",))
_REJECTED = _c("statecache_remote_rejected_total",
               "Shared-tier entries refused by their checks, by reason (foreign_key, forged, "
               "corrupt, missing, stale, tenant, tokens, foreign_model, ...).", ("reason",))
_BANDWIDTH = _g("statecache_read_bandwidth_bytes_per_second",
                "Measured checkpoint read bandwidth per tier, the planner's input (0: not yet).",
                ("tier",))

_WHOLE_STATES = _g("statecache_whole_states",
                   "Checkpoints kept whole in RAM beside their pages (the newest of each "
                   "conversation: a hit on one assembles nothing).")
_WHOLE_BYTES = _g("statecache_whole_state_bytes",
                  "Bytes of the checkpoints kept whole in RAM; their pages are views into "
                  "them, so only the rest adds to statecache_checkpoint_bytes.")
_BAD_STATES = _c("statecache_checkpoint_bad_states_total",
                 "Checkpoints whose assembled state was not the one saved (a miss).")
_REMOTE_UP = _g("statecache_remote_up", "1 while the shared tier answers, 0 while it is off.")
_REMOTE_QUEUE = _g("statecache_remote_write_queue",
                   "Checkpoints waiting to be written to the shared tier.")
_REMOTE_QUEUE_BYTES = _g("statecache_remote_write_queue_bytes",
                         "Bytes waiting to be written to the shared tier.")
_STORE_MISSES = _c("statecache_remote_misses_total",
                   "Remote offers the planner picked that could not be used (refused or gone).")
_PREFILL_TPS = _g("statecache_prefill_tokens_per_second",
                  "Measured prefill rate the planner uses (0: not yet).")
_KEPT = _c("statecache_kept_checkpoints_total",
           "Checkpoints a client's cache breakpoint asked to keep.")
_KEPT_NOW = _g("statecache_kept_checkpoints", "Checkpoints kept now for a client's breakpoint.")
_DISK_WRITES = _c("statecache_disk_writes_total", "Checkpoints written to disk.")
_DISK_WRITE_ERRORS = _c("statecache_disk_write_errors_total",
                        "Checkpoint writes to disk that failed.")
_DIRECT_WRITES = _c("statecache_disk_direct_writes_total",
                    "States larger than the RAM budget sent straight to disk.")
_WRITE_QUEUE = _g("statecache_disk_write_queue",
                  "Checkpoints waiting for the background disk writer.")


# shown untyped, with the names and help they always had
_POOL_ENTRIES = ("untyped", "statecache_pool_entries", "Engine metric 'pool.entries'.", ())
_POOL_PINNED = ("untyped", "statecache_pool_ram_pinned_bytes",
                "Engine metric 'pool.ram_pinned_bytes'.", ())
_POOL_QUARANTINED = ("untyped", "statecache_pool_quarantined",
                     "Engine metric 'pool.quarantined'.", ())
_POOL_INSERTS = ("untyped", "statecache_pool_inserts", "Engine metric 'pool.inserts'.", ())
_POOL_REFRESHES = ("untyped", "statecache_pool_refreshes", "Engine metric 'pool.refreshes'.", ())
_POOL_MISSES = ("untyped", "statecache_pool_misses", "Engine metric 'pool.misses'.", ())
_POOL_SPILLS = ("untyped", "statecache_pool_spills", "Engine metric 'pool.spills'.", ())
_POOL_PROMOTIONS = ("untyped", "statecache_pool_promotions",
                    "Engine metric 'pool.promotions'.", ())
_POOL_REFUSED = ("untyped", "statecache_pool_refused", "Engine metric 'pool.refused'.", ())


def pool_families(stats: PoolStats) -> list[Family]:
    """The pool's report as families, field by field: each tier's figures with its name
    as the ``tier`` label, the shared store's own traffic, the pool's counts."""
    out: dict[str, Family] = {}

    def put(spec: Spec, value: float | None, *labels: str) -> None:
        if value is None:
            return
        kind, name, help_, label_names = spec
        fam = out.get(name)
        if fam is None:
            cls = {"counter": Counter, "gauge": Gauge, "untyped": _Untyped}[kind]
            fam = out[name] = cls(name, help_, label_names)
        fam.put(labels, value)

    for t in (*stats.tiers, *stats.off):  # a tier that is off: its zeros
        put(_POOL_HITS, t.hits, t.name)
        put(_BYTES, t.bytes, t.name)
        put(_BUDGET, t.budget, t.name)
        put(_ENTRIES, t.entries, t.name)
        put(_EVICTIONS, t.evictions, t.name)
        put(_PAGES, t.pages, t.name)
        put(_PAGE_BYTES, t.page_bytes, t.name)
        put(_BANDWIDTH, t.bandwidth, t.name)
        if t.store is not None:
            _store(put, t.store)
    for role, n in stats.counts.hits_by_role.items():
        put(_ROLE_HITS, n, role.name.lower())
    c = stats.counts
    put(_WHOLE_STATES, stats.whole_states)
    put(_WHOLE_BYTES, stats.whole_bytes)
    put(_BAD_STATES, c.bad_states)
    put(_STORE_MISSES, c.store_misses)
    put(_PREFILL_TPS, stats.prefill_tps)
    put(_KEPT, c.kept)
    put(_KEPT_NOW, stats.kept_entries)
    put(_DISK_WRITES, c.disk_writes)
    put(_DISK_WRITE_ERRORS, c.disk_write_errors)
    put(_DIRECT_WRITES, c.direct_writes)
    put(_WRITE_QUEUE, stats.write_queue)
    put(_POOL_ENTRIES, stats.entries)
    put(_POOL_PINNED, stats.pinned_bytes)
    put(_POOL_QUARANTINED, stats.quarantined)
    put(_POOL_INSERTS, c.inserts)
    put(_POOL_REFRESHES, c.refreshes)
    put(_POOL_MISSES, c.misses)
    put(_POOL_SPILLS, c.spills)
    put(_POOL_PROMOTIONS, c.promotions)
    put(_POOL_REFUSED, c.refused)
    for reason in ("missing", "refused"):  # the family whole from the start
        put(_DROPPED, c.dropped.get(reason, 0), reason)
    return list(out.values())


def _store(put: Callable[..., None], s: StoreStats) -> None:
    """A store's traffic: the shared tier's families."""
    put(_REMOTE_BYTES, s.read_bytes, "read")
    put(_REMOTE_BYTES, s.written_bytes, "written")
    put(_REMOTE_UP, int(s.up))
    put(_REMOTE_QUEUE, s.queue)
    put(_REMOTE_QUEUE_BYTES, s.queue_bytes)
    for event, n in (("probes", s.probes), ("hits", s.hits), ("rejected", s.rejected),
                     ("writes", s.writes), ("write_dupes", s.write_dupes),
                     ("write_drops", s.write_drops), ("write_skipped", s.write_skipped),
                     ("errors", s.errors), ("reconnects", s.reconnects),
                     ("pages_written", s.pages_written), ("pages_present", s.pages_present),
                     ("pages_fetched", s.pages_fetched), ("pages_local", s.pages_local),
                     ("skipped", s.skipped), ("deleted", s.deleted)):
        put(_REMOTE, n, event)
    for reason, n in s.refusals.items():
        put(_REJECTED, n, reason)
