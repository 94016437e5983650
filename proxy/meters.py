"""Every family ``/metrics`` shows, declared once: the engine's (``EngineMeter``, counted
on the engine thread), the HTTP side's (``ApiMeter``), and the checkpoint pool's report
(``pool_families``: ``CheckpointPool.stats()`` read at each scrape, by a table of its
keys).
"""

from __future__ import annotations

from collections.abc import Mapping

from proxy.meter import Counter, Family, Gauge, Histogram

# simple engine counters: attribute -> help (family statecache_<attribute>_total)
_COUNTS = {
    "rejected_busy": "Requests refused with 503: lanes and queue full.",
    "checkpoints_saved": "Checkpoints published.",
    "checkpoint_bytes_saved": "Bytes of checkpoints published.",
    "restore_failures": "Checkpoint restores that failed (fell back cold).",
    "handoffs": "Lane states handed to the pool to free a lane.",
    "owed_checkpoints": "Checkpoints a prefill passed without stopping (a lane cut back "
                        "anywhere), taken from the lane when it was cut back or replaced.",
    "share_points_on_grid": "A hybrid's first-turn and share points moved down to a step's "
                            "end (cache.share_grid_tokens), or dropped there.",
    "replaced_replies": "Lane states cut back unsaved: the request held the last one's "
                        "history and replaced its turn.",
    "replies_spliced": "Replies whose generated ids were spliced in.",
    "steps": "Engine steps: one llama_decode each, for every lane.",
    "step_tokens": "Tokens decoded in engine steps (all lanes).",
    "step_lane_work": "Lanes served by engine steps, summed over steps.",
    "steps_multi_lane": "Engine steps that carried more than one lane.",
    "steps_alone": "Engine steps of a lone decoding stream, run without planning each one.",
    "idle_saves": "Idle lanes whose state was saved in full.",
    "lanes_kept_in_line": "Requests started in another free lane than their plan's, so the "
                          "busy lanes stay one run of ids.",
    "lane_copies": "Live lane states copied to such a lane at the start of a request.",
    "lane_moves": "Decoding requests moved into the gap a finished request left among the "
                  "busy lanes.",
    "cancelled_queued": "Requests whose client left while queued.",
    "waits_for_shared_prefix": "Requests that waited for another one's checkpoint of a "
                               "prefix they share.",
    "fetches_in_background": "Checkpoints read from disk or the shared store on the fetch "
                             "thread while other requests ran.",
    "prewarms": "Pre-warm requests (max_tokens 0) served: prefilled and cached, nothing "
                "generated.",
    "prewarms_dropped": "Waiting pre-warms dropped (503) to make room in a full queue for a "
                        "request that generates.",
    "spec_rests": "Lanes that stopped drafting: drafts did not pay there (or prompt lookup "
                  "kept finding nothing).",
    "spec_probes": "Drafts a resting lane tried, to see whether drafting pays again.",
}


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
        self.counts = {name: Counter(f"statecache_{name}_total", help_)
                       for name, help_ in _COUNTS.items()}

    def count(self, name: str, by: float = 1) -> None:
        """One of the simple counters of ``_COUNTS``."""
        self.counts[name].inc(by=by)

    def get(self, name: str) -> float:
        return self.counts[name].get()

    def families(self) -> list[Family]:
        fixed = [v for v in vars(self).values() if isinstance(v, Family)]
        return fixed + list(self.counts.values())


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

# pool.stats() key -> (family, label values)
POOL_KEYS: Mapping[str, tuple[Spec, tuple[str, ...]]] = {
    "hits_ram": (_POOL_HITS, ("ram",)), "hits_disk": (_POOL_HITS, ("disk",)),
    "hits_remote": (_POOL_HITS, ("remote",)),
    "ram_bytes": (_BYTES, ("ram",)), "disk_bytes": (_BYTES, ("disk",)),
    "ram_budget": (_BUDGET, ("ram",)), "disk_budget": (_BUDGET, ("disk",)),
    "ram_entries": (_ENTRIES, ("ram",)), "disk_entries": (_ENTRIES, ("disk",)),
    "evictions": (_EVICTIONS, ("ram",)), "disk_evictions": (_EVICTIONS, ("disk",)),
    "ram_pages": (_PAGES, ("ram",)), "disk_pages": (_PAGES, ("disk",)),
    "ram_page_bytes": (_PAGE_BYTES, ("ram",)), "disk_page_bytes": (_PAGE_BYTES, ("disk",)),
    "ram_whole_states": (_g("statecache_whole_states",
                            "Checkpoints kept whole in RAM beside their pages (the newest "
                            "of each conversation: a hit on one assembles nothing)."), ()),
    "ram_whole_bytes": (_g("statecache_whole_state_bytes",
                           "Bytes of the checkpoints kept whole in RAM; their pages are "
                           "views into them, so only the rest adds to "
                           "statecache_checkpoint_bytes."), ()),
    "bad_states": (_c("statecache_checkpoint_bad_states_total",
                      "Checkpoints whose assembled state was not the one saved (a miss)."), ()),
    "remote_read_bytes": (_REMOTE_BYTES, ("read",)),
    "remote_written_bytes": (_REMOTE_BYTES, ("written",)),
    "remote_up": (_g("statecache_remote_up",
                     "1 while the shared tier answers, 0 while it is off."), ()),
    "remote_queue": (_g("statecache_remote_write_queue",
                        "Checkpoints waiting to be written to the shared tier."), ()),
    "remote_queue_bytes": (_g("statecache_remote_write_queue_bytes",
                              "Bytes waiting to be written to the shared tier."), ()),
    "remote_misses": (_c("statecache_remote_misses_total",
                         "Remote offers the planner picked that could not be used (refused "
                         "or gone)."), ()),
    "prefill_tps": (_g("statecache_prefill_tokens_per_second",
                       "Measured prefill rate the planner uses (0: not yet)."), ()),
    "kept": (_c("statecache_kept_checkpoints_total",
                "Checkpoints a client's cache breakpoint asked to keep."), ()),
    "kept_entries": (_g("statecache_kept_checkpoints",
                        "Checkpoints kept now for a client's breakpoint."), ()),
    "disk_writes": (_c("statecache_disk_writes_total", "Checkpoints written to disk."), ()),
    "disk_write_errors": (_c("statecache_disk_write_errors_total",
                             "Checkpoint writes to disk that failed."), ()),
    "direct_writes": (_c("statecache_disk_direct_writes_total",
                         "States larger than the RAM budget sent straight to disk."), ()),
    "write_queue": (_g("statecache_disk_write_queue",
                       "Checkpoints waiting for the background disk writer."), ()),
}
# keys that name a label value after a fixed start (role, tier, reason, event)
POOL_PREFIXES = (("hits_role_", _ROLE_HITS), ("bandwidth_", _BANDWIDTH),
                 ("remote_rejected_", _REJECTED), ("remote_", _REMOTE))


def pool_families(stats: Mapping[str, float]) -> list[Family]:
    """The pool's report as families: each known key where ``POOL_KEYS`` or a start of
    ``POOL_PREFIXES`` puts it; any other as an untyped ``statecache_pool_<key>``."""
    out: dict[str, Family] = {}

    def family(spec: Spec) -> Family:
        kind, name, help_, labels = spec
        fam = out.get(name)
        if fam is None:
            cls = {"counter": Counter, "gauge": Gauge, "untyped": _Untyped}[kind]
            fam = out[name] = cls(name, help_, labels)
        return fam

    for key, value in stats.items():
        if key in POOL_KEYS:
            spec, labels = POOL_KEYS[key]
        else:
            found = next(((spec, key[len(start):]) for start, spec in POOL_PREFIXES
                          if key.startswith(start)), None)
            if found is None:
                spec = ("untyped", f"statecache_pool_{key}", f"Engine metric 'pool.{key}'.", ())
                labels = ()
            else:
                spec, labels = found[0], (found[1],)
        family(spec).put(labels, value)
    return list(out.values())
