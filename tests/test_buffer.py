"""The reader-buffer model against hand-computed timelines."""

import copy
import math
import random

import pytest

from tokenflow.core.buffer import (
    ReaderBuffer,
    effective_throughput,
    paper_token_weight,
    token_weight,
)


def test_playback_buffer_and_consumption():
    b = ReaderBuffer(rate=10.0, arrival_time=0.0)
    b.on_tokens(1.0, 11)  # TTFT 1 s, 11 tokens at once
    assert b.ttft == 1.0
    assert b.buffer(1.0) == 11
    assert b.buffer(1.5) == pytest.approx(6.0)  # 5 read in 0.5 s
    assert b.consumed(2.0) == pytest.approx(10.0)
    assert b.stall_time(2.0) == 0.0


def test_stall_accumulates_only_while_empty_and_unfinished():
    b = ReaderBuffer(rate=10.0, arrival_time=0.0)
    b.on_tokens(0.0)
    b.on_tokens(1.0)  # reader ran dry at 0.1 s, waited 0.9 s
    assert b.stall_time(1.0) == pytest.approx(0.9)
    b.on_finish(1.0)
    assert b.stall_time(5.0) == pytest.approx(0.9)  # no stall after the end


def test_level_reads_the_buffer_without_moving_the_playhead():
    """The scheduler's snapshot reads level(t); the later accounting (stall,
    buffers at arrival) must come out as if it had never asked."""
    rng = random.Random(3)
    asked, plain = ReaderBuffer(rate=7.0, arrival_time=0.0), ReaderBuffer(rate=7.0, arrival_time=0.0)
    t = 0.0
    assert asked.level(0.5) == 0.0  # no first token yet
    for _ in range(200):
        t += rng.expovariate(5.0)
        if rng.random() < 0.5:
            n = rng.randint(1, 4)
            asked.on_tokens(t, n)
            plain.on_tokens(t, n)
        else:
            later = t + rng.random()
            assert asked.level(later) == pytest.approx(copy.deepcopy(plain).buffer(later))
    assert asked.stall_time(t + 5) == pytest.approx(plain.stall_time(t + 5))
    assert asked.buffer_at_arrival == pytest.approx(plain.buffer_at_arrival)


def test_a_reader_without_history_keeps_the_same_levels_and_stalls():
    """The scheduler's readers keep no per-token history; their buffer and
    stall must still be those of the full model."""
    rng = random.Random(5)
    full, lean = ReaderBuffer(rate=9.0, arrival_time=0.0), ReaderBuffer(rate=9.0, arrival_time=0.0, history=False)
    t = 0.0
    for _ in range(300):
        t += rng.expovariate(4.0)
        n = rng.randint(1, 5)
        full.on_tokens(t, n)
        lean.on_tokens(t, n)
        assert lean.level(t + 0.3) == pytest.approx(full.level(t + 0.3))
    assert lean.delivered == full.delivered and lean.ttft == full.ttft
    assert full.stall_time(t + 9) > 0
    assert lean.stall_time(t + 9) == pytest.approx(full.stall_time(t + 9))
    assert not lean.arrivals and not lean.buffer_at_arrival and len(full.arrivals) == full.delivered


def test_buffer_at_arrival_and_weights():
    b = ReaderBuffer(rate=1.0, arrival_time=0.0)
    b.on_tokens(0.0, 20)  # buffers seen: 0..19
    assert b.buffer_at_arrival == list(range(20))
    w = b.weights(output_len=100)  # full <= 10, zero >= 20
    assert w[:11] == [1.0] * 11
    assert w[15] == pytest.approx(0.5)
    assert b.effective_tokens(100) == pytest.approx(11 + sum((20 - k) / 10 for k in range(11, 20)))


def test_token_weight_shapes():
    assert token_weight(0, 100) == 1.0
    assert token_weight(10, 100) == 1.0
    assert token_weight(15, 100) == pytest.approx(0.5)
    assert token_weight(20, 100) == 0.0
    assert paper_token_weight(5, tau=10, alpha=0.1) == 1.0
    assert paper_token_weight(15, tau=10, alpha=0.1) == pytest.approx(0.5)
    assert paper_token_weight(30, tau=10, alpha=0.1) == 0.0


def test_qoe_on_time_is_one_and_late_is_less():
    r, n = 10.0, 50
    on_time = ReaderBuffer(rate=r, arrival_time=0.0)
    for k in range(n):
        on_time.on_tokens(1.0 + k / r)
    assert on_time.qoe(expected_ttft=1.0) == pytest.approx(1.0)
    late = ReaderBuffer(rate=r, arrival_time=0.0)
    for k in range(n):
        late.on_tokens(3.0 + k / r)  # two seconds late throughout
    q = late.qoe(expected_ttft=1.0)
    # expected area over [1, 8]: ramp 5 s to 50 then flat 2 s; actual: ramp starts at 3
    expected = 0.5 * 50 * 5 + 50 * 2
    actual = 0.5 * 50 * 5
    assert q == pytest.approx(actual / expected)


def test_bad_rates_rejected():
    for bad in (0, -1, math.nan, math.inf):
        with pytest.raises(ValueError):
            ReaderBuffer(rate=bad, arrival_time=0.0)


def test_effective_throughput_divides_by_wall_time():
    b = ReaderBuffer(rate=1.0, arrival_time=0.0)
    b.on_tokens(0.0, 5)
    assert effective_throughput([b], 2.0) == pytest.approx(b.effective_tokens() / 2.0)
