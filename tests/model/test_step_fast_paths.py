"""The binding's shortcuts for a decode step: each must give what the long way gives."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from proxy.engine.binding import Batch, Context, ContextParams, Model, init_backend
from tests.busy import THREADS

PROMPT = np.array([(i * 37) % 200 + 10 for i in range(60)], dtype=np.int32)


# Batch.add's rule: rows get logits from token ``logits_from`` on; -1: the last token
# only, if ``logits_last``. With one token (every decoding lane, every step):
ONE_TOKEN_ROWS = [((True, -1), 1), ((False, -1), 0), ((True, 0), 1), ((False, 0), 1),
                  ((True, 1), 0), ((False, 2), 0)]


@pytest.mark.parametrize(("args", "flag"), ONE_TOKEN_ROWS)
def test_a_one_token_add_follows_the_rule_of_longer_ones(args: tuple[bool, int],
                                                        flag: int) -> None:
    init_backend()
    logits_last, logits_from = args
    one, two = Batch(8), Batch(8)
    try:
        for b in (one, two):
            b.add(2, [5, 6, 7], 10, logits_last=True)  # a row before it, as in a step
            b._logits[3:] = 7  # stale flags from an earlier step must not survive
        assert one.add(3, [42], 99, logits_last=logits_last, logits_from=logits_from) == 3
        assert list(one._tok[:4]) == [5, 6, 7, 42] and list(one._pos[:4]) == [10, 11, 12, 99]
        assert list(one._logits[:4]) == [0, 0, 1, flag]
        assert [one._b.seq_id[i][0] for i in range(4)] == [2, 2, 2, 3] and one.n == 4
        # the same token first in a two-token add gets the same flag, unless the rule
        # picks the last token (logits_from -1), which is then the second one
        two.add(3, [42, 43], 99, logits_last=logits_last, logits_from=logits_from)
        if logits_from >= 0:
            assert two._logits[3] == flag
        else:
            assert two._logits[4] == flag and two._logits[3] == 0
    finally:
        one.free()
        two.free()


def test_a_logits_view_shows_the_latest_decode(hybrid_path: Path) -> None:
    # views are kept per address of llama.cpp's output buffer: after the next decode the
    # same view must show the new logits, never the ones it was made for
    init_backend()
    with Model(hybrid_path) as model:
        ctx = Context(model, ContextParams(n_ctx=512, n_batch=64, n_ubatch=64,
                                           threads=THREADS))
        with ctx:
            ctx.prefill(0, PROMPT, 0)
            seen = []
            pos = len(PROMPT)
            for _ in range(6):
                view = ctx.logits_view(-1)
                copy = ctx.logits(-1)
                assert np.array_equal(view, copy)
                seen.append(copy)
                ctx.prefill(0, [int(view.argmax())], pos, logits_last=True)
                pos += 1
            assert not all(np.array_equal(seen[0], x) for x in seen[1:])
            # a step with several output rows: each row's view is its own
            ctx.batch.clear()
            ctx.batch.add(0, [11, 12, 13], pos, logits_last=True, logits_from=0)
            ctx.decode()
            rows = [ctx.logits_view(i).copy() for i in range(3)]
            assert all(np.array_equal(r, ctx.logits(i)) for i, r in enumerate(rows))
            assert not np.array_equal(rows[0], rows[2])


def test_token_pieces_and_end_flags_are_remembered_exactly(gemma_path: Path) -> None:
    # Gemma 3 has control tokens: their piece is empty without special, so the two kinds
    # must not share the remembered pieces
    init_backend()
    with Model(gemma_path) as model:
        ids = list(range(0, 300)) + [model.eos, model.bos, model.n_vocab - 1]
        fresh = [model.token_bytes(t) for t in ids]
        plain = [model.token_bytes(t, special=False) for t in ids]
        assert [model.token_bytes(t) for t in ids] == fresh  # from the memo
        assert [model.token_bytes(t, special=False) for t in ids] == plain
        assert any(f != p for f, p in zip(fresh, plain, strict=True))
        assert model.is_eog(model.eos) and model.is_eog(model.eos)
        assert not model.is_eog(ids[100]) and not model.is_eog(ids[100])
        # an id outside the vocabulary is an error, not a C++ exception that ends the process
        for bad in (-1, model.n_vocab, 2**31 - 1):
            with pytest.raises(ValueError, match="outside the vocabulary"):
                model.token_bytes(bad)
            with pytest.raises(ValueError, match="outside the vocabulary"):
                model.token_bytes(bad, special=False)
            with pytest.raises(ValueError, match="outside the vocabulary"):
                model.is_eog(bad)
        # many threads at once (the tokenizer threads and the engine): the same pieces
        out: list[list[bytes]] = [[] for _ in range(4)]

        def run(i: int) -> None:
            out[i] = [model.token_bytes(t) for t in reversed(range(300, 1300))]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert out[0] == out[1] == out[2] == out[3]
        assert out[0] == [model.token_bytes(t) for t in reversed(range(300, 1300))]
