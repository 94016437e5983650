"""Prometheus text exposition (format 0.0.4) of the engine's counters.

``engine.metrics()`` returns numbers and nested dicts of numbers. They are
flattened to dotted paths (``pool.ram_bytes``) and matched against ``RULES``:
a rule names the family, its type and help, and its regex's named groups (plus
fixed labels) become labels, so ``pool.ram_bytes`` and ``pool.disk_bytes`` are
one family ``statecache_checkpoint_bytes{tier=…}``. A path no rule knows is still
exported, as an ``untyped`` ``statecache_<path>``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True, frozen=True)
class Family:
    name: str
    kind: str  # counter | gauge | untyped
    help: str


@dataclass(slots=True, frozen=True)
class Rule:
    pattern: str  # full match on the dotted path; named groups are labels
    family: Family
    labels: tuple[tuple[str, str], ...] = ()  # fixed labels
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regex", re.compile(self.pattern))


_REQUESTS = Family("statecache_requests_total", "counter", "Generation requests finished.")
_SOURCE = Family("statecache_requests_by_source_total", "counter",
                 "Requests by where their starting state came from (cold, lane, ram, disk).")
_HITS = Family("statecache_cache_hits_total", "counter",
               "Requests that reused state, by source and role of the checkpoint used.")
_POOL_HITS = Family("statecache_pool_hits_total", "counter", "Checkpoint pool hits, per tier.")
_ROLE_HITS = Family("statecache_pool_hits_by_role_total", "counter",
                    "Checkpoint pool hits, by checkpoint role.")
_BYTES = Family("statecache_checkpoint_bytes", "gauge", "Bytes of checkpoints held, per tier.")
_BUDGET = Family("statecache_checkpoint_budget_bytes", "gauge", "Checkpoint budget, per tier.")
_ENTRIES = Family("statecache_checkpoints", "gauge", "Checkpoints held, per tier.")
_EVICTIONS = Family("statecache_evictions_total", "counter", "Checkpoints evicted, per tier.")
_TIER = r"(?:pool\.)?(?P<tier>ram|disk)"
_REMOTE = Family("statecache_remote_total", "counter",
                 "Shared (Redis/Valkey) tier events: probes, hits, writes, write_dupes, "
                 "write_drops (queue full), write_skipped, errors, reconnects, rejected.")
_REMOTE_BYTES = Family("statecache_remote_bytes_total", "counter",
                       "Bytes read from and written to the shared tier.")
_REMOTE_REJECTED = Family("statecache_remote_rejected_total", "counter",
                          "Shared-tier entries refused by their checks, by reason (foreign_key, "
                          "forged, corrupt, missing, stale, tenant, tokens, foreign_model, ...).")

RULES: tuple[Rule, ...] = (
    Rule(r"requests", _REQUESTS),
    Rule(r"requests\.(?P<reason>[^.]+)", _REQUESTS),
    Rule(r"plan_(?P<source>[^.]+)", _SOURCE),
    Rule(r"hits\.(?P<source>[^.]+)\.(?P<role>[^.]*)", _HITS),
    Rule(r"pool\.hits_role_(?P<role>[^.]+)", _ROLE_HITS),
    Rule(r"pool\.hits_(?P<tier>ram|disk|remote)", _POOL_HITS),
    Rule(r"pool\.remote_rejected_(?P<reason>.+)", _REMOTE_REJECTED),
    Rule(r"pool\.remote_(?P<direction>read|written)_bytes", _REMOTE_BYTES),
    Rule(r"pool\.remote_up", Family("statecache_remote_up", "gauge",
                                    "1 while the shared tier answers, 0 while it is off.")),
    Rule(r"pool\.remote_queue", Family("statecache_remote_write_queue", "gauge",
                                       "Checkpoints waiting to be written to the shared tier.")),
    Rule(r"pool\.remote_queue_bytes", Family("statecache_remote_write_queue_bytes", "gauge",
                                             "Bytes waiting to be written to the shared tier.")),
    Rule(r"pool\.remote_misses", Family("statecache_remote_misses_total", "counter",
                                        "Remote offers the planner picked that could not be "
                                        "used (refused or gone).")),
    Rule(r"pool\.remote_(?P<event>[a-z_]+)", _REMOTE),
    Rule(r"spec_(?P<what>drafted|accepted)", Family(
        "statecache_speculative_tokens_total", "counter",
        "Speculative decoding: tokens drafted, and those the target accepted.")),
    Rule(r"spec_verifications", Family(
        "statecache_speculative_verifications_total", "counter",
        "Decode steps of a lane that verified drafts.")),
    Rule(r"spec_replays", Family(
        "statecache_speculative_replays_total", "counter",
        "Rejections undone by restoring a staged state (memories without rollback).")),
    Rule(r"draft_(?P<event>rollbacks|restores|clears|checkpoints)", Family(
        "statecache_draft_lane_events_total", "counter",
        "The draft model's lanes: rollbacks, restores of its partial checkpoints, clears, "
        "checkpoints saved.")),
    Rule(r"draft_(?P<what>tokens_decoded|checkpoint_bytes)", Family(
        "statecache_draft_total", "counter",
        "The draft model: tokens it decoded, bytes of its partial checkpoints saved.")),
    Rule(r"pool\.prefill_tps", Family("statecache_prefill_tokens_per_second", "gauge",
                                      "Measured prefill rate the planner uses (0: not yet).")),
    Rule(r"pool\.bandwidth_(?P<tier>[a-z]+)", Family(
        "statecache_read_bandwidth_bytes_per_second", "gauge",
        "Measured checkpoint read bandwidth per tier, the planner's input (0: not yet).")),
    Rule(_TIER + r"_bytes", _BYTES),
    Rule(r"bytes\.(?P<tier>[^.]+)", _BYTES),
    Rule(_TIER + r"_budget", _BUDGET),
    Rule(_TIER + r"_entries", _ENTRIES),
    Rule(r"pool\.evictions", _EVICTIONS, (("tier", "ram"),)),
    Rule(r"pool\.disk_evictions", _EVICTIONS, (("tier", "disk"),)),
    Rule(r"evictions\.(?P<tier>[^.]+)", _EVICTIONS),
    Rule(r"misses\.(?P<cause>[^.]+)", Family(
        "statecache_misses_total", "counter",
        "Requests that reused less than an earlier request held, by cause.")),
    Rule(r"volatile_replacements\.(?P<rule>.+)", Family(
        "statecache_volatile_replacements_total", "counter",
        "Volatile fragments replaced in message text, per [[server.volatile]] rule.")),
    Rule(r"tokens_prefilled", Family("statecache_prefilled_tokens_total", "counter",
                                     "Prompt tokens run through the model.")),
    Rule(r"tokens_reused", Family("statecache_reused_tokens_total", "counter",
                                  "Prompt tokens served from a kept or restored state.")),
    Rule(r"tokens_generated", Family("statecache_generated_tokens_total", "counter",
                                     "Tokens generated.")),
    Rule(r"queue_depth", Family("statecache_queue_depth", "gauge", "Requests waiting for a lane.")),
    Rule(r"active_requests", Family("statecache_active_requests", "gauge",
                                    "Requests holding a lane now.")),
    Rule(r"lanes", Family("statecache_lanes", "gauge", "Lanes (llama.cpp sequences).")),
    *(Rule(k, Family(f"statecache_{k}_total", "counter", help_))
      for k, help_ in (("rejected_busy", "Requests refused with 503: lanes and queue full."),
                       ("checkpoints_saved", "Checkpoints published."),
                       ("checkpoint_bytes_saved", "Bytes of checkpoints published."),
                       ("restore_failures", "Checkpoint restores that failed (fell back cold)."),
                       ("handoffs", "Lane states handed to the pool to free a lane."),
                       ("replaced_replies", "Lane states cut back unsaved: the request "
                        "held the last one's history and replaced its turn."),
                       ("replies_spliced", "Replies whose generated ids were spliced in."),
                       ("steps", "Engine steps: one llama_decode each, for every lane."),
                       ("step_tokens", "Tokens decoded in engine steps (all lanes)."),
                       ("step_lane_work", "Lanes served by engine steps, summed over steps."),
                       ("steps_multi_lane", "Engine steps that carried more than one lane."),
                       ("steps_alone", "Engine steps of a lone decoding stream, run "
                        "without planning each one."),
                       ("idle_saves", "Idle lanes whose state was saved in full."),
                       ("lanes_kept_in_line", "Requests started in another free lane than "
                        "their plan's, so the busy lanes stay one run of ids."),
                       ("lane_copies", "Live lane states copied to such a lane at the "
                        "start of a request."),
                       ("lane_moves", "Decoding requests moved into the gap a finished "
                        "request left among the busy lanes."),
                       ("cancelled_queued", "Requests whose client left while queued."),
                       ("waits_for_shared_prefix", "Requests that waited for another one's "
                        "checkpoint of a prefix they share."),
                       ("fetches_in_background", "Checkpoints read from disk or the shared "
                        "store on the fetch thread while other requests ran."),
                       ("prewarms", "Pre-warm requests (max_tokens 0) served: prefilled and "
                        "cached, nothing generated."),
                       ("prewarms_dropped", "Waiting pre-warms dropped (503) to make room in "
                        "a full queue for a request that generates."))),
    Rule(r"hosted_tools_ignored\.(?P<type>.+)", Family(
        "statecache_hosted_tools_ignored_total", "counter",
        "Hosted tools (run by the API's own servers) left out of prompts, by type.")),
    Rule(r"share_points", Family(
        "statecache_share_points_total", "counter",
        "FULL checkpoints published where a prompt's first-turn messages start, for new "
        "conversations that share them.")),
    Rule(r"pool\.kept", Family("statecache_kept_checkpoints_total", "counter",
                               "Checkpoints a client's cache breakpoint asked to keep.")),
    Rule(r"pool\.kept_entries", Family("statecache_kept_checkpoints", "gauge",
                                       "Checkpoints kept now for a client's breakpoint.")),
    Rule(r"pool\.disk_writes", Family("statecache_disk_writes_total", "counter",
                                      "Checkpoints written to disk.")),
    Rule(r"pool\.disk_write_errors", Family("statecache_disk_write_errors_total", "counter",
                                            "Checkpoint writes to disk that failed.")),
    Rule(r"pool\.direct_writes", Family("statecache_disk_direct_writes_total", "counter",
                                        "States larger than the RAM budget sent straight to "
                                        "disk.")),
    Rule(r"pool\.write_queue", Family("statecache_disk_write_queue", "gauge",
                                      "Checkpoints waiting for the background disk writer.")),
)
HTTP_FAMILY = Family("statecache_http_requests_total", "counter",
                     "HTTP requests answered, by route and status code.")
_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")

Sample = tuple[tuple[tuple[str, str], ...], float]


def _leaves(value: object, path: str = "") -> Iterator[tuple[str, float]]:
    if isinstance(value, Mapping):
        for k in sorted(value, key=str):
            yield from _leaves(value[k], f"{path}.{k}" if path else str(k))
    elif isinstance(value, int | float):
        yield path, value
    # strings and other values are not samples: skipped


def _classify(path: str) -> tuple[Family, tuple[tuple[str, str], ...]]:
    for rule in RULES:
        m = rule.regex.fullmatch(path)
        if m:
            return rule.family, rule.labels + tuple(m.groupdict().items())
    name = "statecache_" + _NAME_BAD.sub("_", path)
    return Family(name, "untyped", f"Engine metric {path!r}."), ()


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if isinstance(v, int):
        return str(int(v))  # bools too: 0 / 1
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def _render(families: dict[str, tuple[Family, list[Sample]]]) -> list[str]:
    lines: list[str] = []
    for name in sorted(families):
        fam, samples = families[name]
        lines += [f"# HELP {name} {fam.help}", f"# TYPE {name} {fam.kind}"]
        for labels, v in sorted(samples, key=lambda s: s[0]):
            body = ",".join(f'{k}="{_escape(x)}"' for k, x in labels)
            lines.append(f"{name}{{{body}}} {_number(v)}" if body else f"{name} {_number(v)}")
    return lines


def format_metrics(engine_metrics: Mapping[str, object],
                   http_counts: Mapping[tuple[str, int], int] | None = None) -> str:
    """The whole /metrics page."""
    families: dict[str, tuple[Family, list[Sample]]] = {}
    for path, v in _leaves(engine_metrics):
        fam, labels = _classify(path)
        families.setdefault(fam.name, (fam, []))[1].append((labels, v))
    for (route, code), n in (http_counts or {}).items():
        families.setdefault(HTTP_FAMILY.name, (HTTP_FAMILY, []))[1].append(
            ((("route", route), ("code", str(code))), n))
    return "\n".join(_render(families)) + "\n"
