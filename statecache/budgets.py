"""What the memory budgets hold: the tokens per lane ``model.kv_budget`` allows, and the
conversations ``cache.ram_budget`` keeps warm. Pure arithmetic on byte counts, shared by
the engine (which measures a token's bytes on the loaded model) and ``statecache models``
(which computes them from a GGUF header)."""

from __future__ import annotations

from statecache.sizes import format_size

MIN_LANE_CONTEXT = 512  # fewer tokens per lane than this is refused: raise the budget
LANE_CONTEXT_STEP = 256  # a lane's context is a multiple of this
DEFAULT_TRAINING_CONTEXT = 8192  # for a GGUF that names none


def lane_context(train: int, bytes_per_token: int, kv_budget: int,
                 lanes: int) -> tuple[int, str]:
    """Tokens per lane and why: the training context, capped so that the KV of all
    ``lanes`` fits ``kv_budget``. ValueError when that leaves under 512 tokens."""
    train = train or DEFAULT_TRAINING_CONTEXT
    per_token = max(bytes_per_token, 1)
    fit = kv_budget // (lanes * per_token)
    n = int(min(train, fit)) // LANE_CONTEXT_STEP * LANE_CONTEXT_STEP
    if n < MIN_LANE_CONTEXT:
        raise ValueError(f"model.kv_budget {format_size(kv_budget)} holds only {fit} tokens "
                         f"per lane at {format_size(per_token)} a token; raise it or set n_ctx")
    why = (f"training context {train:,}" if n >= train else
           f"kv_budget {format_size(kv_budget)} / {lanes} lanes / {format_size(per_token)} "
           "a token")
    return n, why


def warm_conversations(ram_budget: int, conversation_bytes: int) -> int:
    """How many conversations of ``conversation_bytes`` each (their KV once, as the pool
    keeps pages, and the state a turn resumes from) ``ram_budget`` holds at once."""
    return ram_budget // max(conversation_bytes, 1)
