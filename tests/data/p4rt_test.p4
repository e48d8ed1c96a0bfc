/* Small v1model program for tests/test_p4rt.py (the P4Runtime client, switchsim/p4rt.py).
 * It has one of each thing the client handles: exact, ternary and lpm tables, a default action,
 * an indirect counter, a packets meter, a register, a multicast group (egress writes the replica's rid into the
 * source MAC) and packet-in / packet-out headers on CPU port 255 (simple_switch_grpc --cpu-port 255).
 * Compile: p4c-bm2-ss -o p4rt_test.json --p4runtime-files p4rt_test.p4info.txtpb p4rt_test.p4 */
#include <core.p4>
#include <v1model.p4>

#define CPU_PORT 255

@controller_header("packet_out")
header packet_out_t {
    bit<9> egress_port;
    bit<7> pad;
}

@controller_header("packet_in")
header packet_in_t {
    bit<9> ingress_port;
    bit<7> pad;
}

header ethernet_t {
    bit<48> dstAddr;
    bit<48> srcAddr;
    bit<16> etherType;
}

struct headers_t {
    packet_out_t packet_out;
    packet_in_t  packet_in;
    ethernet_t   ethernet;
}

struct metadata_t { }

parser TParser(packet_in pkt, out headers_t hdr, inout metadata_t meta,
               inout standard_metadata_t sm) {
    state start {
        transition select(sm.ingress_port) {
            CPU_PORT: parse_packet_out;
            default: parse_ethernet;
        }
    }
    state parse_packet_out {
        pkt.extract(hdr.packet_out);
        transition parse_ethernet;
    }
    state parse_ethernet {
        pkt.extract(hdr.ethernet);
        transition accept;
    }
}

control TVerify(inout headers_t hdr, inout metadata_t meta) { apply { } }

control TIngress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    counter(16, CounterType.packets_and_bytes) port_count;
    meter(4, MeterType.packets) cpu_meter;
    register<bit<32>>(4) last_port;  // P4Info lookups only: simple_switch_grpc does not read registers

    action drop() { mark_to_drop(sm); }
    action set_port(bit<9> port) { sm.egress_spec = port; }
    action flood(bit<16> group) { sm.mcast_grp = group; }
    action to_cpu() {
        bit<2> color;
        cpu_meter.execute_meter((bit<32>)0, color);
        sm.egress_spec = CPU_PORT;
        if (color == V1MODEL_METER_COLOR_RED) {
            mark_to_drop(sm);
        }
    }
    action set_dst(bit<48> mac) { hdr.ethernet.dstAddr = mac; }

    table fwd {
        key = { sm.ingress_port : exact; }
        actions = { set_port; flood; to_cpu; drop; }
        default_action = drop();
        size = 64;
    }
    table acl {
        key = { hdr.ethernet.etherType : ternary; hdr.ethernet.srcAddr : exact; }
        actions = { drop; NoAction; }
        default_action = NoAction();
        size = 64;
    }
    table route {
        key = { hdr.ethernet.dstAddr : lpm; }
        actions = { set_dst; NoAction; }
        default_action = NoAction();
        size = 64;
    }

    apply {
        if (hdr.packet_out.isValid()) {
            sm.egress_spec = hdr.packet_out.egress_port;
            hdr.packet_out.setInvalid();
            return;
        }
        port_count.count((bit<32>)sm.ingress_port);
        last_port.write(0, (bit<32>)sm.ingress_port);
        fwd.apply();
        acl.apply();
        route.apply();
    }
}

control TEgress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    apply {
        if (sm.egress_port == CPU_PORT) {
            hdr.packet_in.setValid();
            hdr.packet_in.ingress_port = sm.ingress_port;
        } else if (sm.egress_rid != 0) {
            hdr.ethernet.srcAddr = (bit<48>)sm.egress_rid;
        }
    }
}

control TCompute(inout headers_t hdr, inout metadata_t meta) { apply { } }

control TDeparser(packet_out pkt, in headers_t hdr) {
    apply {
        pkt.emit(hdr.packet_in);
        pkt.emit(hdr.ethernet);
    }
}

V1Switch(TParser(), TVerify(), TIngress(), TEgress(), TCompute(), TDeparser()) main;
