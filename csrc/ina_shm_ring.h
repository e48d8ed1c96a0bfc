/* The shared-memory transport's segment (issue 16): what a switch on this host and its workers map, and
 * the single-producer single-consumer byte rings inside it. Internal to ina_shm.c and the two loops that
 * use it (csrc/ina_shm_switch.c, csrc/ina_worker.c); cffi sees only ina_shm.h.
 *
 * Why: on loopback every datagram costs a system call's share, two copies through an skb and a wake-up;
 * here a packet is one copy into a ring the other side reads, and a futex wake only when the reader sleeps.
 * The records are the protocol's datagrams, unchanged: the same core, impairments and conformance.
 *
 * Layout: a header, then `ports` ports; a worker claims a free port (owner 0 -> its pid, or a dead pid's)
 * and its address id is INA_SHM_ID_BASE + port. Each port has an up ring (worker -> switch) and a down ring
 * (switch -> worker). A record is a 4-byte length and the packet, padded to 8 bytes; a length of
 * INA_SHM_WRAP says "go on at the ring's start". head and tail count bytes and only grow. */
#ifndef INA_SHM_RING_H
#define INA_SHM_RING_H
#include <limits.h>
#include <stdio.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ina_wait.h"

#define INA_SHM_MAGIC 0x31304d5348414e49ull /* "INASHM01" */
#define INA_SHM_RING_BYTES (2u << 20)        /* per ring: twice the worker's default window (IN_FLIGHT_BYTES) */
#define INA_SHM_WRAP 0xFFFFFFFFu
#define INA_SHM_SPIN 200 /* polls of an empty ring before sleeping on its futex */
#if defined(__x86_64__) || defined(__i386__)
#define INA_CPU_RELAX() __builtin_ia32_pause()
#else
#define INA_CPU_RELAX() __asm__ volatile("" ::: "memory")
#endif

typedef struct {
    _Alignas(64) _Atomic uint64_t head; /* written by the producer only */
    _Alignas(64) _Atomic uint64_t tail; /* written by the consumer only */
    _Alignas(64) _Atomic uint32_t bell; /* futex word: bumped by a producer that finds the consumer asleep */
    _Atomic uint32_t sleeping;
    _Alignas(64) uint8_t data[INA_SHM_RING_BYTES];
} ina_ring;

typedef struct {
    _Alignas(64) _Atomic uint32_t owner; /* pid of the worker on this port; 0: free */
    ina_ring up, down;
} ina_shm_port;

typedef struct {
    uint64_t magic;
    uint32_t ports, ring_bytes, max_packet, switch_pid;
    /* the switch's doorbell, for every up ring at once */
    _Alignas(64) _Atomic uint32_t bell;
    _Atomic uint32_t sleeping;
    _Alignas(64) ina_shm_port port[];
} ina_shm_seg;

/* "ina-NAME" for shm_open; -1 unless NAME is 1..64 of [A-Za-z0-9_.-] */
static inline int ina_shm_path(const char *name, char *out, size_t cap)
{
    size_t n = strlen(name);
    if (n < 1 || n > 64)
        return -1;
    for (size_t i = 0; i < n; i++) {
        char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
              ch == '.' || ch == '-'))
            return -1;
    }
    snprintf(out, cap, "/ina-%s", name);
    return 0;
}

static inline size_t ina_shm_seg_size(uint32_t ports) { return sizeof(ina_shm_seg) + ports * sizeof(ina_shm_port); }
static inline uint32_t ina_shm_pad(uint32_t len) { return (len + 4 + 7) & ~7u; }

/* append a record of header + payload; 0, or -1 when the ring has no room (the packet is lost, as in a full
 * socket buffer, and the protocol's retransmission recovers it) */
static inline int ina_ring_push(ina_ring *r, const uint8_t *hdr, uint32_t hlen, const uint8_t *payload, uint32_t plen)
{
    uint64_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&r->tail, memory_order_acquire);
    uint32_t len = hlen + plen, need = ina_shm_pad(len), pos = (uint32_t)(head % INA_SHM_RING_BYTES);
    uint32_t skip = pos + need > INA_SHM_RING_BYTES ? INA_SHM_RING_BYTES - pos : 0;
    if (head + skip + need - tail > INA_SHM_RING_BYTES)
        return -1;
    if (skip) {
        uint32_t wrap = INA_SHM_WRAP;
        memcpy(r->data + pos, &wrap, 4);
        pos = 0;
    }
    memcpy(r->data + pos, &len, 4);
    memcpy(r->data + pos + 4, hdr, hlen);
    if (plen)
        memcpy(r->data + pos + 4 + hlen, payload, plen);
    atomic_store_explicit(&r->head, head + skip + need, memory_order_release);
    return 0;
}

/* the next record: its bytes (in the ring, valid until ina_ring_pop) and length; NULL when empty. A record
 * that cannot be (a length past max or past head: a writer that scribbled) empties the ring and sets *bad. */
static inline const uint8_t *ina_ring_peek(ina_ring *r, uint32_t max, uint32_t *len, uint64_t *next, int *bad)
{
    uint64_t tail = atomic_load_explicit(&r->tail, memory_order_relaxed);
    for (;;) {
        uint64_t head = atomic_load_explicit(&r->head, memory_order_acquire);
        if (tail == head)
            return NULL;
        uint32_t pos = (uint32_t)(tail % INA_SHM_RING_BYTES), n;
        memcpy(&n, r->data + pos, 4);
        if (n == INA_SHM_WRAP && head - tail >= INA_SHM_RING_BYTES - pos) {
            tail += INA_SHM_RING_BYTES - pos;
            atomic_store_explicit(&r->tail, tail, memory_order_release);
            continue;
        }
        if (n > max || head - tail < ina_shm_pad(n) || pos + ina_shm_pad(n) > INA_SHM_RING_BYTES) {
            atomic_store_explicit(&r->tail, head, memory_order_release);
            *bad = 1;
            return NULL;
        }
        *len = n;
        *next = tail + ina_shm_pad(n);
        return r->data + pos + 4;
    }
}

static inline void ina_ring_pop(ina_ring *r, uint64_t next) { atomic_store_explicit(&r->tail, next, memory_order_release); }

static inline int ina_ring_empty(ina_ring *r)
{
    return atomic_load_explicit(&r->tail, memory_order_relaxed) == atomic_load_explicit(&r->head, memory_order_acquire);
}

static inline long ina_futex(_Atomic uint32_t *word, int op, uint32_t val, const struct timespec *ts)
{
    return syscall(SYS_futex, (uint32_t *)word, op, val, ts, NULL, 0);
}

/* after pushing: wake the consumer if it sleeps (the fence pairs with ina_bell_wait's: one of the two sees
 * the other's write, so a record is never left behind a sleeping reader) */
static inline void ina_bell_ring(_Atomic uint32_t *bell, _Atomic uint32_t *sleeping)
{
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(sleeping, memory_order_relaxed)) {
        atomic_fetch_add_explicit(bell, 1, memory_order_relaxed);
        ina_futex(bell, FUTEX_WAKE, INT_MAX, NULL);
    }
}

/* wait until ready(ctx) or seconds pass: a short spin (the producer is usually mid-batch), a few yields (the
 * producer may be waiting for this core: ina_wait.h), then the futex */
static inline void ina_bell_wait(_Atomic uint32_t *bell, _Atomic uint32_t *sleeping, int (*ready)(void *), void *ctx,
                                 double seconds)
{
    for (int i = 0; i < INA_SHM_SPIN; i++) {
        if (ready(ctx))
            return;
        INA_CPU_RELAX();
    }
    for (int yields = 0; ina_wait_yield(&yields);)
        if (ready(ctx))
            return;
    uint32_t b = atomic_load_explicit(bell, memory_order_relaxed);
    atomic_store_explicit(sleeping, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    if (!ready(ctx) && seconds > 0) {
        struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
        ina_futex(bell, FUTEX_WAIT, b, &ts);
    }
    atomic_store_explicit(sleeping, 0, memory_order_relaxed);
}
#endif
