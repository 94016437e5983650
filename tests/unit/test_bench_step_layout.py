"""bench.step_layout's layouts: the same cuts and the same number of steps, the short
step of each stretch between two cuts placed last (``forward``, the engine's before) or
first (``engine``, layout.step_ends)."""

from __future__ import annotations

from bench.step_layout import layouts


def _sizes(ends: list[int]) -> list[int]:
    return [e - s for s, e in zip([0, *ends], ends, strict=False)]


def test_claude_codes_first_turn_laid_three_ways() -> None:
    got = layouts([1490, 18197], 19664)
    assert {n: len(e) for n, e in got.items()} == {"grid": 39, "forward": 39, "engine": 39}
    # llama-server's: one short step, at the very end
    assert _sizes(got["grid"])[-1] == 208 and set(_sizes(got["grid"])[:-1]) == {512}
    # the cuts' short steps: deep in the prompt before (323 at 17,874), at the shallow
    # end of their stretch now (323 at 1,490); the last stretch's goes last either way
    fwd, eng = _sizes(got["forward"]), _sizes(got["engine"])
    assert got["forward"][got["forward"].index(18197) - 1] == 17874 and fwd[35] == 323
    assert eng[3] == 323 and got["engine"][3] == 1490 + 323
    assert fwd[-3:] == eng[-3:] == [512, 512, 443]
    assert 1490 in got["engine"] and 18197 in got["engine"]
