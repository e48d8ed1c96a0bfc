/* The switch on a UDP socket with the interpreter off the per-packet path: recvmmsg a batch (UDP_GRO
 * receives cut back into datagrams), run each packet through the core, sendmmsg what it emits (headers per
 * destination, result payloads sent from slot memory without a copy; same-size packets to one destination
 * as one UDP GSO send). The same network impairments as switchsim/server.py, done here in C. */
#ifndef INA_UDP_H
#define INA_UDP_H
#include <stdint.h>

#include "ina_core.h"

#define INA_UDP_BATCH 64

typedef struct {
    uint64_t bytes_in, bytes_out, send_errors, recv_batches, punts_dropped;
    uint64_t dropped[2], duplicated[2], reordered[2]; /* [0] = received side, [1] = sent side */
    uint64_t captured, capture_skipped;               /* serve --pcap: packets written, left out (size cap) */
    uint64_t gso_sends;    /* UDP GSO messages sent: same-size results to one worker in one send (ina_gso.h) */
    uint64_t gro_segments; /* datagrams that came in coalesced UDP_GRO receives, cut apart before the core */
} ina_udp_counters;

typedef struct ina_udp ina_udp;

/* fd: a bound IPv4 UDP socket owned by the caller; loss/dup/reorder are probabilities per packet and side */
ina_udp *ina_udp_new(ina_switch *sw, int fd, double loss, double dup, double reorder, uint64_t seed);
void ina_udp_free(ina_udp *u);
/* Serve a while: returns the number of control-plane packets (join, leave, abort, heartbeat, stats requests)
 * waiting, or 0 when idle for
 * 10 ms, after 256 batches, on a signal or once stopped, so the caller can look at its own state; -1 on a
 * socket error, with errno set. Call it in a loop. */
int ina_udp_run(ina_udp *u);
void ina_udp_stop(ina_udp *u);
/* which result runs go as UDP GSO sends: INA_UDP_GSO_OFF none, _LOOPBACK (the default) those to 127/8 and to a
 * job's loopback group (239.255/16), _ALL
 * every destination's. A kernel that refuses UDP_SEGMENT turns it off by itself. Why not all by default:
 * a receiver reading a veth through a packet socket (DPDK's net_af_packet, bmv2) gets a GSO send uncut. */
#define INA_UDP_GSO_OFF 0
#define INA_UDP_GSO_LOOPBACK 1
#define INA_UDP_GSO_ALL 2
void ina_udp_set_gso(ina_udp *u, int mode);
/* waiting control packet i: bytes, length, and source address id (IPv4 << 16 | port, host order) */
const uint8_t *ina_udp_punt(const ina_udp *u, int i, uint32_t *len, uint64_t *src);
void ina_udp_punt_clear(ina_udp *u);
const ina_udp_counters *ina_udp_counters_of(const ina_udp *u);
/* a control reply from the caller, sent (and captured) as the loop's own packets are; pkt is copied */
void ina_udp_send(ina_udp *u, uint64_t dst, const uint8_t *pkt, uint32_t len);
/* write every packet in and out to a pcapng file until it reaches max_bytes (self_id: the switch's address
 * id); -1 if the file cannot be opened */
int ina_udp_capture(ina_udp *u, const char *path, uint64_t max_bytes, uint64_t self_id);
void ina_udp_capture_close(ina_udp *u);
#endif
