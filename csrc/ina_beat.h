/* The worker's heartbeat, sent by a native thread that never needs the interpreter: a rank that holds the
 * GIL for minutes (a long C call, an extension that does not release it) is still alive to its switch, and
 * only a stopped, killed or vanished process falls silent (docs/protocol.md, liveness). hostlib/worker.py
 * starts one per Communicator and hands it each generation's heartbeat datagram. */
#ifndef INA_BEAT_H
#define INA_BEAT_H
#include <stdint.h>

#define INA_BEAT_MAX 64 /* a heartbeat is a header (INA_HEADER_SIZE) */

typedef struct ina_beat ina_beat;
struct ina_shm_client;
/* a thread that sends the set datagram every every_ms on fd (a connected UDP socket) or, when shm is not
 * NULL, on the shared-memory port; NULL when no thread could be started (errno) */
ina_beat *ina_beat_start(int fd, struct ina_shm_client *shm, uint32_t every_ms);
/* the datagram to send from now on (len 0: none, e.g. between a failed generation and its re-join); the
 * first one goes out at once */
void ina_beat_set(ina_beat *b, const uint8_t *pkt, uint32_t len);
uint64_t ina_beat_sent(ina_beat *b); /* heartbeats sent so far */
void ina_beat_stop(ina_beat *b);     /* joins the thread and frees it; after this nothing is sent */

#endif
