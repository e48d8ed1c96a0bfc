"""The allgather top-k path (codec="topk"): stochastic value codecs draw a fresh stream per (step, rank,
tensor), reproducibly, and the step counters travel with a pickled state."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from hostlib import sparse
from hostlib.integrations.common import GradientReducer

GRAD = np.random.default_rng(11).standard_normal(2000).astype(np.float32)


def reducer(rank=0, value="qsgd", **kw):
    r = GradientReducer(codec="topk", ratio=0.05, value=value, error_feedback=False, **kw)
    r.connect(rank, 2)
    r.sent = []
    r.allgather = lambda blob: (r.sent.append(blob), [blob, blob])[1]
    return r


def values(blob):
    return sparse.DeepReduce.decode(blob)[1]


@pytest.mark.parametrize("value", ["qsgd", "nc"])
def test_each_step_rank_and_bucket_draws_its_own_rounding(value):
    a = reducer(0, value)
    a.average(GRAD, key=0)
    a.average(GRAD, key=0)  # the same gradient again (no error feedback): only the seed differs
    a.average(GRAD, key=1)
    b = reducer(1, value)
    b.average(GRAD, key=0)
    step0, step1, bucket1, rank1 = (values(x) for x in a.sent + b.sent)
    for other in (step1, bucket1, rank1):
        assert not np.array_equal(step0, other)  # different stochastic codes, not just another seed field
    again = reducer(0, value)
    again.average(GRAD, key=0)
    again.average(GRAD, key=0)
    assert again.sent == a.sent[:2]  # the same (step, rank, bucket): the same bytes


def test_a_user_seed_moves_every_stream_and_deterministic_codecs_keep_one_container():
    a, b = reducer(0, value_params={"seed": 7}), reducer(0)
    a.average(GRAD, key=0)
    b.average(GRAD, key=0)
    assert not np.array_equal(values(a.sent[0]), values(b.sent[0]))
    plain = reducer(0, value="none")
    assert plain.strategy.container_for(3, 1, "x") is plain.strategy.container


def test_step_counters_survive_pickling():
    a = reducer(0)
    a.average(GRAD, key=0)
    copy = pickle.loads(pickle.dumps(a))
    assert copy.strategy.steps == {0: 1}
    copy.connect(0, 2)
    copy.sent = []
    copy.allgather = lambda blob: (copy.sent.append(blob), [blob, blob])[1]
    copy.average(GRAD, key=0)
    a.average(GRAD, key=0)
    assert copy.sent[0] == a.sent[1]
