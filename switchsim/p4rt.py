"""The P4Runtime client of the BMv2 backend: p4runtime-shell (p4runtime_sh) for what it does, and what it lacks.

`P4Info` reads a program's .p4info.txtpb and builds messages by name (table entries, default actions,
packet-outs) with values encoded as P4Runtime 1.3+ servers require: canonical bytestrings, the minimal
big-endian width (0 is b"\\x00"), checked against the bitwidth in the P4Info. `Switch` is one P4Runtime
connection (primary controller for one device) on p4runtime-shell's P4RuntimeClient: pipeline push, writes
whose errors name each failed update, counter reads, meter configs, and packet-in / packet-out on the stream
channel. `bind_shell` lends the connection to p4runtime-shell's shell objects (TableEntry,
MulticastGroupEntry, CounterEntry, MeterEntry), which switchsim/bmv2.py uses for its entries; p4/README.md
("P4Runtime clients") says what goes through p4runtime-shell and what stays here, and why.

Needs the `p4` extra: p4runtime-shell, p4runtime 1.4.1 (every p4runtime-shell release pins p4runtime <= 1.4.1),
grpcio and protobuf 3.20.x (every p4runtime wheel on PyPI, 1.3.0 to 1.6.0, carries protoc < 3.19 generated
code, which protobuf >= 4 refuses to import).
"""
from __future__ import annotations

import collections
import os
import tempfile

import grpc
from google.protobuf import text_format
from google.rpc import code_pb2, status_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc

from inaproto.gen_p4 import TOOL_ENV, TOOLCHAIN_BINS, find_tool  # noqa: F401 - the P4 tool lookup, here too

MatchField = p4info_pb2.MatchField
ActionRef = p4info_pb2.ActionRef

_UPDATES = {"insert": p4runtime_pb2.Update.INSERT, "modify": p4runtime_pb2.Update.MODIFY,
            "delete": p4runtime_pb2.Update.DELETE}
# Entity's oneof field for each message type it can hold (TableEntry -> "table_entry", ...).
_ENTITY_FIELDS = {f.message_type.full_name: f.name
                  for f in p4runtime_pb2.Entity.DESCRIPTOR.oneofs_by_name["entity"].fields}
_KINDS = {"table": "tables", "action": "actions", "counter": "counters", "meter": "meters",
          "register": "registers", "direct_counter": "direct_counters", "direct_meter": "direct_meters",
          "controller_packet_metadata": "controller_packet_metadata"}


def encode(value: int | bytes, bitwidth: int, what: str = "value") -> bytes:
    """`value` as a canonical P4Runtime bytestring (no leading zero bytes, 0 as b"\\x00"); ValueError if it
    does not fit in `bitwidth` bits. Servers since P4Runtime 1.3 reject other encodings."""
    n = _int(value, what)
    if n >> bitwidth:
        raise ValueError(f"{what}: {value!r} does not fit in {bitwidth} bits")
    return n.to_bytes(max(1, (n.bit_length() + 7) // 8), "big")


def decode(data: bytes) -> int:
    """A P4Runtime bytestring as an unsigned int."""
    return int.from_bytes(data, "big")


def _int(value, what: str) -> int:
    if isinstance(value, (bytes, bytearray)):
        return int.from_bytes(value, "big")
    if not isinstance(value, int):
        raise TypeError(f"{what}: expected an int or bytes, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{what}: {value} is negative (P4Runtime values are unsigned)")
    return value


def entity(message) -> p4runtime_pb2.Entity:
    """Wrap a TableEntry, PacketReplicationEngineEntry, MeterEntry, CounterEntry, ... into an Entity."""
    if isinstance(message, p4runtime_pb2.Entity):
        return message
    field = _ENTITY_FIELDS.get(message.DESCRIPTOR.full_name)
    if field is None:
        raise TypeError(f"a {message.DESCRIPTOR.full_name} is not a P4Runtime entity")
    out = p4runtime_pb2.Entity()
    getattr(out, field).CopyFrom(message)
    return out


def multicast_group(group_id: int, replicas) -> p4runtime_pb2.PacketReplicationEngineEntry:
    """Multicast group `group_id` with one replica per (egress_port, instance); BMv2 gives the instance to
    the replica's egress as standard_metadata.egress_rid."""
    pre = p4runtime_pb2.PacketReplicationEngineEntry()
    group = pre.multicast_group_entry
    group.multicast_group_id = group_id
    for port, instance in replicas:
        group.replicas.add(egress_port=port, instance=instance)
    return pre


class _Names:
    """Name -> P4Info message: full names and aliases first, then any unique dotted suffix
    ("MyIngress.fwd", "fwd"; "hdr.ipv4.dst", "ipv4.dst", "dst")."""

    def __init__(self, kind: str, items, name=lambda m: m.preamble.name, alias=lambda m: m.preamble.alias):
        self.kind, self.exact, self.suffix, self.full = kind, {}, collections.defaultdict(list), []
        for m in items:
            full = name(m)
            self.full.append(full)
            self.exact[full] = m
            self.exact.setdefault(alias(m) or full, m)
            parts = full.split(".")
            for i in range(1, len(parts)):
                self.suffix[".".join(parts[i:])].append(m)

    def __call__(self, key: str, where: str = "the P4Info"):
        if key in self.exact:
            return self.exact[key]
        hits = self.suffix.get(key, [])
        if len(hits) == 1:
            return hits[0]
        if hits:
            raise KeyError(f"{self.kind} {key!r} is ambiguous in {where}: use a longer name")
        known = ", ".join(sorted(self.full)) or "none"
        raise KeyError(f"no {self.kind} named {key!r} in {where} (known: {known})")


class P4Info:
    """A program's P4Info: ids by name, and the messages built from names and plain values."""

    def __init__(self, path_or_message):
        if isinstance(path_or_message, p4info_pb2.P4Info):
            self.message, self.path = path_or_message, None
        else:
            self.path = os.fspath(path_or_message)
            with open(self.path) as f:
                self.message = text_format.Parse(f.read(), p4info_pb2.P4Info())
        self._names = {k: _Names(k, getattr(self.message, f)) for k, f in _KINDS.items()}
        self._by_id = {m.preamble.id: m for f in _KINDS.values() for m in getattr(self.message, f)}

    def get(self, kind: str, name: str):
        """The P4Info message of a table / action / counter / meter / register / ... by full or short name."""
        return self._names[kind](name)

    def name(self, id_: int) -> str:
        """The full name of the entity with P4Info id `id_`."""
        return self._by_id[id_].preamble.name

    def table_id(self, name: str) -> int:
        return self.get("table", name).preamble.id

    def action_id(self, name: str) -> int:
        return self.get("action", name).preamble.id

    def counter_id(self, name: str) -> int:
        return self.get("counter", name).preamble.id

    def meter_id(self, name: str) -> int:
        return self.get("meter", name).preamble.id

    def register_id(self, name: str) -> int:
        return self.get("register", name).preamble.id

    def action(self, name: str, params: dict | None = None, table=None, default: bool = False):
        """An Action message; with `table`, the action must be one of its actions (and allowed as an entry,
        or as the default action if `default`). Every parameter must be given; ints or bytes."""
        a = self.get("action", name)
        if table is not None:
            _check_action_ref(table, a, default)
        params = dict(params or {})
        out = p4runtime_pb2.Action(action_id=a.preamble.id)
        for p in a.params:
            if p.name not in params:
                raise ValueError(f"action {a.preamble.name} needs parameter {p.name!r} ({p.bitwidth} bits)")
            out.params.add(param_id=p.id, value=encode(params.pop(p.name), p.bitwidth, f"{a.preamble.name}({p.name})"))
        if params:
            raise KeyError(f"action {a.preamble.name} has no parameter {', '.join(map(repr, params))} "
                           f"(has: {', '.join(p.name for p in a.params) or 'none'})")
        return out

    def table_entry(self, table: str, match: dict | None = None, action: str | None = None,
                    params: dict | None = None, priority: int | None = None) -> p4runtime_pb2.TableEntry:
        """A TableEntry. match: field name -> int or bytes (exact, optional; full value for ternary / lpm),
        (value, mask) for ternary, (value, prefix_len) for lpm, (low, high) for range; a don't-care value
        (mask 0, prefix 0, full range) is left out as P4Runtime requires. Tables with ternary, range or
        optional keys need a priority (> 0), others refuse one. No action: a key for delete / read."""
        t = self.get("table", table)
        entry = p4runtime_pb2.TableEntry(table_id=t.preamble.id)
        fields = _Names("match field", t.match_fields, name=lambda f: f.name, alias=lambda f: f.name)
        matches = [_field_match(fields(k, f"table {t.preamble.name}"), v) for k, v in (match or {}).items()]
        entry.match.extend(sorted((m for m in matches if m is not None), key=lambda m: m.field_id))
        prioritised = any(f.match_type in (MatchField.TERNARY, MatchField.RANGE, MatchField.OPTIONAL)
                          for f in t.match_fields)
        if prioritised and not priority:
            raise ValueError(f"table {t.preamble.name} has ternary/range/optional keys: give a priority > 0")
        if priority is not None and not prioritised:
            raise ValueError(f"table {t.preamble.name} has only exact/lpm keys: it takes no priority")
        if priority:
            entry.priority = priority
        if action is not None:
            entry.action.action.CopyFrom(self.action(action, params, table=t))
        return entry

    def default_action(self, table: str, action: str, params: dict | None = None) -> p4runtime_pb2.TableEntry:
        """The table's default action as a TableEntry (is_default_action); write it with modify."""
        t = self.get("table", table)
        entry = p4runtime_pb2.TableEntry(table_id=t.preamble.id, is_default_action=True)
        entry.action.action.CopyFrom(self.action(action, params, table=t, default=True))
        return entry

    def packet_metadata(self, direction: str) -> list[tuple[str, int, int]]:
        """(name, id, bitwidth) of each field of the packet_in / packet_out controller header."""
        header = self.get("controller_packet_metadata", direction)
        return [(m.name, m.id, m.bitwidth) for m in header.metadata]

    def packet_out(self, payload: bytes, **metadata) -> p4runtime_pb2.PacketOut:
        """A PacketOut; fields not named (padding) are sent as 0, since the server wants every field."""
        out = p4runtime_pb2.PacketOut(payload=bytes(payload))
        for name, id_, width in self.packet_metadata("packet_out"):
            out.metadata.add(metadata_id=id_, value=encode(metadata.pop(name, 0), width, f"packet_out.{name}"))
        if metadata:
            known = ", ".join(n for n, _, _ in self.packet_metadata("packet_out"))
            raise KeyError(f"packet_out has no field {', '.join(map(repr, metadata))} (has: {known})")
        return out

    def parse_packet_in(self, packet: p4runtime_pb2.PacketIn) -> tuple[bytes, dict[str, int]]:
        """(payload, {field name: value}) of a PacketIn (unknown field ids keep their number as the key)."""
        names = {id_: name for name, id_, _ in self.packet_metadata("packet_in")}
        return packet.payload, {names.get(m.metadata_id, m.metadata_id): decode(m.value) for m in packet.metadata}


def _check_action_ref(table, action, default: bool):
    """P4Runtime refuses actions a table does not list, and TABLE_ONLY / DEFAULT_ONLY ones in the wrong place."""
    refs = {r.id: r.scope for r in table.action_refs}
    name, tname = action.preamble.name, table.preamble.name
    if action.preamble.id not in refs:
        raise ValueError(f"action {name} is not an action of table {tname}")
    if refs[action.preamble.id] == (ActionRef.TABLE_ONLY if default else ActionRef.DEFAULT_ONLY):
        raise ValueError(f"action {name} cannot be {'the default' if default else 'an entry'} action of {tname}")


def _field_match(field, value) -> p4runtime_pb2.FieldMatch | None:
    """One key field; None for a don't-care value (P4Runtime wants those left out of the entry)."""
    w, what, mt = field.bitwidth, field.name, field.match_type
    fm = p4runtime_pb2.FieldMatch(field_id=field.id)
    if mt == MatchField.EXACT:
        fm.exact.value = encode(value, w, what)
    elif mt == MatchField.OPTIONAL:
        fm.optional.value = encode(value, w, what)
    elif mt == MatchField.TERNARY:
        v, mask = (_int(x, what) for x in (value if isinstance(value, tuple) else (value, (1 << w) - 1)))
        if v & ~mask:
            raise ValueError(f"{what}: value {v:#x} has bits outside mask {mask:#x}")
        if mask == 0:
            return None
        fm.ternary.value, fm.ternary.mask = encode(v, w, what), encode(mask, w, what)
    elif mt == MatchField.LPM:
        v, plen = (value if isinstance(value, tuple) else (value, w))
        v = _int(v, what)
        if not 0 <= plen <= w or v & ((1 << (w - plen)) - 1):
            raise ValueError(f"{what}: {v:#x}/{plen} is not a prefix of a {w}-bit field")
        if plen == 0:
            return None
        fm.lpm.value, fm.lpm.prefix_len = encode(v, w, what), plen
    elif mt == MatchField.RANGE:
        low, high = (_int(x, what) for x in value)
        if low > high:
            raise ValueError(f"{what}: empty range {low}..{high}")
        if low == 0 and high == (1 << w) - 1:
            return None
        fm.range.low, fm.range.high = encode(low, w, what), encode(high, w, what)
    else:
        raise ValueError(f"{what}: match type {MatchField.MatchType.Name(mt)} is not supported")
    return fm


class P4RuntimeError(RuntimeError):
    """A failed P4Runtime call. code: the gRPC status code; errors: (update index, code name, message)
    for each failed update of a Write (from the p4.v1.Error list in the status details)."""

    def __init__(self, what: str, rpc_error: grpc.RpcError, request=None):
        self.code = rpc_error.code()
        self.errors = _update_errors(rpc_error)
        lines = [f"{what} failed: {self.code.name}: {rpc_error.details()}"]
        for i, code, message in self.errors:
            shown = ""
            if request is not None and i < len(request.updates):
                u = request.updates[i]
                shown = " " + p4runtime_pb2.Update.Type.Name(u.type) + " " + \
                    text_format.MessageToString(u.entity, as_one_line=True)[:300]
            lines.append(f"  update {i}{shown}: {code}: {message}")
        super().__init__("\n".join(lines))


def _update_errors(rpc_error) -> list[tuple[int, str, str]]:
    """The failed updates named in a Write's status details (grpc-status-details-bin: a google.rpc.Status
    whose details hold one p4.v1.Error per update, OK for the ones that went through)."""
    for key, value in (rpc_error.trailing_metadata() or ()):
        if key != "grpc-status-details-bin":
            continue
        out = []
        for i, detail in enumerate(status_pb2.Status.FromString(value).details):
            err = p4runtime_pb2.Error()
            if detail.Unpack(err) and err.canonical_code != code_pb2.OK:
                out.append((i, code_pb2.Code.Name(err.canonical_code), err.message))
        return out
    return []


def _rpc_error(exc: BaseException) -> grpc.RpcError | None:
    """The grpc.RpcError behind an exception of p4runtime-shell (it raises P4RuntimeException holding it, or
    P4RuntimeWriteException `from None`, which keeps it as __context__), or the exception itself."""
    for e in (exc, getattr(exc, "grpc_error", None), exc.__context__):
        if isinstance(e, grpc.RpcError):
            return e
    return None


class SwitchUnavailable(ConnectionError, TimeoutError):
    """No P4Runtime server answered (not listening yet, or no arbitration reply) within the timeout."""


class _Deadline(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """A deadline on every unary call (Write, Read, pipeline push) that has none: p4runtime-shell's client
    sets none, and a hung server must not hang the controller."""

    def __init__(self, timeout: float, pipeline_timeout: float):
        self.timeout, self.pipeline_timeout = timeout, pipeline_timeout

    def _details(self, details):
        if details.timeout is not None:
            return details
        t = self.pipeline_timeout if "ForwardingPipelineConfig" in details.method else self.timeout
        return details._replace(timeout=t) if hasattr(details, "_replace") else _CallDetails(details, t)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details, timeout):
        self.method, self.timeout, self.metadata = details.method, timeout, details.metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


def _shell_client_class():
    """p4runtime-shell's P4RuntimeClient with the arbitration a controller needs (imported on first use:
    p4runtime_sh imports IPython)."""
    from p4runtime_sh.p4runtime import P4RuntimeClient

    class ShellClient(P4RuntimeClient):
        """p4runtime_sh.p4runtime.P4RuntimeClient (channel, stream channel and its reader thread, pipeline
        push, writes, reads) whose handshake raises instead of exiting the process: SwitchUnavailable when no
        arbitration answer comes within `timeout` (p4runtime-shell waits 2 s, then calls sys.exit), and
        PermissionError when `primary` is asked for and the server makes this client a backup (p4runtime-shell
        prints a line and goes on)."""

        def __init__(self, device_id, grpc_addr, election_id, timeout: float = 10.0, primary: bool = True):
            self.timeout, self.want_primary, self.arbitration = timeout, primary, None
            super().__init__(device_id, grpc_addr, election_id)

        def handshake(self):
            req = p4runtime_pb2.StreamMessageRequest()
            req.arbitration.device_id = self.device_id
            req.arbitration.election_id.high, req.arbitration.election_id.low = self.election_id
            self.stream_out_q.put(req)
            reply = self.get_stream_packet("arbitration", timeout=self.timeout)
            if reply is None:
                self.close()
                raise SwitchUnavailable(f"device {self.device_id}: no arbitration answer within {self.timeout} s "
                                        "(the stream channel closed, or the server is busy)")
            self.arbitration = reply.arbitration
            if self.want_primary and reply.arbitration.status.code != code_pb2.OK:
                self.close()
                raise PermissionError(f"not the primary controller of device {self.device_id} with election id "
                                      f"{tuple(self.election_id)} ({code_pb2.Code.Name(reply.arbitration.status.code)}"
                                      f": {reply.arbitration.status.message})")

        def close(self):
            """p4runtime-shell's tear_down, once (it deletes the channel)."""
            if getattr(self, "channel", None) is not None:
                self.tear_down()

        @property
        def primary(self) -> bool:
            return self.arbitration is not None and self.arbitration.status.code == code_pb2.OK

    return ShellClient


class Switch:
    """One P4Runtime connection to `grpc_addr` ("host:port" or "unix:/path") for `device_id`, as the primary
    controller (or, with primary=False, whatever the server makes it: a backup reads). timeout bounds the
    connection, the arbitration and every unary call (seconds).

    The connection is p4runtime-shell's (p4runtime_sh.p4runtime.P4RuntimeClient: `client`): its channel,
    stream channel and reader thread; the pipeline push is its set_fwd_pipe_config, single reads its read_one,
    packet-ins come from its stream reader's queue and packet-outs go into its stream queue. What is this
    class's own (p4runtime-shell lacks it, or gets it wrong): arbitration that raises (ShellClient), deadlines
    on unary calls, batched writes whose errors name each failed update (P4RuntimeError; p4runtime-shell
    0.0.6's write error parser loops forever when an update before the failed one went through), several
    entities in one Read (a counter's chosen cells), packet-in metadata by name and packet-out metadata from
    ints, and telling a closed stream from a quiet one. `bind_shell` lends the connection to p4runtime-shell's shell objects
    (TableEntry, MulticastGroupEntry, CounterEntry, MeterEntry)."""

    def __init__(self, grpc_addr: str, device_id: int = 0, election_id: tuple[int, int] = (0, 1),
                 timeout: float = 10.0, p4info: P4Info | None = None, primary: bool = True):
        self.addr, self.device_id, self.timeout, self.p4info = grpc_addr, device_id, timeout, p4info
        self.election_id = p4runtime_pb2.Uint128(high=election_id[0], low=election_id[1])
        self._errors = collections.deque(maxlen=100)  # StreamError messages, e.g. refused packet-outs
        self._closed, self.client = False, None
        probe = grpc.insecure_channel(grpc_addr)  # p4runtime-shell's client does not wait for the server
        try:
            grpc.channel_ready_future(probe).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise SwitchUnavailable(f"no P4Runtime server at {grpc_addr} within {timeout} s") from None
        finally:
            probe.close()
        try:
            self.client = _shell_client_class()(device_id, grpc_addr, tuple(election_id), timeout, primary)
        except SwitchUnavailable as e:
            raise SwitchUnavailable(f"{grpc_addr}: {e}") from None
        except PermissionError as e:
            raise PermissionError(f"{grpc_addr}: {e}") from None
        self.client.stub = p4runtime_pb2_grpc.P4RuntimeStub(  # the stream keeps the stub it was opened on
            grpc.intercept_channel(self.client.channel, _Deadline(timeout, max(60.0, timeout))))

    multicast_group = staticmethod(multicast_group)

    @property
    def primary(self) -> bool:
        """Whether the server made this connection the primary controller (its last arbitration answer)."""
        return self.client.primary

    @property
    def stream_errors(self) -> collections.deque:
        """StreamError messages the server sent (p4runtime-shell queues them as "unknown")."""
        q = self.client.stream_in_q["unknown"] if self.client else None
        while q is not None and not q.empty():
            msg = q.get_nowait()
            if msg is not None and msg.HasField("error"):
                self._errors.append(msg.error)
        return self._errors

    def _info(self) -> P4Info:
        if self.p4info is None:
            raise RuntimeError("no P4Info: call set_pipeline() first or pass p4info= to Switch()")
        return self.p4info

    def set_pipeline(self, p4info: P4Info, bmv2_json_path: str, timeout: float | None = None):
        """Push the program (P4Info + BMv2 JSON) with VERIFY_AND_COMMIT (p4runtime-shell's
        set_fwd_pipe_config, from the P4Info's file); the switch forgets all entries."""
        from p4runtime_sh.p4runtime import P4RuntimeException

        path, tmp = p4info.path, None
        if path is None:  # a P4Info built in memory: p4runtime-shell reads a file
            fd, tmp = tempfile.mkstemp(suffix=".p4info.txtpb")
            with os.fdopen(fd, "w") as f:
                f.write(text_format.MessageToString(p4info.message))
            path = tmp
        try:
            self.client.set_fwd_pipe_config(path, bmv2_json_path)
        except P4RuntimeException as e:
            raise P4RuntimeError(f"SetForwardingPipelineConfig({bmv2_json_path})", e.grpc_error) from None
        finally:
            if tmp:
                os.unlink(tmp)
        self.p4info = p4info

    def write(self, *updates):
        """One WriteRequest; each update is ("insert" | "modify" | "delete",
        entity or TableEntry, ...). Raises P4RuntimeError naming each failed update (the others may have been
        applied)."""
        if not updates:
            return
        req = p4runtime_pb2.WriteRequest(device_id=self.device_id, election_id=self.election_id)
        for kind, message in updates:
            if kind.lower() not in _UPDATES:
                raise ValueError(f"update type {kind!r}: use insert, modify or delete")
            req.updates.add(type=_UPDATES[kind.lower()], entity=entity(message))
        try:  # not p4runtime-shell's write: its error parser loops forever on a batch whose first update
            self.client.stub.Write(req)  # went through (P4RuntimeErrorIterator skips OK without moving on)
        except grpc.RpcError as e:
            raise P4RuntimeError("Write", e, req) from None

    def insert(self, *entities):
        self.write(*[("insert", e) for e in entities])

    def modify(self, *entities):
        self.write(*[("modify", e) for e in entities])

    def delete(self, *entities):
        self.write(*[("delete", e) for e in entities])

    def read(self, *entities) -> list[p4runtime_pb2.Entity]:
        """Every entity matching the given ones (unset fields are wildcards). One entity: p4runtime-shell's
        read_one; several in one ReadRequest: here (p4runtime-shell reads one entity a request)."""
        wanted = [entity(e) for e in entities]
        try:
            if len(wanted) == 1:
                replies = self.client.read_one(wanted[0])
            else:
                replies = self.client.stub.Read(p4runtime_pb2.ReadRequest(device_id=self.device_id, entities=wanted))
            return [e for resp in replies for e in resp.entities]
        except Exception as e:  # noqa: BLE001 - p4runtime-shell's P4RuntimeException, or a grpc.RpcError
            rpc = _rpc_error(e)
            if rpc is None:
                raise
            raise P4RuntimeError("Read", rpc) from None

    def read_counter(self, name: str, index: int | None = None) -> dict[int, tuple[int, int]]:
        """{index: (byte_count, packet_count)} of an indirect counter; every index when `index` is None."""
        entry = p4runtime_pb2.CounterEntry(counter_id=self._info().counter_id(name))
        if index is not None:
            entry.index.index = index
        return {e.counter_entry.index.index: (e.counter_entry.data.byte_count, e.counter_entry.data.packet_count)
                for e in self.read(entry)}

    def read_counter_cells(self, name: str, indices) -> dict[int, tuple[int, int]]:
        """{index: (byte_count, packet_count)} of some cells of a counter, in one Read (a wildcard read of a
        4096-cell counter is much slower; p4runtime-shell's CounterEntry reads one cell or all)."""
        cid = self._info().counter_id(name)
        cells = [p4runtime_pb2.CounterEntry(counter_id=cid, index=p4runtime_pb2.Index(index=i)) for i in indices]
        if not cells:
            return {}
        return {e.counter_entry.index.index: (e.counter_entry.data.byte_count, e.counter_entry.data.packet_count)
                for e in self.read(*cells)}

    def set_meter(self, name: str, index, cir: int, cburst: int, pir: int, pburst: int):
        """Configure cells of an indirect meter (two-rate three-colour: rates in units per second, bursts
        in units; units = packets or bytes as the program declares); index: one cell, or an iterable of them,
        written in one request. Meter cells exist, so this is a modify."""
        mid = self._info().meter_id(name)
        entries = []
        for i in ([index] if isinstance(index, int) else index):
            entry = p4runtime_pb2.MeterEntry(meter_id=mid)
            entry.index.index = i
            entry.config.cir, entry.config.cburst, entry.config.pir, entry.config.pburst = cir, cburst, pir, pburst
            entries.append(entry)
        self.modify(*entries)

    def _stream_closed(self) -> bool:
        return self.client is None or not self.client.stream_recv_thread.is_alive()

    def packet_out(self, payload: bytes, **metadata):
        """Send a frame through the CPU port (into p4runtime-shell's stream queue); metadata: packet_out header
        fields by name, as ints (others 0)."""
        if self._stream_closed():
            raise ConnectionError(f"{self.addr}: stream channel closed")
        self.client.stream_out_q.put(p4runtime_pb2.StreamMessageRequest(packet=self._info().packet_out(payload,
                                                                                                     **metadata)))

    def packet_in(self, timeout: float | None = None) -> tuple[bytes, dict] | None:
        """The next packet-in as (payload, {packet_in field: value}), or None after `timeout` seconds;
        ConnectionError once the stream has closed (p4runtime-shell's reader then only queues None)."""
        msg = self.client.get_stream_packet("packet", timeout=timeout) if self.client else None
        if msg is None:
            if self._stream_closed():
                raise ConnectionError(f"{self.addr}: stream channel closed")
            return None
        return self._info().parse_packet_in(msg.packet)

    def close(self):
        """End the stream (the server then drops this controller) and the channel; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.client is not None:
            self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_shell_owner: Switch | None = None


def bind_shell(switch: Switch | None):
    """Lend `switch`'s connection and P4Info to p4runtime-shell's shell objects (p4runtime_sh.shell.client and
    .context, which its TableEntry, MulticastGroupEntry, CounterEntry, MeterEntry, PacketOut use), quiet
    (its verbose option prints every message it builds); None gives them back. p4runtime-shell keeps one
    connection per process: binding a second open Switch while the first is open is refused."""
    global _shell_owner
    from p4runtime_sh import shell
    from p4runtime_sh.global_options import global_options

    if switch is None:
        shell.client, _shell_owner = None, None
        return
    if _shell_owner is not None and _shell_owner is not switch and not _shell_owner._closed:
        raise RuntimeError(f"p4runtime-shell already holds {_shell_owner.addr} in this process (one connection "
                           "per process)")
    shell.client = switch.client
    shell.context.set_p4info(switch._info().message)
    global_options["verbose"] = False
    _shell_owner = switch
