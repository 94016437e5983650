"""What each configuration key is: one frozen dataclass per TOML section, its defaults
and what each key does (statecache/config/load.py reads the file into them)."""

from __future__ import annotations

from dataclasses import dataclass, field

_SIZE = {"size": True}
LOG_LEVELS = ("debug", "info", "warning", "error")
INNER_SYSTEM = ("auto", "fold", "keep")
# model.tool_format: "auto", or a family of proxy/api/syntax (a test keeps the two in step)
TOOL_FORMATS = ("auto", "seed-oss", "qwen3-xml", "glm", "hermes", "hunyuan", "minimax-m2",
                "deepseek-dsml", "deepseek", "kimi-k2", "kimi-k3", "mistral", "lfm2", "command-r",
                "apertus", "gemma4", "tool-calls-json", "nemotron-v2", "solar", "minicpm",
                "gigachat", "firefunction", "minimax-m3", "atem", "functionary-v3.1", "llama3",
                "pythonic", "harmony", "functionary-v3.2", "none")
HOSTED_TOOLS = ("ignore", "reject")
SPECULATIVE_SOURCES = ("off", "lookup", "draft", "auto")


class ConfigError(ValueError):
    """A configuration mistake; the message names the key."""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    # a GGUF path or a model's name (proxy/models/names.py); empty: the bundled SmolLM2
    path: str = ""
    draft_path: str = ""
    n_ctx: int = 0  # tokens per lane; 0: chosen from the training context and kv_budget
    kv_budget: int = field(default=4 << 30, metadata=_SIZE)  # for n_ctx = 0: KV of all lanes
    n_batch: int = 512
    n_ubatch: int = 512
    n_gpu_layers: int = -1
    n_rs_seq: int = 0
    chat_template: str = ""  # a .jinja file overriding the GGUF's template
    # the tool-call syntax: "auto" probes the template (proxy/api/syntax/probe.py)
    tool_format: str = "auto"
    threads: int = 0  # 0: auto
    # iSWA models (Gemma 3, gpt-oss): false keeps a window-sized SWA cache, as
    # llama-server does, rolled back by partial states (docs/design.md fact 25); true
    # keeps every SWA cell of a live lane, so seq_rm cuts it back anywhere. Not set:
    # false, and true with cache.exact (load.py)
    swa_full: bool = False


@dataclass(slots=True, frozen=True)
class VolatileRule:
    """A fragment of message text that changes per conversation (a session id, a date):
    replaced before rendering so prompts that differ only there share their prefix.
    One ``[[server.volatile]]`` table; off unless configured (the model reads the result)."""

    pattern: str  # a Python regular expression
    replace: str = ""  # re.sub's replacement (\\1 refers to a group)
    name: str = ""  # the rule's label in /metrics (default: its index)


@dataclass(slots=True, frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    lanes: int = 4  # one batch per step makes lanes cheap (docs/engine.md, "One batch per step")
    queue_size: int = 16
    request_timeout: float = 600.0
    max_tokens_default: int = 512
    max_body: int = field(default=8 << 20, metadata=_SIZE)  # larger request bodies get 413
    parse_concurrency: int = 2  # requests read, parsed and tokenized at the same time
    # A stream is written at most once per this long: tokens that come sooner go with
    # the next write (its first and last tokens go at once, and none waits through a
    # step that prefills or saves). 32: as often as Ink, the terminal UI that Claude Code
    # draws with, redraws. 0: every step's tokens at once. docs/engine.md, "Writes on a clock".
    stream_interval_ms: float = 32.0
    # API key -> tenant. Set: every request needs a known key, whose tenant it gets.
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)
    admin_key: str = field(default="", repr=False)  # the admin routes need it once any key is set
    admin: bool = True  # false: no admin routes at all
    volatile: tuple[VolatileRule, ...] = ()  # [[server.volatile]]: rewrites of message text
    # A system or developer message after the first (docs/agents.md): "auto"
    # keeps it in place where the chat template renders it there, else folds it into the
    # conversation as marked user text; "fold": always; "keep": as sent (a template that
    # refuses it makes the request a 400)
    inner_system: str = "auto"
    # Tools that the API's own servers run (Responses' web_search, Anthropic's server
    # tools): "ignore" leaves them out of the prompt (a warning per type, a counter);
    # "reject" answers 400
    hosted_tools: str = "ignore"


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """How the engine builds each step (one llama_decode for every lane)."""

    step_tokens: int = 0  # tokens per step, decode and prefill together; 0: model.n_batch
    prefill_chunk: int = 0  # most prompt tokens of one lane per step; 0: step_tokens
    # While streams decode, a long prompt prefills in bursts (proxy/engine/steps.py):
    # one step of at most this long, then the streams alone for as long as it took
    # (``decode_share`` of the time is theirs); 0: no limit.
    prefill_pause_ms: float = 400.0
    decode_share: float = 0.5
    min_prefill_chunk: int = 16  # the smallest burst, however slow a token is
    idle_save_s: float = 2.0  # an idle lane's state is saved FULL after this long; 0: never
    # One stream decoding with nothing else to do runs steps of its own, without
    # planning each one, for up to this long between the loop's checks; 0: every step
    # is planned
    lone_run_ms: float = 250.0
    # A persistent ggml threadpool for the context and its draft's (builds without
    # OpenMP): its workers poll this long between decodes (0-100, ggml's scale; 50 is
    # llama-server's) before they sleep; -1: none (llama.cpp then starts the threads of
    # every decode anew, which stalled the sub-millisecond decodes of tiny models)
    thread_poll: int = 50
    # Check the engine's invariants after every step (proxy/engine/checks.py): the tests
    # turn it on; it costs a pass over every lane's tokens a step
    sanity_checks: bool = False


@dataclass(slots=True, frozen=True)
class RemoteConfig:
    """``[cache.remote]``: the shared tier on Redis or Valkey (off while ``url`` is empty)."""

    # redis://, rediss://, valkey://, valkeys:// or unix:// (host, port, db, password)
    url: str = field(default="", repr=False)
    cluster: bool = False  # the URL names one node of a Redis/Valkey cluster
    prefix: str = "statecache"  # every key starts with "<prefix>:"
    ttl: float = 7 * 86400.0  # seconds an entry lives after it was written or last used; 0: forever
    chunk_size: int = field(default=4 << 20, metadata=_SIZE)  # bytes per stored value
    max_entry: int = field(default=4 << 30, metadata=_SIZE)  # larger states are not shared
    queue_bytes: int = field(default=1 << 30, metadata=_SIZE)  # writes waiting; oldest dropped
    timeout: float = 2.0  # seconds for one command (connect: a tenth, at least 0.1)
    retry_s: float = 5.0  # after a failure, the store is tried again this much later
    # The key that signs shared entries; every proxy sharing the store needs a copy.
    # Empty: cache.secret_path (the disk tier's key).
    secret_path: str = ""


@dataclass(slots=True, frozen=True)
class CacheConfig:
    enabled: bool = True
    page_size: int = 32
    ram_budget: int = field(default=2 << 30, metadata=_SIZE)
    disk_path: str = "~/.cache/statecache/checkpoints"
    disk_budget: int = field(default=16 << 30, metadata=_SIZE)
    # checkpoints the disk tier holds at most, whatever their bytes: each keeps a head in
    # memory (about 3 KiB with its page keys and trie nodes), and KV pages make a
    # checkpoint small on disk, so the byte budget alone would let the index grow for long
    disk_max_checkpoints: int = 20000
    disk_enabled: bool = True
    # The key authenticating disk checkpoints: 32 random bytes, 0600, made on first use;
    # kept outside disk_path, since whoever can write it can forge checkpoints.
    secret_path: str = "~/.local/state/statecache/secret.key"
    periodic_pages: int = 64
    # FULL checkpoints at most per prompt where its first turn's messages and parts start,
    # for new conversations that share instructions, tools and environment (largest gaps
    # first); 0: none
    share_points: int = 4
    # on a hybrid, the first turn's end and its share points at most this many tokens
    # past the end of a prefill step move down to it, where they cut no step short (the
    # reuse a new conversation gives up there: python -m bench.share_grid); 0: none. A
    # window-sized SWA cache moves every one that would cost its prefill a step, and a
    # client's breakpoints before the last step (proxy/engine/points.py)
    share_grid_tokens: int = 0
    splice_generated: bool = False
    # a reply and its logprobs bit-identical to the cache-off server's: restores and
    # prefill steps on the grid of model.n_ubatch, one lane a step, no speculation
    # (docs/exact.md)
    exact: bool = False
    tenant: str = ""
    # zstd level for what goes to disk and to the shared tier (statecache/formats/codec.py: a
    # piece is kept compressed only where that saves a quarter of it); 0: none
    compress_level: int = 1
    remote: RemoteConfig = field(default_factory=RemoteConfig)  # [cache.remote]


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """Speculative decoding (proxy/engine/drafting.py): drafts verified in the step."""

    # "off"; "lookup": prompt lookup (n-grams of the prompt and reply, no model);
    # "draft": the draft model at model.draft_path; "auto": the draft model if
    # model.draft_path is set, else prompt lookup
    source: str = "auto"
    # tokens drafted per lane and step; 3 from `python -m bench.speculative --rollback-check
    # --pair bench [--draft-max 4]`: 33.6 tokens/s against 22.2 undrafted, 31.0 with 4
    draft_max: int = 3
    draft_min_p: float = 0.5  # a draft model stops where its likeliest token is less likely
    lookup_max: int = 4  # longest n-gram prompt lookup matches
    lookup_min: int = 2  # shortest
    # most tokens prompt lookup drafts a step (draft_max where a hybrid rolls back by
    # n_rs_seq snapshots); the engine drafts fewer where fewer pay (bench.speculative)
    lookup_draft_max: int = 8
    # true: each lane drafts only while drafting pays there (proxy/engine/draftlength.py);
    # false: every lane drafts what its source proposes at every step
    adaptive: bool = True
    # replies remembered for prompt lookup (proxy/engine/drafting.py History): this many
    # recent conversations (tenant and session), their last history_tokens tokens each
    history_sessions: int = 64
    history_tokens: int = 16384
    catch_up: int = 256  # most tokens a step a draft model decodes to follow its target lane
    # how a hybrid target that has n_rs_seq snapshots drops rejected drafts: "snapshots"
    # (n_rs_seq = draft_max + 1: every decode keeps per-token states), "staged" (a partial
    # save before each verification, restored on a rejection); "auto": staged (snapshots
    # make every decode dearer, drafted or not: bench.speculative's rollback table)
    rollback: str = "auto"


@dataclass(slots=True, frozen=True)
class SamplingConfig:
    """Sampling defaults; a GGUF's ``general.sampling.*`` values override them (unless
    ``model_defaults`` is false), and a request's own fields override both."""

    temperature: float = 0.8  # 0: greedy
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1: off
    min_p: float = 0.05  # 0: off
    typical_p: float = 1.0  # 1: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = 64  # tokens the penalties look back over; -1: the whole context
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0  # 0: DRY off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    xtc_probability: float = 0.0  # 0: XTC off
    xtc_threshold: float = 0.1
    model_defaults: bool = True  # apply the GGUF's general.sampling.* values


@dataclass(slots=True, frozen=True)
class LogConfig:
    level: str = "info"
    llama_verbose: bool = False


@dataclass(slots=True, frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
