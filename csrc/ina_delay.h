/* The delay stage of a link (switchsim/delay.py; this kernel has no netem): frames read from one packet
 * socket go out of its partner `delay` seconds later, both ways, first in first out per direction, with the
 * interpreter off the per-frame path: recvmmsg batches straight into a ring of fixed-size slots per
 * direction, sendmmsg from those slots when due, ppoll until the next frame is due. Blocks, never spins. */
#ifndef INA_DELAY_H
#define INA_DELAY_H
#include <stdint.h>

/* bytes a slot holds: the stage's veths have tx checksumming, TSO, GSO and GRO off, so a frame is at most
 * the MTU plus its Ethernet (and VLAN) header; larger ones are counted (oversized) and lost */
#define INA_DELAY_SLOT 2048
#define INA_DELAY_BATCH 64 /* frames per recvmmsg / sendmmsg */

typedef struct {
    uint64_t received;     /* frames taken in (never the stage's own, which the kernel reports as outgoing) */
    uint64_t forwarded;    /* frames the far interface took */
    uint64_t dropped;      /* frames that found their direction at its limit */
    uint64_t send_errors;  /* frames the far interface refused (ENOBUFS: its peer's backlog full; ENETDOWN): lost */
    uint64_t oversized;    /* frames over INA_DELAY_SLOT bytes: lost */
    uint64_t send_blocked; /* sends that found the socket's buffer full (EAGAIN): the frame waits for POLLOUT */
    uint64_t marked;       /* link mode: ECN-capable IPv4 frames marked CE (arrived above the ECN threshold) */
    uint64_t queue_ns;     /* link mode: the time frames waited behind others to be serialized, summed */
} ina_delay_counters;
/* received = forwarded + dropped + send_errors + oversized + the frames still waiting (ina_delay_queued) */

typedef struct ina_delay ina_delay;

/* fds: nfds bound AF_PACKET sockets (the caller's, left open by ina_delay_free) in pairs: what comes in on
 * fds[2i] goes out of fds[2i + 1] and the other way round; delay_s >= 0; limit: frames waiting per direction
 * beyond which frames are dropped. NULL with errno set on bad arguments or no memory. */
ina_delay *ina_delay_new(const int *fds, int nfds, double delay_s, uint32_t limit);
/* Link mode (this kernel has no RED): each direction is also serialized at rate_bps (a frame leaves the queue
 * len * 8 / rate after the one before it, then travels the delay), so the stage's queue is the link's; a
 * frame that finds more than ecn_bytes waiting is marked CE if it is ECN-capable IPv4 (0: never), and one
 * that would make the queue exceed limit_bytes is dropped (0: the frame limit alone). rate_bps 0: off. */
void ina_delay_link(ina_delay *d, double rate_bps, uint32_t ecn_bytes, uint32_t limit_bytes);
void ina_delay_free(ina_delay *d);
/* Forward for about budget_ms, or until a signal interrupts the wait (so the caller sees it), then return 0;
 * -1 with errno set if polling fails. Call it in a loop. */
int ina_delay_run(ina_delay *d, int budget_ms);
const ina_delay_counters *ina_delay_counters_of(const ina_delay *d);
/* direction i: the frames that came in on fds[i], bound for fds[i ^ 1]; waiting now, and the most that waited */
uint32_t ina_delay_queued(const ina_delay *d, int i);
uint32_t ina_delay_queue_max(const ina_delay *d, int i);
#endif
