"""The torch backend's failure protocol alone (hostlib/integrations/torch_failover.py): its states move only
along TRANSITIONS, a join is voted, a switch that cannot be reached puts the group on gloo with a re-join
every retry_every calls, a recovery's result is a value, and the call path never calls a lane of a connection
that is gone. One rank, a file store, no process group."""
from __future__ import annotations

import socket
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="torch (the torch extra) is not installed")
dist = pytest.importorskip("torch.distributed")

from hostlib.integrations.torch_failover import TRANSITIONS, Failover, Kept, Place, State  # noqa: E402


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def failover(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    f = Failover(store, 0, 1, timedelta(seconds=20), f"127.0.0.1:{_free_port()}", 1, "fixed",
                 {"join_timeout": 1.0, "timeout": 1.0}, retry_every=3)
    yield f
    f.close()


def test_every_transition_is_between_named_states_and_every_state_is_reached():
    assert {a for a, _, _ in TRANSITIONS} | {b for _, b, _ in TRANSITIONS} == set(State) - {State.CLOSED}
    assert all(isinstance(why, str) and why for _, _, why in TRANSITIONS)


def test_an_unreachable_switch_puts_the_group_on_gloo_and_it_retries_on_schedule(failover):
    with pytest.warns(RuntimeWarning, match="the calls go through gloo"):
        failover.start(strict=False)
    assert failover.state is State.ON_GLOO and failover.comm is None and failover.retry_at == 3
    assert failover.counters["faults"] == 1
    assert [failover.connection(n) for n in (0, 1, 2)] == [None] * 3  # no join tried before call 3
    assert failover.vote.votes == 2  # the first join's ready and verdict votes only
    assert failover.connection(3) is None  # call 3 tries (a vote) and fails: the next try at 6
    assert failover.state is State.ON_GLOO and failover.retry_at == 6 and failover.counters["failed_rejoins"] == 1
    total = failover.gloo_sum(torch.arange(4, dtype=torch.float32))
    assert total.tolist() == [0.0, 1.0, 2.0, 3.0] and failover.counters["gloo_calls"] == 1


def test_strict_names_the_switch(failover):
    from hostlib import errors

    with pytest.raises(errors.SwitchUnreachable, match="INA_STRICT=1"):
        failover.start(strict=True)


def test_a_move_off_the_table_is_refused(failover):
    with pytest.raises(RuntimeError, match="no transition joining -> recovering"):
        failover._move(State.RECOVERING)


def test_a_recovery_returns_the_calls_sum_as_a_value(failover):
    """One rank, the switch failed under call 5 with nothing landed: its sum comes from gloo; the group is on
    gloo after, with a re-join retry_every calls after the highest call any rank was in."""
    with pytest.warns(RuntimeWarning):
        failover.start(strict=False)
    failover.retry_at, failover.state = 0, State.JOINED  # as after a join, without a switch
    x = torch.full((6,), 2.0)
    total = failover.recover(5, Place(5, 6), x, None, Kept(4, 0, torch.zeros(6)), None)
    assert total.tolist() == [2.0] * 6 and total.data_ptr() != x.data_ptr()
    assert failover.state is State.ON_GLOO and failover.retry_at == 8 and failover.recovery.epoch == 1


def test_a_lane_of_a_dropped_connection_takes_the_general_path(failover):
    """The queue's thread may drop the connection and join a new one between the caller's lane lookup and its
    call: a lane whose persistent call belongs to another connection is not called; the sum takes the general
    path on the connection of the moment. A lane of the live connection runs its own call and counts on itself."""
    from types import SimpleNamespace

    from hostlib.integrations.torch_calls import Lane, SwitchCalls

    class Connection:  # the Communicator's side the call path uses
        max_elements, window = 256, 4
        gen = SimpleNamespace(max_elements=256, window=4)

        def __init__(self):
            self.calls = 0

        def lands_blocks(self, flat, codec):
            return False

        def allreduce(self, x, out=None, codec=None, elements=None):
            self.calls += 1
            out[...] = 2 * x

        def close(self):
            pass

    class Call(SimpleNamespace):  # a persistent call: sums its array in place (here: triples it)
        def __call__(self):
            self.flat[...] = 3 * self.flat

    with pytest.warns(RuntimeWarning):
        failover.start(strict=False)
    live = failover.comm = Connection()
    counted: dict = {}
    calls = SwitchCalls(failover, "fixed", {}, lambda what, path, n=1: counted.update({(what, path): n}))
    x = torch.arange(100, dtype=torch.float32)
    stale = Lane(Call(comm=Connection(), flat=x.numpy(), elements=256, kept=None), ("float32", "switch (fixed)"))
    assert calls.sum(x, stale).tolist() == [2.0 * k for k in range(100)]  # the live connection's allreduce
    assert live.calls == 1 and stale.calls == 0 and counted == {("float32", "switch (fixed)"): 1}
    y = torch.ones(10)
    own = Lane(Call(comm=live, flat=y.numpy(), elements=256, kept=(0, y.numpy())), ("float32", "switch (fixed)"))
    assert calls.sum(y, own) is y and y.tolist() == [3.0] * 10 and own.calls == 1 and live.calls == 1
    kept = calls._kept()  # made from the lane's tail only now
    assert kept.call == 1 and kept.start == 0 and kept.total is own.call.kept[1]
