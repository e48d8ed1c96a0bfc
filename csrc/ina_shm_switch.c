/* The switch's end of the shared-memory transport (ina_shm_switch.h): the segment, and a loop that drains
 * every claimed port's up ring into the core (ina_loop.h: impairments, capture-free) and writes what the
 * core emits into the down rings. Each packet is copied out of the ring before the core reads it: a worker
 * can write its ring at any time, and the switch trusts nothing it did not admit. */
#define _GNU_SOURCE
#include "ina_shm_switch.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "ina_loop.h"
#include "ina_shm.h"
#include "ina_shm_ring.h"

#define IDLE_S 0.010    /* asleep this long without a packet: return to the caller */
#define RUN_PASSES 4096 /* then return, so the caller sees signals and its stop flag */
#define PORT_BATCH 64   /* records taken from one port before the next port's turn */

struct ina_shm_switch {
    ina_loop loop;
    ina_shm_seg *seg;
    size_t size;
    char path[80];
    volatile int stop;
    ina_shm_counters c;
    uint8_t *wake; /* per port: a record went down since the last wake-up pass */
    uint8_t pkt[INA_SHM_MAX_PACKET];
};

static void send_sink(void *ctx, uint64_t dst, const uint8_t *hdr, uint32_t hlen, const uint8_t *payload,
                      uint32_t len, int transient);

static ina_shm_seg *create_segment(const char *path, uint32_t ports, size_t *size)
{
    int old = shm_open(path, O_RDONLY, 0);
    if (old >= 0) { /* a segment of that name: refuse a live switch's, replace a dead one's */
        ina_shm_seg head;
        ssize_t n = pread(old, &head, sizeof head, 0);
        close(old);
        if (n == (ssize_t)sizeof head && head.magic == INA_SHM_MAGIC &&
            (kill((pid_t)head.switch_pid, 0) == 0 || errno == EPERM)) {
            errno = EADDRINUSE;
            return NULL;
        }
        shm_unlink(path); /* its workers time out */
    }
    int fd = shm_open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return NULL;
    *size = ina_shm_seg_size(ports);
    int rc = posix_fallocate(fd, 0, (off_t)*size); /* ENOSPC now rather than SIGBUS on first touch */
    ina_shm_seg *seg = rc ? MAP_FAILED : mmap(NULL, *size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (seg == MAP_FAILED) {
        errno = rc ? rc : errno;
        shm_unlink(path);
        return NULL;
    }
    seg->ports = ports, seg->ring_bytes = INA_SHM_RING_BYTES, seg->max_packet = INA_SHM_MAX_PACKET;
    seg->switch_pid = (uint32_t)getpid();
    atomic_thread_fence(memory_order_release);
    seg->magic = INA_SHM_MAGIC; /* last: a worker that maps it early sees no segment yet */
    return seg;
}

ina_shm_switch *ina_shm_switch_new(ina_switch *sw, const char *name, uint32_t ports, double loss, double dup,
                                   double reorder, uint64_t seed)
{
    if (loss < 0 || loss >= 1 || dup < 0 || dup >= 1 || reorder < 0 || reorder >= 1 || ports < 1 || ports > 1024) {
        errno = EINVAL;
        return NULL;
    }
    ina_shm_switch *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    if (ina_shm_path(name, s->path, sizeof s->path)) {
        free(s);
        errno = EINVAL;
        return NULL;
    }
    s->wake = calloc(ports, 1);
    int bad = !s->wake || ina_loop_init(&s->loop, sw, loss, dup, reorder, seed, INA_SHM_MAX_PACKET, send_sink, s);
    if (!bad)
        s->seg = create_segment(s->path, ports, &s->size);
    if (bad || !s->seg) {
        int e = bad ? ENOMEM : errno;
        s->seg = NULL;
        ina_shm_switch_free(s);
        errno = e;
        return NULL;
    }
    return s;
}

void ina_shm_switch_free(ina_shm_switch *s)
{
    if (!s)
        return;
    if (s->seg) {
        munmap(s->seg, s->size);
        shm_unlink(s->path);
    }
    ina_loop_free(&s->loop);
    free(s->wake);
    free(s);
}

void ina_shm_switch_stop(ina_shm_switch *s) { s->stop = 1; }
void ina_shm_switch_punt_clear(ina_shm_switch *s) { s->loop.punt.n = 0; }

const uint8_t *ina_shm_switch_punt(const ina_shm_switch *s, int i, uint32_t *len, uint64_t *src)
{
    return ina_loop_punt(&s->loop, i, len, src);
}

const ina_shm_counters *ina_shm_switch_counters(const ina_shm_switch *s)
{
    ina_shm_counters *c = (ina_shm_counters *)&s->c;
    ina_loop_counters(&s->loop, c->dropped, c->duplicated, c->reordered, &c->punts_dropped);
    return c;
}

/* ------------------------------------------------------------------ sending */
static void send_sink(void *ctx, uint64_t dst, const uint8_t *hdr, uint32_t hlen, const uint8_t *payload,
                      uint32_t len, int transient)
{
    ina_shm_switch *s = ctx;
    (void)transient; /* the ring takes a copy at once */
    uint64_t p = dst - INA_SHM_ID_BASE;
    if (dst < INA_SHM_ID_BASE || p >= s->seg->ports ||
        ina_ring_push(&s->seg->port[p].down, hdr, hlen, payload, len)) {
        s->c.send_errors++; /* not a port, or its ring is full: lost, as a datagram to a full socket */
        return;
    }
    s->c.packets_out++;
    s->c.bytes_out += hlen + len;
    s->wake[p] = 1;
}

/* wake every worker that got something and sleeps */
static void wake_ports(ina_shm_switch *s)
{
    for (uint32_t p = 0; p < s->seg->ports; p++)
        if (s->wake[p]) {
            s->wake[p] = 0;
            ina_ring *r = &s->seg->port[p].down;
            uint32_t before = atomic_load_explicit(&r->bell, memory_order_relaxed);
            ina_bell_ring(&r->bell, &r->sleeping);
            s->c.wakeups += atomic_load_explicit(&r->bell, memory_order_relaxed) != before;
        }
}

void ina_shm_switch_send(ina_shm_switch *s, uint64_t dst, const uint8_t *pkt, uint32_t len)
{
    if (len < INA_HEADER_SIZE)
        return;
    ina_loop_send(&s->loop, dst, pkt, INA_HEADER_SIZE, pkt + INA_HEADER_SIZE, len - INA_HEADER_SIZE, 1);
    wake_ports(s);
}

/* ------------------------------------------------------------------ receiving */
/* up to PORT_BATCH records of port p into the core; the number taken */
static int drain_port(ina_shm_switch *s, uint32_t p)
{
    ina_ring *up = &s->seg->port[p].up;
    int n = 0;
    for (; n < PORT_BATCH; n++) {
        uint32_t len;
        uint64_t next;
        int bad = 0;
        const uint8_t *d = ina_ring_peek(up, INA_SHM_MAX_PACKET, &len, &next, &bad);
        if (!d) {
            s->c.bad_records += (uint64_t)bad;
            if (bad) /* a record that cannot be, and the ring it emptied: one malformed packet to the switch */
                ina_switch_count_dropped_in(s->loop.sw, INA_DROP_MALFORMED);
            break;
        }
        memcpy(s->pkt, d, len); /* the worker may rewrite its ring: the core reads our copy */
        ina_ring_pop(up, next);
        s->c.packets_in++;
        s->c.bytes_in += len;
        ina_loop_receive(&s->loop, INA_SHM_ID_BASE + p, s->pkt, len);
    }
    return n;
}

static int any_up(void *ctx)
{
    ina_shm_switch *s = ctx;
    for (uint32_t p = 0; p < s->seg->ports; p++)
        if (!ina_ring_empty(&s->seg->port[p].up))
            return 1;
    return 0;
}

int ina_shm_switch_run(ina_shm_switch *s)
{
    for (int pass = 0; !s->stop && pass < RUN_PASSES; pass++) {
        int got = 0;
        for (uint32_t p = 0; p < s->seg->ports; p++)
            got += drain_port(s, p);
        wake_ports(s);
        if (s->loop.punt.n)
            return s->loop.punt.n;
        if (got)
            continue;
        ina_bell_wait(&s->seg->bell, &s->seg->sleeping, any_up, s, IDLE_S);
        if (!any_up(s)) { /* idle: let any packet held back for reordering go, and return to the caller */
            ina_loop_release_held(&s->loop);
            wake_ports(s);
            return 0;
        }
    }
    if (s->stop) {
        ina_loop_release_held(&s->loop);
        wake_ports(s);
    }
    return 0;
}
