"""What goes to disk and to the store is compressed only where that pays, and always
comes back as it was; a stored piece that does not decode is refused."""

from __future__ import annotations

import random

import numpy as np
import pytest

from statecache.formats import codec


def floats(n: int, dtype: str) -> bytes:
    """Values of a narrow range, as KV and recurrent states hold: their exponent bytes
    repeat, their mantissas do not."""
    return np.random.default_rng(0).normal(0, 1, n).astype(dtype).tobytes()


@pytest.mark.parametrize("width", [1, 2, 4])
def test_round_trips_and_raw_where_nothing_is_saved(width: int) -> None:
    rnd = random.Random(width)
    for data in (b"", b"x", bytes(1001), rnd.randbytes(5000), floats(999, "<f4") + b"abc"):
        kind, stored = codec.compress(data, 1, width)
        assert bytes(codec.decode(kind, stored, len(data))) == data
        if data[:1000] == rnd.randbytes(0) or len(set(data)) > 200:
            assert kind == codec.RAW  # random bytes do not shrink: stored as they are
    kind, stored = codec.compress(bytes(4096), 1, width)
    assert kind != codec.RAW and len(stored) < 100
    assert codec.compress(bytes(4096), 0, width)[0] == codec.RAW  # level 0: off


def test_planes_pay_on_floats_and_a_small_saving_is_not_kept() -> None:
    # f16 values held as f32: the low mantissa bytes are zero, in every other word
    f32 = np.frombuffer(floats(1 << 14, "<f2"), dtype="<f2").astype("<f4").tobytes()
    plain = len(codec._compressor(1).compress(f32))
    kind, stored = codec.compress(f32, 1, 4)
    assert kind == codec.ZSTD_PLANES4 and len(stored) < plain
    # f16 values of a normal distribution save about 10%: under MIN_SAVING, kept raw
    assert codec.compress(floats(1 << 14, "<f2"), 1, 2)[0] == codec.RAW


def test_a_packer_samples_while_compression_does_not_pay() -> None:
    p = codec.Packer(1, 2)
    noise = [random.Random(i).randbytes(2048) for i in range(40)]
    kinds = [p.encode(b)[0] for b in noise]
    assert set(kinds) == {codec.RAW} and not p.pays
    assert (p.raw_bytes, p.stored_bytes) == (40 * 2048, 40 * 2048)
    # zeros: the next sample finds that it pays again, and every piece is compressed
    kinds = [p.encode(bytes(2048))[0] for _ in range(codec.SAMPLE + 3)]
    assert kinds.index(codec.ZSTD_PLANES2) < codec.SAMPLE
    assert kinds[-3:] == [codec.ZSTD_PLANES2] * 3 and p.pays


def test_a_piece_that_does_not_decode_is_refused() -> None:
    kind, stored = codec.compress(bytes(4096), 1, 4)
    with pytest.raises(codec.BadCodec):
        codec.decode(kind, stored, 4095)  # another size than it claims
    with pytest.raises(codec.BadCodec):
        codec.decode(kind, bytes(stored)[:-3], 4096)
    with pytest.raises(codec.BadCodec):
        codec.decode(99, stored, 4096)
    with pytest.raises(codec.BadCodec):
        codec.decode(codec.RAW, b"abc", 4)
