"""docs/protocol.md as a spec: its tables are generated from inaproto/wire.py (inaproto/gen_doc.py) and must be
current, and its worked example, parsed from the page as a reader would, replays against the reference
switch and the C core with every answer byte for byte as printed."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from inaproto import gen_doc, wire
from switchsim import native
from switchsim.model import Switch

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def test_generated_parts_are_current():
    """A change of wire.py (a field, a message, a constant, a drop reason) without `python -m inaproto.gen_doc`
    fails here."""
    assert DOC.read_text() == gen_doc.render(DOC.read_text()), "run: python -m inaproto.gen_doc"
    assert gen_doc.main(["--check"]) == 0


def test_a_drifted_table_is_caught(tmp_path, monkeypatch):
    page = tmp_path / "protocol.md"
    page.write_text(DOC.read_text().replace("| 24 | 4 | `call_len` |", "| 24 | 4 | `call_length` |"))
    monkeypatch.setattr(gen_doc, "PATH", str(page))
    assert gen_doc.main(["--check"]) == 1


def example_steps() -> list[tuple[str, str, bytes]]:
    """The worked example as the page shows it: (sender, receiver, bytes) per hex block; a request shown cut
    short is padded with the zeros the page says it has."""
    text = DOC.read_text().split("<!-- BEGIN GENERATED: example -->")[1].split("<!-- END GENERATED: example -->")[0]
    steps = []
    for who, to, size, block in re.findall(r"\*\*(.+?) → (.+?)\*\*: [^\n]*?(\d+) bytes[^\n]*\n```\n(.*?)```", text, re.S):
        data = bytes.fromhex(block.replace("\n", " "))
        steps.append((who, to, data.ljust(int(size), b"\0")))
    return steps


@pytest.mark.parametrize("backend", ["model", "c"])
def test_the_worked_example_replays(backend):
    if backend == "c":
        native.require()
    make = native.CoreSwitch if backend == "c" else Switch
    sw = make({1: 2}, slots=4, max_elements=64, secret=0x5EC2E7, boot=0xB0075EED)
    addresses = {"rank 0": ("127.0.0.1", 40000), "rank 1": ("127.0.0.1", 40001)}
    names = {v: k for k, v in addresses.items()}
    steps = example_steps()
    assert sum(who == "switch" for who, _, _ in steps) == 7, "3 join_waits, 2 join_acks, 2 results"
    requests = [i for i, (who, _, _) in enumerate(steps) if who != "switch"]
    for i, nxt in zip(requests, requests[1:] + [len(steps)]):
        who, _, data = steps[i]
        printed = [(to, reply) for _, to, reply in steps[i + 1:nxt]]
        got = [(names[dst], out) for out, dst in sw.process(data, addresses[who])]
        assert got == printed, (i, who)
    assert wire.unpack(steps[-1][2]).msg_type == wire.MSG_RESULT
