/* `serve --pcap`: every packet a C loop hears and says, as pcapng (LINKTYPE_IPV4: an IPv4 + UDP header is
 * written around each INA packet from the peer's and the switch's addresses), with the impairment's decision
 * in the packet comment and the direction in the EPB flags. switchsim/capture.py writes the same bytes for
 * the Python server (tests/test_capture.py compares them). Header-only; a loop without a capture pays one
 * pointer test per packet. */
#ifndef INA_CAPTURE_H
#define INA_CAPTURE_H
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "ina_impair.h" /* INA_DECIDE_*: the decision noted with each packet */

typedef struct {
    FILE *f;
    uint64_t max_bytes, bytes, packets, skipped;
    uint32_t self_ip;   /* host order */
    uint16_t self_port; /* host order */
} ina_capture;

static inline void ina_cap_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); } /* pcapng: host byte order */
static inline void ina_cap_u16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

static inline int ina_capture_write(ina_capture *c, const void *p, size_t n)
{
    c->bytes += n;
    return fwrite(p, 1, n, c->f) == n ? 0 : -1;
}

/* the section header and one interface (IPv4, microseconds); -1 when the file cannot be written */
static inline int ina_capture_open(ina_capture *c, const char *path, uint64_t max_bytes, uint64_t self_id)
{
    memset(c, 0, sizeof *c);
    c->f = fopen(path, "wb");
    if (!c->f)
        return -1;
    c->max_bytes = max_bytes;
    c->self_ip = (uint32_t)(self_id >> 16), c->self_port = (uint16_t)self_id;
    uint8_t shb[28], idb[20];
    ina_cap_u32(shb, 0x0A0D0D0A), ina_cap_u32(shb + 4, 28), ina_cap_u32(shb + 8, 0x1A2B3C4D);
    ina_cap_u16(shb + 12, 1), ina_cap_u16(shb + 14, 0);
    memset(shb + 16, 0xFF, 8); /* section length unknown */
    ina_cap_u32(shb + 24, 28);
    ina_cap_u32(idb, 1), ina_cap_u32(idb + 4, 20), ina_cap_u16(idb + 8, 228), ina_cap_u16(idb + 10, 0);
    ina_cap_u32(idb + 12, 0), ina_cap_u32(idb + 16, 20);
    return ina_capture_write(c, shb, 28) | ina_capture_write(c, idb, 20);
}

static inline void ina_capture_close(ina_capture *c)
{
    if (c->f)
        fclose(c->f);
    c->f = NULL;
}

static inline const char *ina_capture_note(int decision)
{
    static const char *notes[8] = {"", "dropped", "duplicated", "dropped", "held", "dropped",
                                   "duplicated, held", "dropped"};
    return notes[decision & 7];
}

/* IPv4 + UDP around an INA packet; the IPv4 checksum is computed, UDP's left 0 (none, valid for IPv4) */
static inline void ina_capture_ip_udp(uint8_t h[28], uint32_t src, uint16_t sport, uint32_t dst, uint16_t dport,
                                      uint32_t len)
{
    uint16_t total = (uint16_t)(28 + len);
    uint8_t ip[20] = {0x45, 0, (uint8_t)(total >> 8), (uint8_t)total, 0, 0, 0x40, 0, 64, 17, 0, 0,
                      (uint8_t)(src >> 24), (uint8_t)(src >> 16), (uint8_t)(src >> 8), (uint8_t)src,
                      (uint8_t)(dst >> 24), (uint8_t)(dst >> 16), (uint8_t)(dst >> 8), (uint8_t)dst};
    uint32_t sum = 0;
    for (int i = 0; i < 20; i += 2)
        sum += (uint32_t)ip[i] << 8 | ip[i + 1];
    while (sum >> 16)
        sum = (sum & 0xFFFF) + (sum >> 16);
    ip[10] = (uint8_t)(~sum >> 8), ip[11] = (uint8_t)~sum;
    memcpy(h, ip, 20);
    uint16_t ulen = (uint16_t)(8 + len);
    uint8_t udp[8] = {(uint8_t)(sport >> 8), (uint8_t)sport, (uint8_t)(dport >> 8), (uint8_t)dport,
                      (uint8_t)(ulen >> 8), (uint8_t)ulen, 0, 0};
    memcpy(h + 20, udp, 8);
}

/* one packet (two parts a, b, as the loops carry them) from or to address id peer (IPv4 << 16 | port) */
static inline void ina_capture_record(ina_capture *c, int outbound, uint64_t peer, const uint8_t *a, uint32_t alen,
                                      const uint8_t *b, uint32_t blen, int decision)
{
    if (!c || !c->f)
        return;
    const char *note = ina_capture_note(decision);
    uint32_t len = alen + blen, nlen = (uint32_t)strlen(note);
    uint32_t data = (28 + len + 3) & ~3u, opts = (nlen ? 4 + ((nlen + 3) & ~3u) : 0) + 8 + 4;
    uint32_t total = 28 + data + opts + 4;
    if (c->bytes + total > c->max_bytes) {
        c->skipped++;
        return;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t us = (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
    uint8_t head[28 + 28], tail[4 + 260 + 12 + 4] = {0};
    ina_cap_u32(head, 6), ina_cap_u32(head + 4, total), ina_cap_u32(head + 8, 0);
    ina_cap_u32(head + 12, (uint32_t)(us >> 32)), ina_cap_u32(head + 16, (uint32_t)us);
    ina_cap_u32(head + 20, 28 + len), ina_cap_u32(head + 24, 28 + len);
    uint32_t src = c->self_ip, dst = (uint32_t)(peer >> 16);
    uint16_t sport = c->self_port, dport = (uint16_t)peer;
    if (!outbound)
        src = dst, dst = c->self_ip, sport = dport, dport = c->self_port;
    ina_capture_ip_udp(head + 28, src, sport, dst, dport, len);
    uint32_t t = data - 28 - len; /* padding first, then the options */
    if (nlen) {
        ina_cap_u16(tail + t, 1), ina_cap_u16(tail + t + 2, (uint16_t)nlen);
        memcpy(tail + t + 4, note, nlen);
        t += 4 + ((nlen + 3) & ~3u);
    }
    ina_cap_u16(tail + t, 2), ina_cap_u16(tail + t + 2, 4), ina_cap_u32(tail + t + 4, outbound ? 2 : 1);
    t += 8 + 4; /* epb_flags, then opt_endofopt (zeros) */
    ina_cap_u32(tail + t, total);
    int bad = ina_capture_write(c, head, 56) | (alen ? ina_capture_write(c, a, alen) : 0) |
              (blen ? ina_capture_write(c, b, blen) : 0) | ina_capture_write(c, tail, t + 4);
    c->packets += !bad;
}
#endif
