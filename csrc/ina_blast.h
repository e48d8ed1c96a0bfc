/* A packet blaster for benchmarks (inabench/bench_bmv2.py): offer a list of UDP datagrams on connected
 * sockets (sendmmsg) at a given rate, or as fast as a window of packets in flight allows, or flat out, and
 * count the datagrams that come back on the same sockets (recvmmsg), for a bounded time. Blocks in ppoll,
 * never spins: on a small machine the switch under test needs the other cores. */
#ifndef INA_BLAST_H
#define INA_BLAST_H
#include <stdint.h>

typedef struct {
    uint64_t sent;        /* datagrams the kernel took */
    uint64_t send_errors; /* datagrams it refused (a full send buffer): offered, never sent */
    uint64_t received;    /* datagrams read back, over all sockets */
    uint64_t bytes_received;
    uint64_t stalls;      /* window full and nothing back for `quiet` s: the packets in flight counted lost */
    double first_send, last_send, last_receive; /* seconds since the call began (last_receive 0: none) */
    double elapsed;       /* seconds the call took */
} ina_blast_result;

/* fds: nfds connected UDP sockets (the caller's); packet i is lens[i] bytes of blob (packets back to back)
 * and goes out on fds[sock[i]]. rate > 0: packet i is due at i / rate s; window > 0: at most `window`
 * packets sent and not answered (sent - received, one datagram back per datagram out); neither: flat out.
 * Sending stops after `seconds` even if packets are left; receiving stops once `expect` datagrams came
 * back (0: no such count), or when nothing came for `quiet` s after the last send, and at the latest
 * `seconds` + 4 * `quiet` s after the call began. Returns 0, or -1 with errno set (bad arguments, a poll
 * failure). */
int ina_blast(const int *fds, uint32_t nfds, const uint8_t *blob, const uint32_t *lens, const uint8_t *sock,
              uint64_t n, double rate, uint32_t window, double seconds, double quiet, uint64_t expect,
              ina_blast_result *out);
#endif
