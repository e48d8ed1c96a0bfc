/* The aggregator core behind a DPDK poll loop: rx burst, parse Ethernet/IPv4/UDP (and answer ARP for the
 * switch's address), run each INA packet through the core, build the replies in fresh mbufs, tx burst.
 * Workers are learned from their frames (MAC, IP, UDP port), so kernel-UDP workers reach it through any
 * port DPDK drives: a NIC, af_packet/af_xdp on a veth, memif, tap. */
#ifndef INA_DPDK_H
#define INA_DPDK_H
#include <stddef.h>
#include <stdint.h>

#include "ina_core.h"


typedef struct {
    uint64_t rx_packets, tx_packets, rx_bytes, tx_bytes, tx_full, tx_no_peer, not_ina, arp_replies, punts_dropped;
    uint64_t dropped[2], duplicated[2], reordered[2]; /* impairments: [0] received side, [1] sent side */
    uint64_t captured, capture_skipped;               /* serve --pcap: packets written, left out (size cap) */
} ina_dpdk_counters;

typedef struct ina_dpdk ina_dpdk;

/* rte_eal_init; returns its result */
int ina_dpdk_eal_init(int argc, char **argv);
uint16_t ina_dpdk_port_count(void);
/* port: DPDK port id; ip (host order) and udp_port: the switch's address. NULL with err filled on failure */
ina_dpdk *ina_dpdk_new(ina_switch *sw, uint16_t port, uint32_t ip, uint16_t udp_port, double loss, double dup,
                       double reorder, uint64_t seed, char *err, size_t errlen);
/* like ina_udp_run: returns the number of control requests waiting, or 0 after a while / when stopped */
int ina_dpdk_run(ina_dpdk *d);
void ina_dpdk_stop(ina_dpdk *d);
const uint8_t *ina_dpdk_punt(const ina_dpdk *d, int i, uint32_t *len, uint64_t *src);
void ina_dpdk_punt_clear(ina_dpdk *d);
/* send an INA packet (header + payload) to a peer (address id IPv4 << 16 | port) seen before, through the
 * send-side impairment and the capture; 0 on success */
int ina_dpdk_send(ina_dpdk *d, uint64_t dst, const uint8_t *pkt, uint32_t len);
/* as ina_udp_capture (the switch's address is its own ip and udp_port) */
int ina_dpdk_capture(ina_dpdk *d, const char *path, uint64_t max_bytes);
void ina_dpdk_capture_close(ina_dpdk *d);
const ina_dpdk_counters *ina_dpdk_counters_of(const ina_dpdk *d);
void ina_dpdk_mac(ina_dpdk *d, uint8_t *mac);
#endif
