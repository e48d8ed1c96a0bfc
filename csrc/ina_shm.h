/* The shared-memory transport between a switch and its workers on one host (`shm://NAME`): the segment
 * /dev/shm/ina-NAME with a pair of rings per worker (ina_shm_ring.h says how and why). This header is what
 * cffi sees of the worker's end: claim a port, send, receive, wait (the switch's end: ina_shm_switch.h). */
#ifndef INA_SHM_H
#define INA_SHM_H
#include <stdint.h>

#define INA_SHM_MAX_PACKET 65536             /* the largest record: a header and 64 KiB of payload */
#define INA_SHM_NAME_MAX 64

/* ---------------------------------------------------------------- the worker's end */
typedef struct ina_shm_client ina_shm_client;
/* map the switch's segment and claim a free port (or a dead process's); NULL with *err: ENOENT (no switch
 * by that name), EPROTO (not a segment of this version), EBUSY (every port taken), EINVAL (a bad name) */
ina_shm_client *ina_shm_connect(const char *name, int *err);
void ina_shm_close(ina_shm_client *c); /* frees the port */
uint32_t ina_shm_client_port(const ina_shm_client *c);
/* one packet up (and the switch woken if it sleeps): 0, or -1 when the ring is full (a lost packet) */
int ina_shm_send(ina_shm_client *c, const uint8_t *pkt, uint32_t len);
/* queue one packet up without waking the switch; ina_shm_flush wakes it once for the batch */
int ina_shm_queue(ina_shm_client *c, const uint8_t *pkt, uint32_t len);
void ina_shm_flush(ina_shm_client *c);
/* the next packet down copied into buf (cap bytes): its length, -1 when none waits, -2 for a corrupt ring
 * (emptied) or a record larger than cap (dropped) */
int ina_shm_recv(ina_shm_client *c, uint8_t *buf, uint32_t cap);
/* the next packet down in place (valid until ina_shm_next): NULL when none waits */
const uint8_t *ina_shm_peek(ina_shm_client *c, uint32_t *len);
void ina_shm_next(ina_shm_client *c);
/* wait up to seconds for a packet down; 1 if one waits */
int ina_shm_wait(ina_shm_client *c, double seconds);
/* 1 when the switch is gone: its process (the segment's switch_pid) no longer exists, or its segment was
 * removed or replaced (a switch that stopped, or a new one under the name); checked at most every 100 ms
 * (between checks the last answer), and once gone, gone */
int ina_shm_switch_gone(ina_shm_client *c);

#endif
