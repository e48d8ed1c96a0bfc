"""A small P4Runtime client for BMv2's simple_switch_grpc, in the style of p4lang/tutorials' p4runtime_lib.

`P4Info` reads a program's .p4info.txtpb and builds messages by name (table entries, default actions,
packet-outs) with values encoded as P4Runtime 1.3+ servers require: canonical bytestrings, the minimal
big-endian width (0 is b"\\x00"), checked against the bitwidth in the P4Info. `Switch` is one P4Runtime
connection (primary controller for one device): pipeline push, writes whose errors name each failed update,
counter reads, meter configs, and packet-in / packet-out on the stream channel (read by a background thread).

Needs the `p4` extra: p4runtime, grpcio and protobuf 3.20.x (every p4runtime wheel on PyPI, 1.3.0 to 1.6.0,
carries protoc < 3.19 generated code, which protobuf >= 4 refuses to import).
"""
from __future__ import annotations

import collections
import os
import queue
import threading

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


class SwitchUnavailable(ConnectionError, TimeoutError):
    """No P4Runtime server answered (not listening yet, or no arbitration reply) within the timeout."""


class Switch:
    """One P4Runtime connection to `grpc_addr` ("host:port" or "unix:/path") as the primary controller of
    `device_id`. timeout bounds the connection, the arbitration and every unary call (seconds)."""

    def __init__(self, grpc_addr: str, device_id: int = 0, election_id: tuple[int, int] = (0, 1),
                 timeout: float = 10.0, p4info: P4Info | None = None):
        self.addr, self.device_id, self.timeout, self.p4info = grpc_addr, device_id, timeout, p4info
        self.election_id = p4runtime_pb2.Uint128(high=election_id[0], low=election_id[1])
        self.stream_errors = collections.deque(maxlen=100)  # StreamError messages, e.g. refused packet-outs
        self._packets, self._arbitration, self._requests = queue.Queue(), queue.Queue(), queue.Queue()
        self._stream_error, self._closed = None, False
        self.channel = grpc.insecure_channel(grpc_addr, options=[("grpc.max_receive_message_length", 1 << 28),
                                                                 ("grpc.max_send_message_length", 1 << 28)])
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise SwitchUnavailable(f"no P4Runtime server at {grpc_addr} within {timeout} s") from None
        self.stub = p4runtime_pb2_grpc.P4RuntimeStub(self.channel)
        self._stream = self.stub.StreamChannel(iter(self._requests.get, None))
        self._reader = threading.Thread(target=self._read_stream, name=f"p4rt-stream {grpc_addr}", daemon=True)
        self._reader.start()
        try:
            self._arbitrate()
        except BaseException:
            self.close()
            raise

    multicast_group = staticmethod(multicast_group)

    def _arbitrate(self):
        """Master arbitration: the server answers OK to the primary (highest election id)."""
        req = p4runtime_pb2.StreamMessageRequest()
        req.arbitration.device_id = self.device_id
        req.arbitration.election_id.CopyFrom(self.election_id)
        self._requests.put(req)
        try:
            reply = self._arbitration.get(timeout=self.timeout)
        except queue.Empty:
            raise SwitchUnavailable(f"{self.addr}: no arbitration answer within {self.timeout} s") from None
        if isinstance(reply, grpc.RpcError):
            raise SwitchUnavailable(f"{self.addr}: stream channel closed: {reply.code().name}: {reply.details()}")
        if reply.status.code != code_pb2.OK:
            eid = (self.election_id.high, self.election_id.low)
            raise PermissionError(f"{self.addr}: not the primary controller of device {self.device_id} with "
                                  f"election id {eid} ({code_pb2.Code.Name(reply.status.code)}: "
                                  f"{reply.status.message})")
        return reply

    def _read_stream(self):
        """Background reader: packet-ins to one queue, arbitration replies to another, errors kept."""
        try:
            for msg in self._stream:
                kind = msg.WhichOneof("update")
                if kind == "packet":
                    self._packets.put(msg.packet)
                elif kind == "arbitration":
                    self._arbitration.put(msg.arbitration)
                elif kind == "error":
                    self.stream_errors.append(msg.error)
        except grpc.RpcError as e:
            if not self._closed:
                self._stream_error = e
                self._arbitration.put(e)

    def _info(self) -> P4Info:
        if self.p4info is None:
            raise RuntimeError("no P4Info: call set_pipeline() first or pass p4info= to Switch()")
        return self.p4info

    def set_pipeline(self, p4info: P4Info, bmv2_json_path: str, timeout: float | None = None):
        """Push the program (P4Info + BMv2 JSON) with VERIFY_AND_COMMIT; the switch forgets all entries."""
        with open(bmv2_json_path, "rb") as f:
            config = p4runtime_pb2.ForwardingPipelineConfig(p4info=p4info.message, p4_device_config=f.read())
        req = p4runtime_pb2.SetForwardingPipelineConfigRequest(
            device_id=self.device_id, election_id=self.election_id, config=config,
            action=p4runtime_pb2.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT)
        try:
            self.stub.SetForwardingPipelineConfig(req, timeout=timeout or max(60.0, self.timeout))
        except grpc.RpcError as e:
            raise P4RuntimeError(f"SetForwardingPipelineConfig({bmv2_json_path})", e) from None
        self.p4info = p4info

    def write(self, *updates):
        """One WriteRequest; each update is ("insert" | "modify" | "delete", entity or TableEntry, ...).
        Raises P4RuntimeError naming each failed update (the others may have been applied)."""
        if not updates:
            return
        req = p4runtime_pb2.WriteRequest(device_id=self.device_id, election_id=self.election_id)
        for kind, message in updates:
            if kind.lower() not in _UPDATES:
                raise ValueError(f"update type {kind!r}: use insert, modify or delete")
            req.updates.add(type=_UPDATES[kind.lower()], entity=entity(message))
        try:
            self.stub.Write(req, timeout=self.timeout)
        except grpc.RpcError as e:
            raise P4RuntimeError("Write", e, req) from None

    def insert(self, *entities):
        self.write(*[("insert", e) for e in entities])

    def modify(self, *entities):
        self.write(*[("modify", e) for e in entities])

    def delete(self, *entities):
        self.write(*[("delete", e) for e in entities])

    def read(self, *entities) -> list[p4runtime_pb2.Entity]:
        """Every entity matching the given ones (unset fields are wildcards)."""
        req = p4runtime_pb2.ReadRequest(device_id=self.device_id, entities=[entity(e) for e in entities])
        try:
            return [e for resp in self.stub.Read(req, timeout=self.timeout) for e in resp.entities]
        except grpc.RpcError as e:
            raise P4RuntimeError("Read", e) from None

    def read_counter(self, name: str, index: int | None = None) -> dict[int, tuple[int, int]]:
        """{index: (byte_count, packet_count)} of an indirect counter; every index when `index` is None."""
        entry = p4runtime_pb2.CounterEntry(counter_id=self._info().counter_id(name))
        if index is not None:
            entry.index.index = index
        return {e.counter_entry.index.index: (e.counter_entry.data.byte_count, e.counter_entry.data.packet_count)
                for e in self.read(entry)}

    def set_meter(self, name: str, index: int, cir: int, cburst: int, pir: int, pburst: int):
        """Configure one cell of an indirect meter (two-rate three-colour: rates in units per second, bursts
        in units; units = packets or bytes as the program declares). Meter cells exist, so this is a modify."""
        entry = p4runtime_pb2.MeterEntry(meter_id=self._info().meter_id(name))
        entry.index.index = index
        entry.config.cir, entry.config.cburst, entry.config.pir, entry.config.pburst = cir, cburst, pir, pburst
        self.modify(entry)

    def packet_out(self, payload: bytes, **metadata):
        """Send a frame through the CPU port; metadata: packet_out header fields by name (others 0)."""
        if self._stream_error is not None:
            raise ConnectionError(f"{self.addr}: stream channel closed: {self._stream_error.details()}")
        self._requests.put(p4runtime_pb2.StreamMessageRequest(packet=self._info().packet_out(payload, **metadata)))

    def packet_in(self, timeout: float | None = None) -> tuple[bytes, dict] | None:
        """The next packet-in as (payload, {packet_in field: value}), or None after `timeout` seconds."""
        try:
            packet = self._packets.get(timeout=timeout)
        except queue.Empty:
            if self._stream_error is not None:
                raise ConnectionError(f"{self.addr}: stream channel closed: {self._stream_error.details()}") \
                    from None
            return None
        return self._info().parse_packet_in(packet)

    def close(self):
        """End the stream (the server then drops this controller) and the channel; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(None)
        stream = getattr(self, "_stream", None)
        if stream is not None:
            stream.cancel()
            self._reader.join(timeout=5)
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
