/* What the UDP, shared-memory and DPDK loops do between their I/O, written once: a received packet goes
 * through the receive-side impairment into the core; a control request the core punts goes to the punt
 * queue (which counts every request it cannot take as one of the core's drops); each packet the core
 * emits goes through the send-side impairment to the loop's send function. A loop keeps only its
 * transport (socket batches, Ethernet frames, rings) and hands this its packets. Header-only. */
#ifndef INA_LOOP_H
#define INA_LOOP_H
#include <stdint.h>

#include "ina_capture.h"
#include "ina_core.h"
#include "ina_impair.h"
#include "ina_punt.h"

typedef struct {
    ina_switch *sw;
    ina_impair side[2];  /* [0] received packets, [1] sent packets */
    ina_punt_queue punt; /* control requests for the caller */
    ina_out out[INA_MAX_OUT];
    /* the transport: sends header + payload to an address id; transient: the payload's memory is reused
     * once it returns (a held packet, an error whose payload the core may rewrite) */
    ina_sink send;
    void *send_ctx;
    ina_capture *cap; /* serve --pcap, else NULL */
} ina_loop;

/* both impairment sides (seeds seed and seed + 1, as the Python server) and the punt queue; -1 when out of
 * memory, after which ina_loop_free is still safe */
static inline int ina_loop_init(ina_loop *l, ina_switch *sw, double loss, double dup, double reorder,
                                uint64_t seed, size_t max_len, ina_sink send, void *send_ctx)
{
    int bad = 0;
    for (int i = 0; i < 2; i++)
        bad |= ina_impair_init(&l->side[i], loss, dup, reorder, seed + (uint64_t)i, max_len);
    l->sw = sw;
    l->send = send;
    l->send_ctx = send_ctx;
    l->cap = NULL;
    ina_punt_init(&l->punt);
    return bad ? -1 : 0;
}

static inline void ina_loop_free(ina_loop *l)
{
    ina_impair_free(&l->side[0]);
    ina_impair_free(&l->side[1]);
}

/* a packet to address id dst, through the send-side impairment (and the capture, which notes its fate) */
static inline void ina_loop_send(ina_loop *l, uint64_t dst, const uint8_t *hdr, uint32_t hlen,
                                 const uint8_t *payload, uint32_t len, int transient)
{
    if (!ina_impair_active(&l->side[1]) && !l->cap) {
        l->send(l->send_ctx, dst, hdr, hlen, payload, len, transient);
        return;
    }
    int d = ina_impair_active(&l->side[1]) ? ina_impair_decide(&l->side[1]) : 0;
    ina_capture_record(l->cap, 1, dst, hdr, hlen, payload, len, d);
    ina_impair_act(&l->side[1], d, dst, hdr, hlen, payload, len, transient, l->send, l->send_ctx);
}

/* an ina_sink for the receive side: the packet is processed before its buffer is reused, so transient
 * does not matter here */
static inline void ina_loop_deliver(void *ctx, uint64_t src, const uint8_t *pkt, uint32_t len,
                                    const uint8_t *unused, uint32_t unused_len, int transient)
{
    ina_loop *l = ctx;
    (void)unused, (void)unused_len, (void)transient;
    int n = ina_switch_process(l->sw, pkt, len, src, l->out);
    if (n == INA_PUNT) {
        ina_punt_push(&l->punt, l->sw, pkt, len, src);
        return;
    }
    for (int i = 0; i < n; i++) {
        const ina_out *o = &l->out[i];
        /* an error's payload is the job's failure, rewritten by its next failure: transient, like a held packet */
        ina_loop_send(l, o->dst, o->hdr, INA_HEADER_SIZE, o->payload, o->len, !o->stable);
    }
}

/* a packet the transport received from address id src; pkt's buffer may be reused once this returns */
static inline void ina_loop_receive(ina_loop *l, uint64_t src, const uint8_t *pkt, uint32_t len)
{
    if (!ina_impair_active(&l->side[0]) && !l->cap) {
        ina_loop_deliver(l, src, pkt, len, NULL, 0, 0);
        return;
    }
    int d = ina_impair_active(&l->side[0]) ? ina_impair_decide(&l->side[0]) : 0;
    ina_capture_record(l->cap, 0, src, pkt, len, NULL, 0, d);
    ina_impair_act(&l->side[0], d, src, pkt, len, pkt + len, 0, 1, ina_loop_deliver, l);
}

/* docs/protocol.md, "Congestion": a data packet that arrived with ECN CE in its IP header is taken as if it
 * carried INA_FLAG_CONGESTED (server.congested); pkt is the loop's own receive buffer */
static inline int ina_data_message(uint8_t type)
{
    return type == INA_MSG_UPDATE || type == INA_MSG_SPARSE_UPDATE || type == INA_MSG_RESULT ||
           type == INA_MSG_SPARSE_RESULT;
}

static inline void ina_mark_congested(uint8_t *pkt, uint32_t len)
{
    if (len > INA_OFF_FLAGS && ina_data_message(pkt[INA_OFF_MSG_TYPE]))
        pkt[INA_OFF_FLAGS] |= INA_FLAG_CONGESTED;
}

/* the ECN field a packet the switch sends leaves with: ECT(0) for data packets (results), none for control
 * answers (hdr: its INA header) */
static inline uint8_t ina_ecn_out(const uint8_t *hdr) { return ina_data_message(hdr[INA_OFF_MSG_TYPE]) ? INA_ECT0 : 0; }

/* the line went quiet or the loop stops: let the packets held back for reordering go (the caller then
 * flushes its send batch) */
static inline void ina_loop_release_held(ina_loop *l)
{
    ina_impair_flush(&l->side[0], ina_loop_deliver, l);
    ina_impair_flush(&l->side[1], l->send, l->send_ctx);
}

/* the impairment and punt counters, into a loop's counters struct ([0] received side, [1] sent side) */
static inline void ina_loop_counters(const ina_loop *l, uint64_t dropped[2], uint64_t duplicated[2],
                                     uint64_t reordered[2], uint64_t *punts_dropped)
{
    *punts_dropped = l->punt.dropped;
    for (int i = 0; i < 2; i++) {
        dropped[i] = l->side[i].dropped;
        duplicated[i] = l->side[i].duplicated;
        reordered[i] = l->side[i].reordered;
    }
}

/* waiting control request i: bytes, length and source address id */
static inline const uint8_t *ina_loop_punt(const ina_loop *l, int i, uint32_t *len, uint64_t *src)
{
    *len = l->punt.len[i];
    *src = l->punt.src[i];
    return l->punt.buf[i];
}
#endif
