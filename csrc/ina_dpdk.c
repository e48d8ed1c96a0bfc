/* DPDK poll loop around the core, in the shape of DPDK's examples/skeleton: burst in, work, burst out,
 * no allocation per packet but the reply mbufs. */
#include "ina_dpdk.h"
#include "ina_loop.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <rte_arp.h>
#include <rte_cycles.h>
#include <rte_eal.h>
#include <rte_ethdev.h>
#include <rte_ether.h>
#include <rte_ip.h>
#include <rte_errno.h>
#include <rte_lcore.h>
#include <rte_malloc.h>
#include <rte_mbuf.h>
#include <rte_udp.h>

#define BURST 32
#define RING 1024
#define POOL_SIZE 8191
#define PEER_BUCKETS 4096 /* MAC cache: direct-mapped by a keyed hash of the peer's IPv4 address */
#define RUN_POLLS 2000  /* empty polls before returning to the caller */
#define RUN_BURSTS 4096 /* bursts before returning to the caller, so it sees signals and its stop flag */
#define SPIN_POLLS 256  /* empty polls before sleeping between polls: workers may share our cores */
#define L2_L4 (sizeof(struct rte_ether_hdr) + sizeof(struct rte_ipv4_hdr) + sizeof(struct rte_udp_hdr))

/* A peer is named by its address id, IPv4 << 16 | UDP port (host order), as in the UDP loop, so the
 * control plane admits the same ids on both. Replies need its MAC, cached per IPv4 address (a host's ranks
 * share it, so they never evict one another); a colliding address evicts an entry, and the evicted host's next
 * packet restores it (its lost result is resent on request). */
typedef struct {
    uint32_t ip; /* host order; 0: empty */
    struct rte_ether_addr mac;
} peer_t;

struct ina_dpdk {
    ina_loop loop; /* core, impairments, punt queue */
    ina_capture cap;
    uint16_t port;
    uint32_t ip;       /* network order */
    uint16_t udp_port; /* network order */
    struct rte_ether_addr mac;
    struct rte_mempool *pool;
    volatile int stop;
    ina_dpdk_counters c;
    peer_t peers[PEER_BUCKETS];
    uint64_t peer_key;

    struct rte_mbuf *tx[BURST];
    uint16_t n_tx;
    uint16_t ip_id;
};

static void send_sink(void *ctx, uint64_t dst, const uint8_t *hdr, uint32_t hlen, const uint8_t *payload,
                      uint32_t len, int transient);

int ina_dpdk_eal_init(int argc, char **argv) { return rte_eal_init(argc, argv); }
uint16_t ina_dpdk_port_count(void) { return rte_eth_dev_count_avail(); }
void ina_dpdk_stop(ina_dpdk *d) { d->stop = 1; }
void ina_dpdk_punt_clear(ina_dpdk *d) { d->loop.punt.n = 0; }
const ina_dpdk_counters *ina_dpdk_counters_of(const ina_dpdk *d)
{
    ina_dpdk_counters *c = (ina_dpdk_counters *)&d->c;
    ina_loop_counters(&d->loop, c->dropped, c->duplicated, c->reordered, &c->punts_dropped);
    c->captured = d->cap.packets, c->capture_skipped = d->cap.skipped;
    return c;
}
void ina_dpdk_mac(ina_dpdk *d, uint8_t *mac) { memcpy(mac, d->mac.addr_bytes, RTE_ETHER_ADDR_LEN); }

const uint8_t *ina_dpdk_punt(const ina_dpdk *d, int i, uint32_t *len, uint64_t *src)
{
    return ina_loop_punt(&d->loop, i, len, src);
}

ina_dpdk *ina_dpdk_new(ina_switch *sw, uint16_t port, uint32_t ip, uint16_t udp_port, double loss, double dup,
                       double reorder, uint64_t seed, char *err, size_t errlen)
{
    if (!rte_eth_dev_is_valid_port(port)) {
        snprintf(err, errlen, "DPDK port %u does not exist (%u ports; check --vdev / the EAL arguments)", port,
                 rte_eth_dev_count_avail());
        return NULL;
    }
    ina_dpdk *d = rte_zmalloc("ina_dpdk", sizeof *d, 0);
    if (!d) {
        snprintf(err, errlen, "rte_zmalloc failed (EAL memory, -m)");
        return NULL;
    }
    if (ina_loop_init(&d->loop, sw, loss, dup, reorder, seed, 65536 + INA_HEADER_SIZE, send_sink, d)) {
        snprintf(err, errlen, "out of memory");
        ina_loop_free(&d->loop);
        rte_free(d);
        return NULL;
    }
    d->port = port;
    d->peer_key = ina_rng_key(seed ^ (uint64_t)rte_rdtsc());
    d->ip = rte_cpu_to_be_32(ip);
    d->udp_port = rte_cpu_to_be_16(udp_port);
    char name[32];
    snprintf(name, sizeof name, "ina_pool_%u", port);
    d->pool = rte_pktmbuf_pool_create(name, POOL_SIZE, 256, 0, RTE_MBUF_DEFAULT_BUF_SIZE,
                                      rte_eth_dev_socket_id(port));
    int rc = d->pool ? 0 : -rte_errno;
    struct rte_eth_conf conf;
    memset(&conf, 0, sizeof conf);
    uint16_t nrx = RING, ntx = RING;
    if (!rc)
        rc = rte_eth_dev_configure(port, 1, 1, &conf);
    if (!rc)
        rc = rte_eth_dev_adjust_nb_rx_tx_desc(port, &nrx, &ntx);
    if (!rc)
        rc = rte_eth_rx_queue_setup(port, 0, nrx, rte_eth_dev_socket_id(port), NULL, d->pool);
    if (!rc)
        rc = rte_eth_tx_queue_setup(port, 0, ntx, rte_eth_dev_socket_id(port), NULL);
    if (!rc)
        rc = rte_eth_dev_start(port);
    if (!rc)
        rc = rte_eth_macaddr_get(port, &d->mac);
    if (rc) {
        snprintf(err, errlen, "setting up DPDK port %u failed: %s", port, rte_strerror(-rc));
        ina_loop_free(&d->loop);
        rte_free(d);
        return NULL;
    }
    rte_eth_promiscuous_enable(port); /* not every PMD supports it; frames to our MAC arrive anyway */
    return d;
}

/* ------------------------------------------------------------------ peers */
static inline peer_t *peer_slot(ina_dpdk *d, uint32_t ip)
{
    return &d->peers[ina_rng_word(d->peer_key, ip) % PEER_BUCKETS];
}

static uint64_t learn_peer(ina_dpdk *d, const struct rte_ether_addr *mac, uint32_t ip_be, uint16_t port_be)
{
    uint32_t ip = rte_be_to_cpu_32(ip_be);
    peer_t *p = peer_slot(d, ip);
    p->ip = ip;
    rte_ether_addr_copy(mac, &p->mac);
    return (uint64_t)ip << 16 | rte_be_to_cpu_16(port_be);
}

/* ------------------------------------------------------------------ sending */
static void flush(ina_dpdk *d)
{
    uint16_t sent = rte_eth_tx_burst(d->port, 0, d->tx, d->n_tx);
    for (uint16_t i = 0; i < sent; i++)
        d->c.tx_bytes += rte_pktmbuf_pkt_len(d->tx[i]);
    d->c.tx_packets += sent;
    for (uint16_t i = sent; i < d->n_tx; i++) {
        d->c.tx_full++;
        rte_pktmbuf_free(d->tx[i]);
    }
    d->n_tx = 0;
}

static void enqueue(ina_dpdk *d, struct rte_mbuf *m)
{
    d->tx[d->n_tx++] = m;
    if (d->n_tx == BURST)
        flush(d);
}

/* a UDP datagram from the switch to peer dst: header + payload, gathered into one mbuf */
static int send_to(ina_dpdk *d, uint64_t dst, const uint8_t *hdr, uint32_t hlen, const uint8_t *payload,
                   uint32_t plen)
{
    const peer_t *p = peer_slot(d, (uint32_t)(dst >> 16));
    if (p->ip != (uint32_t)(dst >> 16)) {
        d->c.tx_no_peer++;
        return -1;
    }
    struct rte_mbuf *m = rte_pktmbuf_alloc(d->pool);
    if (!m) {
        d->c.tx_full++;
        return -1;
    }
    uint32_t len = (uint32_t)L2_L4 + hlen + plen;
    uint8_t *b = (uint8_t *)rte_pktmbuf_append(m, (uint16_t)len);
    if (len > UINT16_MAX || !b) { /* larger than one mbuf: send smaller packets (--elements-per-packet) */
        rte_pktmbuf_free(m);
        d->c.tx_full++;
        return -1;
    }
    struct rte_ether_hdr *eth = (struct rte_ether_hdr *)b;
    struct rte_ipv4_hdr *ip = (struct rte_ipv4_hdr *)(eth + 1);
    struct rte_udp_hdr *udp = (struct rte_udp_hdr *)(ip + 1);
    rte_ether_addr_copy(&p->mac, &eth->dst_addr);
    rte_ether_addr_copy(&d->mac, &eth->src_addr);
    eth->ether_type = rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4);
    memset(ip, 0, sizeof *ip);
    ip->version_ihl = RTE_IPV4_VHL_DEF;
    ip->type_of_service = ina_ecn_out(hdr); /* results ECN-capable (docs/protocol.md, "Congestion") */
    ip->total_length = rte_cpu_to_be_16((uint16_t)(len - sizeof *eth));
    ip->packet_id = rte_cpu_to_be_16(d->ip_id++);
    ip->fragment_offset = rte_cpu_to_be_16(RTE_IPV4_HDR_DF_FLAG);
    ip->time_to_live = 64;
    ip->next_proto_id = IPPROTO_UDP;
    ip->src_addr = d->ip;
    ip->dst_addr = rte_cpu_to_be_32((uint32_t)(dst >> 16));
    ip->hdr_checksum = rte_ipv4_cksum(ip);
    udp->src_port = d->udp_port;
    udp->dst_port = rte_cpu_to_be_16((uint16_t)dst);
    udp->dgram_len = rte_cpu_to_be_16((uint16_t)(sizeof *udp + hlen + plen));
    udp->dgram_cksum = 0; /* optional in IPv4 */
    memcpy(udp + 1, hdr, hlen);
    memcpy((uint8_t *)(udp + 1) + hlen, payload, plen);
    enqueue(d, m);
    return 0;
}

int ina_dpdk_send(ina_dpdk *d, uint64_t dst, const uint8_t *pkt, uint32_t len)
{
    if (len < INA_HEADER_SIZE)
        return -1;
    uint64_t before = d->c.tx_no_peer + d->c.tx_full;
    /* through the send-side impairment and the capture, as the core's own packets */
    ina_loop_send(&d->loop, dst, pkt, INA_HEADER_SIZE, pkt + INA_HEADER_SIZE, len - INA_HEADER_SIZE, 1);
    flush(d);
    return d->c.tx_no_peer + d->c.tx_full == before ? 0 : -1;
}

int ina_dpdk_capture(ina_dpdk *d, const char *path, uint64_t max_bytes)
{
    uint64_t self = (uint64_t)rte_be_to_cpu_32(d->ip) << 16 | rte_be_to_cpu_16(d->udp_port);
    if (ina_capture_open(&d->cap, path, max_bytes, self)) {
        ina_capture_close(&d->cap);
        return -1;
    }
    d->loop.cap = &d->cap;
    return 0;
}

void ina_dpdk_capture_close(ina_dpdk *d)
{
    d->loop.cap = NULL;
    ina_capture_close(&d->cap);
}

static void send_sink(void *ctx, uint64_t dst, const uint8_t *hdr, uint32_t hlen, const uint8_t *payload,
                      uint32_t len, int transient)
{
    (void)transient; /* send_to copies into the mbuf at once */
    send_to(ctx, dst, hdr, hlen, payload, len);
}

/* ------------------------------------------------------------------ receiving */
static void arp_reply(ina_dpdk *d, struct rte_mbuf *m)
{
    struct rte_ether_hdr *eth = rte_pktmbuf_mtod(m, struct rte_ether_hdr *);
    struct rte_arp_hdr *arp = (struct rte_arp_hdr *)(eth + 1);
    if (rte_pktmbuf_data_len(m) < sizeof *eth + sizeof *arp ||
        arp->arp_opcode != rte_cpu_to_be_16(RTE_ARP_OP_REQUEST) || arp->arp_data.arp_tip != d->ip) {
        d->c.not_ina++;
        rte_pktmbuf_free(m);
        return;
    }
    /* turn the request around in place */
    rte_ether_addr_copy(&eth->src_addr, &eth->dst_addr);
    rte_ether_addr_copy(&d->mac, &eth->src_addr);
    arp->arp_opcode = rte_cpu_to_be_16(RTE_ARP_OP_REPLY);
    arp->arp_data.arp_tha = arp->arp_data.arp_sha;
    arp->arp_data.arp_tip = arp->arp_data.arp_sip;
    rte_ether_addr_copy(&d->mac, &arp->arp_data.arp_sha);
    arp->arp_data.arp_sip = d->ip;
    d->c.arp_replies++;
    enqueue(d, m);
}

static void on_frame(ina_dpdk *d, struct rte_mbuf *m)
{
    uint32_t n = rte_pktmbuf_data_len(m);
    d->c.rx_bytes += rte_pktmbuf_pkt_len(m);
    struct rte_ether_hdr *eth = rte_pktmbuf_mtod(m, struct rte_ether_hdr *);
    if (n >= sizeof *eth && eth->ether_type == rte_cpu_to_be_16(RTE_ETHER_TYPE_ARP)) {
        arp_reply(d, m);
        return;
    }
    struct rte_ipv4_hdr *ip = (struct rte_ipv4_hdr *)(eth + 1);
    if (n < L2_L4 || eth->ether_type != rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4) ||
        ip->version_ihl != RTE_IPV4_VHL_DEF || ip->next_proto_id != IPPROTO_UDP || ip->dst_addr != d->ip) {
        d->c.not_ina++;
        rte_pktmbuf_free(m);
        return;
    }
    if (ip->fragment_offset & rte_cpu_to_be_16(RTE_IPV4_HDR_MF_FLAG | RTE_IPV4_HDR_OFFSET_MASK)) {
        /* a datagram to the switch in pieces: no INA packet is, so it is dropped, as a drop */
        ina_switch_count_dropped_in(d->loop.sw, INA_DROP_FRAGMENT);
        rte_pktmbuf_free(m);
        return;
    }
    struct rte_udp_hdr *udp = (struct rte_udp_hdr *)(ip + 1);
    uint32_t ulen = rte_be_to_cpu_16(udp->dgram_len);
    if (udp->dst_port != d->udp_port || ulen < sizeof *udp ||
        sizeof *eth + sizeof *ip + ulen > rte_pktmbuf_pkt_len(m)) {
        d->c.not_ina++;
        rte_pktmbuf_free(m);
        return;
    }
    if (m->nb_segs != 1) { /* a datagram to the switch in more than one mbuf: larger than any it takes */
        ina_switch_count_dropped_in(d->loop.sw, INA_DROP_OVERSIZED);
        rte_pktmbuf_free(m);
        return;
    }
    uint8_t *pkt = (uint8_t *)(udp + 1);
    uint32_t len = ulen - (uint32_t)sizeof *udp;
    if ((ip->type_of_service & 3) == INA_CE) /* docs/protocol.md, "Congestion" */
        ina_mark_congested(pkt, len);
    ina_loop_receive(&d->loop, learn_peer(d, &eth->src_addr, ip->src_addr, udp->src_port), pkt, len);
    rte_pktmbuf_free(m);
}

int ina_dpdk_run(ina_dpdk *d)
{
    struct rte_mbuf *rx[BURST];
    for (int idle = 0, bursts = 0; !d->stop && idle < RUN_POLLS && bursts < RUN_BURSTS; bursts++) {
        uint16_t n = rte_eth_rx_burst(d->port, 0, rx, BURST);
        if (!n) {
            if (idle == 0) { /* the line went quiet: let packets held back for reordering go */
                ina_loop_release_held(&d->loop);
                flush(d);
            }
            if (++idle > SPIN_POLLS)
                usleep(5);
            continue;
        }
        idle = 0;
        d->c.rx_packets += n;
        for (uint16_t i = 0; i < n; i++)
            on_frame(d, rx[i]);
        flush(d);
        if (d->loop.punt.n)
            return d->loop.punt.n;
    }
    flush(d);
    return 0;
}
