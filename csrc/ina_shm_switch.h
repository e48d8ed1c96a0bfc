/* The switch's end of the shared-memory transport (ina_shm.h, ina_shm_ring.h): the core behind a loop
 * that drains every worker's up ring and writes what the core emits into the down rings, with the UDP
 * loop's impairments and punt queue (ina_loop.h). */
#ifndef INA_SHM_SWITCH_H
#define INA_SHM_SWITCH_H
#include <stdint.h>

#include "ina_core.h"

#define INA_SHM_ID_BASE 0x100000000000000ull /* address id of port p: INA_SHM_ID_BASE + p (above IPv4:port) */

typedef struct {
    uint64_t packets_in, packets_out, bytes_in, bytes_out, send_errors, bad_records, punts_dropped;
    uint64_t dropped[2], duplicated[2], reordered[2]; /* [0] = received side, [1] = sent side */
    uint64_t wakeups;                                 /* futex wakes the loop sent to sleeping workers */
} ina_shm_counters;

typedef struct ina_shm_switch ina_shm_switch;
/* create /dev/shm/ina-NAME (replacing a stale one) with `ports` ports, all its memory reserved up front;
 * NULL with errno (ENOSPC: /dev/shm is too small, EINVAL: a bad name or port count) */
ina_shm_switch *ina_shm_switch_new(ina_switch *sw, const char *name, uint32_t ports, double loss, double dup,
                                   double reorder, uint64_t seed);
void ina_shm_switch_free(ina_shm_switch *s); /* unmaps and removes the segment */
/* serve a while, as ina_udp_run: the number of control packets waiting, 0 when idle for 10 ms or stopped */
int ina_shm_switch_run(ina_shm_switch *s);
void ina_shm_switch_stop(ina_shm_switch *s);
const uint8_t *ina_shm_switch_punt(const ina_shm_switch *s, int i, uint32_t *len, uint64_t *src);
void ina_shm_switch_punt_clear(ina_shm_switch *s);
void ina_shm_switch_send(ina_shm_switch *s, uint64_t dst, const uint8_t *pkt, uint32_t len);
const ina_shm_counters *ina_shm_switch_counters(const ina_shm_switch *s);
#endif
