/* ina_cc.h says what the window does and why. */
#include "ina_cc.h"

#include "ina_wire.h"

#define INA_CC_BETA 0.7          /* the share of the window kept on a congested round (CUBIC's beta) */
/* packets added per round trip after slow start: half a standard TCP flow's with this beta (RFC 8312 section
 * 4.2, CUBIC's TCP-friendly region: 3 (1 - beta) / (1 + beta)). INA's round trip is short (worker, switch,
 * worker) beside a TCP flow's between two workers (twice the links), and growing per round trip it grows
 * faster in time: with TCP's increase INA took 72 % of a link beside CUBIC, with half of it 56-61 % (4 hosts,
 * 100 Mbit/s, 1 ms, ECN links; hostlib/cc.py) */
#define INA_CC_INCREASE (1.5 * (1 - INA_CC_BETA) / (1 + INA_CC_BETA))
/* seconds of queueing the delay signal allows, at least ... (above the queue where ECN links mark: 2.4 ms at
 * 100 Mbit/s, switchsim/netns.py; there the marks are the signal, shared with the TCP flows beside) */
#define INA_CC_TARGET_MIN 0.005
#define INA_CC_TARGET_BASES 1.0  /* ... and this many base round trips */
/* the retransmission timeout's floor: the caller's min_rto (hostlib/cc.py's RTO_FLOOR by default: a scheduler's
 * hiccup on a loaded host is not a loss) and INA_CC_RTO_RTTS smoothed round trips; the delay signal takes the
 * smallest of INA_CC_BATCH round trips: one result that waited for a slow peer is not a queue (CoDel's minimum
 * over an interval) */
#define INA_CC_RTO_RTTS 4.0
#define INA_CC_BATCH 8

void ina_cc_init(ina_cc *c, int policy, uint32_t cap)
{
    *c = (ina_cc){.policy = policy, .ssthresh = cap};
    c->cwnd = policy == INA_CC_NONE ? cap : (cap < INA_CC_INITIAL ? cap : INA_CC_INITIAL);
}

uint32_t ina_cc_allowed(const ina_cc *c, uint32_t cap)
{
    if (c->policy == INA_CC_NONE)
        return cap;
    uint32_t n = (uint32_t)c->cwnd;
    n = n < INA_CC_MIN ? INA_CC_MIN : n;
    return n < cap ? n : cap;
}

static double target(const ina_cc *c)
{
    double t = INA_CC_TARGET_BASES * c->base_rtt;
    return t > INA_CC_TARGET_MIN ? t : INA_CC_TARGET_MIN;
}

/* the delay signal: a batch whose every round trip is above the base by more than the target says the queue
 * stays up; the next update says so, and the aggregate tells every worker */
static void delay_sample(ina_cc *c, double rtt)
{
    if (c->base_rtt == 0 || rtt < c->base_rtt)
        c->base_rtt = rtt;
    c->batch_min = c->batch_n++ && c->batch_min < rtt ? c->batch_min : rtt;
    if (c->batch_n < INA_CC_BATCH)
        return;
    c->batch_n = 0;
    if (c->policy == INA_CC_AIMD && !c->marked && c->batch_min > c->base_rtt + target(c)) {
        c->echo = 1;
        c->delay_signals++;
    }
}

void ina_cc_result(ina_cc *c, uint64_t seq, double rtt, int congested, uint32_t cap)
{
    if (c->policy == INA_CC_NONE)
        return;
    if (rtt >= 0)
        delay_sample(c, rtt);
    if (congested) {
        if (seq >= c->recover) { /* once per round trip: packets sent before the last cut saw the old queue */
            c->cwnd = c->cwnd * INA_CC_BETA > INA_CC_MIN ? c->cwnd * INA_CC_BETA : INA_CC_MIN;
            c->ssthresh = c->cwnd;
            c->recover = c->sent;
            c->reductions++;
        }
        return;
    }
    c->cwnd += c->cwnd < c->ssthresh ? 1.0 : INA_CC_INCREASE / c->cwnd;
    if (c->cwnd > cap)
        c->cwnd = cap;
}

void ina_cc_marked(ina_cc *c)
{
    c->marks++;
    if (c->policy == INA_CC_NONE)
        return;
    c->marked = 1;
    c->echo = 1;
}

int ina_cc_echo(ina_cc *c)
{
    int e = c->echo;
    c->echo = 0;
    return e ? INA_FLAG_CONGESTED : 0;
}

double ina_cc_rto_floor(const ina_cc *c, double srtt, double min_rto)
{
    if (c->policy == INA_CC_NONE)
        return min_rto;
    double f = INA_CC_RTO_RTTS * srtt;
    return f > min_rto ? f : min_rto;
}

double ina_cc_spurious_floor(const ina_cc *c, double min_rto, double cap)
{
    if (c->policy == INA_CC_NONE || min_rto >= cap)
        return min_rto;
    return 2 * min_rto < cap ? 2 * min_rto : cap;
}
