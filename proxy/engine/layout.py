"""Where a prefill's steps end: a step ends at each cut (a checkpoint saved as the
prefill passes it) and at the prompt's end, and each stretch between goes in whole steps
of ``chunk`` tokens and one short step (``first_step``). The engine's executor lays the
steps so, a step at a time (``Executor.work_for``); the points a prefill publishes are
placed where these say steps end, so that they cost no step of their own (points.py)."""

from __future__ import annotations

from collections.abc import Sequence


def first_step(start: int, stop: int, chunk: int, *, last: bool = False) -> int:
    """Tokens of the first step of a prefill from ``start`` to ``stop`` (the next cut; 0
    where there is nothing to prefill): the stretch's short step, where its tokens are
    not whole steps, then whole steps of ``chunk`` tokens. A step costs by its tiles of
    query rows, and a short step's part-filled tiles cost by the depth they run at
    (docs/design.md fact 26): at the shallow end of its stretch the short step costs
    least, and the steps deep in the prompt are whole. The ``last`` stretch (to the
    prompt's end) goes whole steps first, as llama-server lays a prompt: the points
    inside its last step are owed by the lane, not cut (points.py, ``last_step_start``),
    and its short step is deep in the prompt either way."""
    if stop <= start:
        return 0
    odd = (stop - start) % chunk
    return odd if odd and not last else min(chunk, stop - start)


def stretch_ends(start: int, stop: int, chunk: int, *, last: bool = False) -> list[int]:
    """Where the steps of a prefill from ``start`` to ``stop`` end (``first_step``)."""
    out: list[int] = []
    pos = start
    while pos < stop:
        pos += first_step(pos, stop, chunk, last=last)
        out.append(pos)
    return out


def step_ends(cuts: Sequence[int], *, reuse: int, end: int, chunk: int) -> list[int]:
    """Where a prefill from ``reuse`` to ``end`` ends its steps: a step ends at each of
    ``cuts`` (the checkpoints a hybrid saves as it passes them), and each stretch between
    them goes in steps of ``chunk`` tokens (``stretch_ends``). Their number is the
    prefill's steps."""
    out: list[int] = []
    pos = reuse
    for cut in sorted({c for c in cuts if reuse < c < end} | ({end} if end > reuse else set())):
        out += stretch_ends(pos, cut, chunk, last=cut == end)
        pos = cut
    return out


def onto_grid(points: Sequence[int], kept: Sequence[int], *, reuse: int, chunk: int,
              within: int) -> dict[int, int]:
    """Each of ``points`` that lies at most ``within`` tokens past the end of the step
    it falls in, moved down to that end (a prefill whose steps stop only at ``kept``, the
    points that stay, and at these once moved); a point that would reach ``reuse`` or a
    kept point is dropped (0). The others are not in the answer. The steps counted are
    whole ones from the point before (as the last stretch lays them): a point moved
    there is a whole number of steps past it, so it ends a step in any layout and the
    stretch after it keeps its steps (``stretch_ends``)."""
    out: dict[int, int] = {}
    stays = sorted({reuse, *kept})
    for n in sorted(set(points)):
        base = max(s for s in stays if s <= n)
        g = base + (n - base) // chunk * chunk
        if n - g > within:
            stays.append(n)
            stays.sort()
            continue
        out[n] = g if g > base else 0
    return out


def periodic_points(fixed: Sequence[int], *, reuse: int, limit: int, every: int,
                    chunk: int) -> list[int]:
    """Periodic checkpoints of a long prefill (after ``reuse``, at most ``limit``), where
    its steps end anyway: a step carries ``chunk`` prompt tokens and ends early only at
    one of the ``fixed`` points, so a point on that grid costs no step of its own (a
    multiple of ``every`` would, wherever a fixed point has shifted the grid). One goes
    at the first step's end at least ``every`` tokens past the last checkpoint, fixed or
    periodic, or the state the prefill starts from. Points asked for more often than
    steps end (``every`` < ``chunk``) go at the multiples of ``every``, as asked: the
    grid would give up what they are for."""
    if every <= 0 or chunk <= 0:
        return []
    if every < chunk:
        return list(range((reuse // every + 1) * every, limit + 1, every))
    cuts = {f for f in fixed if reuse < f <= limit}
    out: list[int] = []
    last = reuse
    for pos in step_ends(sorted(cuts), reuse=reuse, end=limit + 1, chunk=chunk):
        if pos > limit:
            break
        if pos in cuts:
            last = pos
        elif pos - last >= every:
            out.append(pos)
            last = pos
    return out


def last_step_start(cuts: Sequence[int], *, reuse: int, end: int, chunk: int) -> int:
    """Where the last step of a prefill from ``reuse`` to ``end`` starts: steps of ``chunk``
    tokens, each of ``cuts`` ending one short, except a cut inside the last step, which
    does not move it (``PointPicker`` owes those instead of cutting there)."""
    pos = reuse
    for cut in sorted(c for c in set(cuts) if reuse < c < end):
        start = pos + (end - pos - 1) // chunk * chunk
        if cut > start:
            return start
        pos = cut
    return pos + max(end - pos - 1, 0) // chunk * chunk


def window_steps(cuts: Sequence[int], *, reuse: int, end: int, chunk: int) -> int:
    """The steps of a prefill from ``reuse`` to ``end`` on a window-sized SWA cache: each
    of ``cuts`` ends one early, but those inside the last step (owed instead)."""
    start = last_step_start(cuts, reuse=reuse, end=end, chunk=chunk)
    return len(step_ends([c for c in cuts if c <= start], reuse=reuse, end=end, chunk=chunk))


def free_cuts(points: Sequence[int], kept: Sequence[int], *, reuse: int, end: int,
              chunk: int) -> list[int]:
    """Those of ``points`` (in order) that may end a step where they are, beside ``kept``
    and each other, before the last step (a point inside it would be owed, not saved),
    and leave the prefill as many steps as without them: a prompt whose
    last step is short has that many tokens of room, and a step ended early there costs
    no pass over the weights more. Claude Code's first turn of 19,659 tokens keeps its
    share point at 18,192 in 39 steps (18,192 tokens in 36, the rest in 3)."""
    stays = list(kept)
    steps = window_steps(stays, reuse=reuse, end=end, chunk=chunk)
    out: list[int] = []
    for n in sorted(set(points)):
        cuts = [*stays, n]
        if n <= last_step_start(cuts, reuse=reuse, end=end, chunk=chunk) and \
                window_steps(cuts, reuse=reuse, end=end, chunk=chunk) == steps:
            stays.append(n)
            out.append(n)
    return out
