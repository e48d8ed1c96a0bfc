/* A worker's congestion window (hostlib/cc.py is its twin, tests/test_cc.py checks that both take the same
 * steps): how many of its packets may be in flight, following the path. It starts small and doubles per
 * round trip (slow start), then grows by INA_CC_INCREASE packets per round trip (half a standard TCP flow's)
 * while results come back unmarked, and shrinks by INA_CC_BETA, at most once per round trip, when a result
 * carries FLAG_CONGESTED: the switch ORs every contribution's mark into the round, so every worker of the job
 * sees the same signal. A worker marks its next update congested when a result reached it CE-marked (its
 * downlink is congested) or, on a path where no link marks, when INA_CC_BATCH round trips in a row were more
 * than the target above the path's base (the delay signal). Losses are not a signal: random loss is repaired
 * (fast retransmit, timeout), not slowed down for. docs/protocol.md, "Congestion". */
#ifndef INA_CC_H
#define INA_CC_H
#include <stdint.h>

#define INA_CC_NONE 0 /* SwitchML's fixed window: every lane at once, a timeout per loss (the baseline) */
#define INA_CC_ECN 1  /* the window follows the aggregate's FLAG_CONGESTED; workers echo CE marks only */
#define INA_CC_AIMD 2 /* as ECN, and the delay signal where no link marks (the default) */

#define INA_CC_INITIAL 10        /* packets in flight before the first result (RFC 6928's initial window) */
#define INA_CC_MIN 2             /* never fewer */
/* the doubles (the share kept on a congested round, the delay target, the timeout's floor) are in ina_cc.c */

typedef struct {
    int policy;
    double cwnd, ssthresh; /* packets */
    double base_rtt;       /* the smallest round trip seen on the path (the join's first); 0: none yet */
    double batch_min;      /* the smallest round trip of the current batch of INA_CC_BATCH */
    uint32_t batch_n;
    uint64_t sent;         /* new packets sent: a packet's send number orders it against a reduction */
    uint64_t recover;      /* a congested result of a packet sent before this number does not shrink again */
    int marked;            /* a CE mark reached this worker: the path marks, the delay signal is off */
    int echo;              /* the next update carries FLAG_CONGESTED */
    uint64_t reductions, marks, delay_signals; /* counters, for CommStats */
} ina_cc;

void ina_cc_init(ina_cc *c, int policy, uint32_t cap); /* a fresh window (per generation) */
uint32_t ina_cc_allowed(const ina_cc *c, uint32_t cap); /* packets that may be in flight now */
/* a result of the packet sent as number seq; rtt: its round trip (first send to result), < 0 when it is not
 * one of the path: resent, or sent before the call's first result (the peers may not have started the call);
 * congested: the result's FLAG_CONGESTED */
void ina_cc_result(ina_cc *c, uint64_t seq, double rtt, int congested, uint32_t cap);
void ina_cc_marked(ina_cc *c);  /* a datagram reached this worker CE-marked */
int ina_cc_echo(ina_cc *c);     /* FLAG_CONGESTED or 0 for the update built now (clears the echo) */
/* the retransmission timeout's floor: min_rto (the caller's), and under a policy a few round trips */
double ina_cc_rto_floor(const ina_cc *c, double srtt, double min_rto);
/* the floor after a spurious retransmission (a result later than the timeout, not lost: a loaded host, a
 * queue the estimate missed): doubled under a policy, up to cap (SwitchML's constant); min_rto under
 * INA_CC_NONE */
double ina_cc_spurious_floor(const ina_cc *c, double min_rto, double cap);

#endif
