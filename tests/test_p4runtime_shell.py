"""p4runtime-shell (p4runtime_sh), the P4Runtime client P4 users know, against the BMv2 backend as a user
drives it: attached as a second, backup client to a running `switchsim serve --backend bmv2 --p4runtime SOCKET`
to read what the project's controller wrote (the job's session, its members, the multicast group, counters)
while the controller goes on serving; and as the primary of a bare simple_switch_grpc, pushing p4/ina.p4 and
writing and reading its entries. Skips, naming what is missing, where BMv2 cannot run (switchsim.bmv2.why_not:
no simple_switch_grpc, no p4 extra, not root)."""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest

grpc = pytest.importorskip("grpc", reason="needs the p4 extra (p4runtime-shell, grpcio)")

from inaproto import gen_p4, wire
from inabench.harness import SwitchProcess
from switchsim import bmv2

from .conftest import BMv2Harness

pytestmark = pytest.mark.skipif(bool(bmv2.why_not()), reason=bmv2.why_not() or "-")


@pytest.fixture
def shell():
    """p4runtime_sh.shell, torn down after the test (it holds one connection per process)."""
    from p4runtime_sh import shell as sh

    yield sh
    if sh.client is not None:
        sh.teardown()


class AttachableHarness(BMv2Harness):
    """The BMv2 harness (job 1's ranks joined) with BMv2's P4Runtime server on a socket the test names."""

    def __init__(self, jobs, socket_path, **kw):
        self.socket_path = socket_path
        super().__init__(jobs, **kw)

    def serve(self, args):
        return SwitchProcess(*args, "--p4runtime", self.socket_path, backend="bmv2")

    def round(self, k: int, pid: int) -> list:
        """Rank 0 and rank 1 send slot 0's packet `pid`: the results that came back."""
        out = self.send(0, update(0, k, pid)) + self.send(1, update(1, k, pid))
        return [wire.unpack(d) for _, d in out if d[1] == wire.MSG_RESULT]


def update(rank: int, k: int, pid: int) -> bytes:
    values = (np.arange(64, dtype=np.int64) * (rank + 1) + k).astype(">i4")
    return wire.pack(wire.MSG_UPDATE, job=1, rank=rank, packet_id=pid, slot=0, set=pid & 1, count=64,
                     codec=wire.CODEC_INT32, exp_cur=0, exp_next=0, payload=values.tobytes())


def value(param) -> int:
    return int.from_bytes(param.value, "big")


def test_shell_as_a_backup_reads_what_the_controller_wrote(shell, capsys):
    tmp = tempfile.mkdtemp(prefix="ina-p4sh-")
    sock = os.path.join(tmp, "p4rt.sock")
    h = AttachableHarness({1: 2}, sock)
    try:
        assert os.path.exists(sock)
        assert len(h.round(5, 0)) == 2  # a result to each rank

        # as a user would: p4runtime-shell's default election id (1, 0) is below the controller's, so a backup
        shell.setup(device_id=bmv2.DEVICE_ID, grpc_addr=f"unix:{sock}", election_id=(1, 0), verbose=False)
        assert "not the primary client" in capsys.readouterr().out

        entry = shell.TableEntry("jobs")
        entry.match["hdr.ina.job"] = "1"
        (job,) = list(entry.read())
        params = {name: value(job.action[name]) for name in ("session", "world", "group", "failed")}
        assert params == {"session": h.session, "world": 2, "group": 2, "failed": 0}

        members = {int.from_bytes(e.match["hdr.ina.rank"].exact.value, "big"): value(e.action["port"])
                   for e in shell.TableEntry("members").read()}
        assert members == {r: h.socks[r].getsockname()[1] for r in range(2)}  # the port each joined from

        (group,) = list(shell.MulticastGroupEntry(2).read())
        assert sorted(r.instance for r in group.replicas) == [1, 2]  # egress_rid = rank + 1

        stats = h.stats()  # the controller answers with the shell attached
        received = {c.index: c.packet_count for c in shell.CounterEntry("received").read()}
        assert received[0] == stats["jobs"]["1"]["received"] == 2
        cell = shell.CounterEntry("multicast")
        cell.index = 0
        (multicast,) = list(cell.read())
        assert multicast.packet_count == stats["jobs"]["1"]["multicast"] == 1

        # a backup reads, never writes
        entry = shell.TableEntry("jobs")(action="set_job")
        entry.match["hdr.ina.job"] = "1"
        entry.action.set(world="2", slots="512", max_elements="64", slot_base="0", session="1", first_id="0",
                         group="2", index="0", failed="1")
        with pytest.raises(grpc.RpcError) as denied:
            entry.modify()
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        shell.teardown()

        # the controller is still the primary: the next round completes as before
        assert len(h.round(6, 1)) == 2
        h.close()
        assert not os.path.exists(sock)  # serve removed the socket it was told to make
    finally:
        h.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_shell_pushes_the_pipeline_as_primary(shell):
    """p4runtime-shell as the only client of a bare simple_switch_grpc: pushes p4/ina.p4 (its
    set_fwd_pipe_config from p4/build), writes the switch's default action and a job entry, reads them."""
    if bmv2.why_not():
        pytest.skip(f"needs BMv2: {bmv2.why_not()}")
    ns = bmv2.BMv2Namespace()
    assert not ns.error, ns.error  # BMv2 and root are here: a namespace that cannot be made is a bug
    proc = None
    try:
        proc = bmv2.BMv2Process([ns.switch_if], ns.ns)
        shell.setup(device_id=0, grpc_addr=f"unix:{proc.socket}", election_id=(1, 0), verbose=False,
                    config=shell.FwdPipeConfig(gen_p4.P4INFO, gen_p4.JSON))
        default = shell.TableEntry("switch_config")(action="set_switch", is_default=True)
        default.action.set(mac=bmv2.SWITCH_MAC, ip=ns.switch_ip, port=str(wire.DEFAULT_PORT), nc_det="0", boot="7")
        default.modify()
        entry = shell.TableEntry("jobs")(action="set_job")
        entry.match["hdr.ina.job"] = "3"
        entry.action.set(world="4", slots="16", max_elements="64", slot_base="0", session="0xdeadbeef",
                         first_id="1", group="4", index="0", failed="0")
        entry.insert()
        (back,) = list(shell.TableEntry("jobs").read())
        assert int.from_bytes(back.action["session"].value, "big") == 0xDEADBEEF
        (cfg,) = list(shell.TableEntry("switch_config")(is_default=True).read())
        assert int.from_bytes(cfg.action["boot"].value, "big") == 7
        assert all(c.packet_count == 0 for c in shell.CounterEntry("drops").read())
        assert shell.APIVersion()
    finally:
        if shell.client is not None:
            shell.teardown()
        if proc is not None:
            proc.stop()
        ns.close()
