/* The aggregator core: switchsim/model.py in C, packet for packet and counter for counter.
 * Transport-free like the model: ina_switch_process() takes one packet and a source address (an opaque
 * 64-bit id the transport chooses) and fills the packets to emit. */
#ifndef INA_CORE_H
#define INA_CORE_H
#include <stddef.h>
#include <stdint.h>

#include "ina_wire.h"

#define INA_MAX_OUT INA_MAX_WORKERS /* a multicast */
#define INA_PUNT (-1) /* a packet for the control plane (join, leave, abort, heartbeat, stats request) */

/* One packet to send: a header of its own plus a payload. `stable` payloads (results) live in slot memory
 * and stay valid until that (slot, set) completes again (after every worker got this result) or its job is
 * removed, so a transport may send them without copying; others (errors) are valid until the next call into
 * the core. */
typedef struct {
    uint64_t dst;
    uint8_t hdr[INA_HEADER_SIZE];
    const uint8_t *payload;
    uint32_t len;
    uint32_t stable;
} ina_out;

typedef struct {
    uint64_t packets_in, packets_out, overflows;
    uint64_t drops[INA_DROP_COUNT];
} ina_counters;

typedef struct ina_switch ina_switch;

ina_switch *ina_switch_new(uint32_t slots, uint32_t max_elements, int nc_deterministic, uint64_t seed);
void ina_switch_free(ina_switch *sw);
/* a job the switch now serves, with `slots` slots of its own (0: the switch's, ina_switch_new's), clean and
 * without a generation (admit follows). 0 on success, -1 for a bad id / world size / slot count, a job served
 * twice or no memory */
int ina_switch_add_job(ina_switch *sw, uint32_t job_id, uint32_t world_size, uint32_t slots);
/* the job ended (a shared switch): its slots, counters and state are freed, and its later packets are dropped
 * as unknown_job; the other jobs keep their order. Nothing may hold a pointer into the job across this call
 * (a result payload, ina_out.stable: the loops send or copy theirs before their run returns). 0, or -1 for
 * an unknown job */
int ina_switch_remove_job(ina_switch *sw, uint32_t job_id);
/* The control plane admits a generation (switchsim/control.py): the ranks' source addresses (world_size of
 * them), the session value and every slot's first packet id; the job's slots start clean. group: where a
 * completed round's result goes once for every member (rank INA_NO_RANK, INA_FLAG_GROUP), 0 for a copy to
 * each member. 0, or -1 for an unknown job. */
int ina_switch_admit(ina_switch *sw, uint32_t job_id, uint64_t generation, uint32_t session, uint32_t first_id,
                     const uint64_t *addrs, uint32_t elements, uint64_t group);
/* whether pkt's (job, rank) is a member of the job's admitted generation (failed or not) sending from its
 * address: the control plane takes members' requests first (control.py ControlPlane.known) */
int ina_switch_is_member(const ina_switch *sw, const uint8_t *pkt, size_t len, uint64_t src);
/* per rank of the job: packets admitted (right address and session), for the control plane's liveness */
int ina_switch_member_packets(const ina_switch *sw, uint32_t job_id, uint64_t *out);
void ina_switch_count_drop(ina_switch *sw, int reason); /* a drop decided outside the core */
/* the switch's boot id, which everything the core sends carries (the control plane draws it) */
void ina_switch_set_boot(ina_switch *sw, uint32_t boot);
/* model: Switch.fail. The job's generation failed (an abort, a dead member; the core itself fails it on a call
 * mismatch): the first failure's error (code, the rank it names, text of text_len bytes, cut to
 * INA_MAX_ERROR_TEXT) stands until the next admit, and every member gets it now, in out (transient payloads);
 * every later data packet of the generation gets it too, but for a completed round's resend. Returns the
 * packets written (the job's world size, 0 for a job without a generation), -1 for an unknown job. */
int ina_switch_fail(ina_switch *sw, uint32_t job_id, uint8_t code, uint8_t rank, const char *text, size_t text_len,
                    ina_out *out);
/* whether the job's generation failed: 1 or 0, -1 for an unknown job */
int ina_switch_failed(const ina_switch *sw, uint32_t job_id);
/* number of packets written to out (<= INA_MAX_OUT), or INA_PUNT */
int ina_switch_process(ina_switch *sw, const uint8_t *pkt, size_t len, uint64_t src, ina_out *out);
void ina_switch_count_out(ina_switch *sw, uint64_t n); /* replies the control plane sent itself */
/* a datagram a loop dropped before the core saw it (a fragment, a corrupt ring record): counted in
 * packets_in and in drops[reason], so packets_in stays the sum of the outcomes */
void ina_switch_count_dropped_in(ina_switch *sw, int reason);

const ina_counters *ina_switch_counters(const ina_switch *sw);
uint32_t ina_switch_jobs(const ina_switch *sw);
/* job i (in the order added): id, world size, generation, its slot count, and its
 * [INA_SLOT_COUNTERS][its slots] counters */
void ina_switch_job_info(const ina_switch *sw, uint32_t i, uint32_t *job_id, uint32_t *world_size,
                         uint64_t *generation, uint32_t *slots);
const uint64_t *ina_switch_job_slot_counters(const ina_switch *sw, uint32_t i);
uint32_t ina_switch_slots(const ina_switch *sw); /* the default of a job's slots (ina_switch_new's) */
/* the lane arithmetic this switch runs: "scalar", "avx2" or "avx512" (INA_SWITCH_SIMD at creation asks) */
const char *ina_switch_lanes(const ina_switch *sw);
/* process n packets stored back to back (benchmarks: no interpreter per packet); returns packets emitted */
uint64_t ina_switch_replay(ina_switch *sw, const uint8_t *pkts, const uint32_t *lens, const uint64_t *srcs, size_t n);

#endif
