"""What a context's memory is: its kind and the sizes of its states (read by
``Context.describe_memory``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class MemoryKind(enum.Enum):
    ATTENTION = "attention"  # plain KV cache: seq_rm rolls back anywhere
    SWA = "swa"  # sliding-window attention beside full attention (Gemma 3)
    RECURRENT = "recurrent"  # only recurrent state (Mamba)
    HYBRID = "hybrid"  # recurrent layers beside attention (Qwen3.5, LFM2)


@dataclass(slots=True, frozen=True)
class MemoryInfo:
    kind: MemoryKind
    n_swa: int  # the SWA window, 0 if none
    seq_rm_rollback: bool  # can a live lane be truncated anywhere with seq_rm
    rs_rollback: bool  # does the architecture support n_rs_seq snapshots
    n_rs_seq: int  # snapshots kept per lane in this context (0 = none)
    bytes_per_token: int  # full-state bytes added per consumed token
    bytes_per_lane: int  # full-state bytes independent of length (recurrent part)
    partial_bytes_per_token: int
    partial_bytes_per_lane: int
    # an SWA memory whose SWA cache holds a window, not every token (``swa_full`` off):
    # its SWA cache rolls back like a hybrid's recurrent state (docs/design.md fact 25)
    swa_window: bool = False

    @property
    def needs_partial(self) -> bool:
        """Whether in-lane rollback needs a saved partial state (recurrent or SWA)."""
        return not self.seq_rm_rollback

    @property
    def full_size_swa(self) -> bool:
        """An SWA memory that keeps every SWA cell of a live lane (``swa_full``): seq_rm
        cuts a live lane back anywhere its cells reach, and no partial state is kept."""
        return self.kind is MemoryKind.SWA and not self.swa_window

    @property
    def partial_rollback(self) -> bool:
        """Whether a live lane is rolled back by restoring a partial state it saved, then
        ``seq_rm`` (recurrent, hybrid, window-sized SWA), so a prefill publishes PARTIAL
        checkpoints in the lane."""
        return self.needs_partial and not self.full_size_swa

    @property
    def kv_sections(self) -> int:
        """Attention KV caches a FULL state starts with (docs/design.md, the layout of a
        sequence state): iSWA writes its base cache and its SWA cache, a hybrid its
        attention cache before the recurrent part, a recurrent memory none. A window-sized
        SWA cache counts as the rest, like a hybrid's recurrent part: only the base cache
        is paged."""
        return {MemoryKind.ATTENTION: 1, MemoryKind.SWA: 1 if self.swa_window else 2,
                MemoryKind.HYBRID: 1, MemoryKind.RECURRENT: 0}[self.kind]

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind.value, "n_swa": self.n_swa, "seq_rm_rollback": self.seq_rm_rollback,
            "rs_rollback": self.rs_rollback, "n_rs_seq": self.n_rs_seq,
            "bytes_per_token": self.bytes_per_token, "bytes_per_lane": self.bytes_per_lane,
            "partial_bytes_per_token": self.partial_bytes_per_token,
            "partial_bytes_per_lane": self.partial_bytes_per_lane,
            "swa_window": self.swa_window,
        }
