/* The worker protocol of hostlib/worker.py in C: one allreduce's window, retransmission and result
 * handling, with the codec kernels called per packet and sendmmsg/recvmmsg batches. hostlib/fastpath.py
 * drives it; the Python loop stays the definition and the fallback. */
#ifndef INA_WORKER_H
#define INA_WORKER_H
#include <stddef.h>
#include <stdint.h>

#include "ina_cc.h"

#define INA_WK_INT32 0 /* src: native int32 */
#define INA_WK_FIXED 1 /* src: float32, quantized with the agreed exponent */
#define INA_WK_NC 2    /* src: float32, NC codes */

/* ina_wk_run results */
#define INA_WK_DONE 0
#define INA_WK_AGAIN 1         /* the time budget ran out (or a signal came); call again */
#define INA_WK_TIMEOUT 2       /* a packet had no result within timeout; timeout_pid/slot/tries tell which */
#define INA_WK_SWITCH_ERROR 3  /* the switch sent MSG_ERROR of this session: the datagram is in error */
#define INA_WK_ENCODE_ERROR 4  /* a codec kernel failed (status in sys_errno) */
#define INA_WK_SYSTEM_ERROR 5  /* a socket call failed (errno in sys_errno) */
#define INA_WK_BAD_RESULT 6    /* a result the codec cannot decode into out (NC code 0x80: a corrupt payload) */
/* INA_WK_REFUSED, no switch: on UDP its port refused (ECONNREFUSED: ICMP port unreachable) and
 * INA_WK_REFUSED_AFTER_MS passed since the first refusal with no datagram received; on shared memory the
 * switch's process is gone or its segment was removed (ina_shm_switch_gone) */
#define INA_WK_REFUSED 7

#define INA_WK_REFUSED_AFTER_MS INA_REFUSED_AFTER_MS /* inaproto.timers.REFUSED_AFTER */

#define INA_WK_BATCH 64
#define INA_WK_GRO_MIN 8 /* dense calls of fewer packets receive without UDP_GRO */
/* results of packets this much later than one still out: it was lost (a gap), resent at once (TCP's fast
 * retransmit); not under INA_CC_NONE */
#define INA_WK_DUPTHRESH 3
#define INA_WK_REPAIR_BINS 32
#define INA_WK_ERROR_MAX 256 /* an error is never larger than the join it answers (INA_JOIN_SIZE) */

typedef struct {
    /* set by the caller before ina_wk_start */
    int fd; /* connected, non-blocking UDP socket (when shm is NULL) */
    int group_fd; /* > 0: the job's loopback group socket (connected to the switch too), where results may come
                   * (wire.FLAG_GROUP); 0 or -1: none */
    struct ina_shm_client *shm; /* or the shared-memory transport's port (ina_shm.h): rings instead of fd */
    uint16_t job;
    uint8_t rank, world;
    uint32_t window, k;
    uint32_t session;          /* of the joined generation, in every packet */
    /* protocol v3: the call's identity in every packet (results must carry the same call), and the boot id of
     * the join_ack (echoed, not checked) */
    uint8_t call_kind;         /* wire.call_kind: the worker codec (1 int32, 2 fixed, 3 nc, 4 dither) | 0x80 sparse */
    uint16_t call;             /* the call number since the join, mod 2^16 */
    uint32_t call_len;         /* the call's length in elements */
    uint32_t boot;
    uint32_t first_slot;       /* lane j (packet q's is q mod window; a sparse stream's, its index) uses slot */
    const uint32_t *slot_uses; /* (first_slot + j) mod window, whose i-th packet has id slot_uses[slot] + i */
    uint32_t *stream_rounds;   /* sparse: filled with the rounds each stream used (window entries) */
    int kind, deterministic;
    uint64_t seed;
    const void *src;
    uint64_t n;
    const int8_t *exps; /* per block: this worker's exponent (fixed, nc) */
    int8_t *agreed;     /* per block: the max over workers, filled from results */
    void *result;       /* per element: int32 sums (int32, fixed) or uint8 codes (nc); unused when out is set */
    void *out;          /* NULL, or per element the decoded sum, written as each result arrives: int32 (int32),
                         * float32 (fixed, nc); may be src itself (in place: a block is read for the last time
                         * before its result can arrive) */
    void *keep;         /* NULL, or (with out) where the sums of elements keep_from.. are copied too as they land,
                         * from the caches: a persistent call's kept tail (hostlib/persistent.py) */
    uint64_t keep_from;
    uint8_t *done;      /* per packet of the stream: nb + D entries, zeroed */
    double rto, min_rto, max_rto, timeout;
    double srtt, rttvar; /* the round-trip estimate, carried over calls */
    int have_srtt;
    ina_cc cc;           /* the congestion window (ina_cc.h), carried over calls; dense calls follow it */
    /* block-sparse allreduce (worker.py _allreduce_sparse): one stream per slot, rounds of one block */
    int sparse;
    const uint8_t *held; /* per block: this worker's block is non-zero */
    /* in: 1 to send runs of same-size packets as UDP GSO sends / to receive with UDP_GRO (ina_gso.h says why);
     * out: cleared when the kernel refused it, so the caller can skip it from the next call on */
    int gso, gro;
    uint64_t gso_sends, gro_segments; /* GSO messages sent; datagrams that came in coalesced receives */
    /* filled by ina_wk_start / ina_wk_run */
    uint32_t nb, D, total, ndone; /* sparse: ndone counts the blocks received */
    uint32_t streams, streams_done;
    uint64_t packets_sent, bytes_sent, packets_received, bytes_received;
    uint64_t heartbeat_answers; /* the switch's answers to this worker's heartbeats (not in packets_received) */
    uint64_t switch_heard; /* datagrams of this job's generation (session checked), heartbeat answers included:
                            * what counts as hearing the switch (junk from its address does not) */
    uint64_t retransmissions, duplicate_results, stale_results;
    uint64_t spurious_retransmissions; /* resends answered within half a round trip: the original was not lost */
    uint64_t fast_retransmits; /* resends before their timeout: at a gap (results of INA_WK_DUPTHRESH later
                                * packets came first) or a call's tail probe */
    /* resent packets by how long their result took from the first send, in half smoothed round trips (the
     * last bin: INA_WK_REPAIR_BINS / 2 round trips or more): how many round trips a loss costs */
    uint32_t repairs[INA_WK_REPAIR_BINS];
    int overflow;
    uint32_t timeout_pid, timeout_slot, timeout_tries;
    int sys_errno;
    uint8_t error[INA_WK_ERROR_MAX]; /* INA_WK_SWITCH_ERROR: the error datagram as received, header included */
    uint32_t error_len;
    /* ERR_DROPPED of this generation (the switch dropped a packet of this worker for a mistake of its own, told
     * once per reason): informational, never a stop nor pending: counted, the last one kept (header included,
     * cut to INA_WK_ERROR_MAX) for the caller's notes; dropped_len 0: none this call */
    uint64_t switch_drops;
    uint8_t dropped[INA_WK_ERROR_MAX];
    uint32_t dropped_len;
    void *priv;
} ina_wk;

#define INA_WK_BAD_PARAMETERS (-1)
#define INA_WK_NO_MEMORY (-2)
int ina_wk_start(ina_wk *w); /* 0, INA_WK_BAD_PARAMETERS or INA_WK_NO_MEMORY */
int ina_wk_run(ina_wk *w, int budget_ms);
void ina_wk_finish(ina_wk *w);

#endif
