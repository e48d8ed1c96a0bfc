/* The worker's end of the shared-memory transport (ina_shm.h): claim a port of the switch's segment, and
 * the ring operations the worker loops use (ina_worker.c in C, hostlib/shm.py from Python). */
#define _GNU_SOURCE
#include "ina_shm.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>

#include "ina_shm_ring.h"

struct ina_shm_client {
    ina_shm_seg *seg;
    size_t size;
    uint32_t port;
    uint32_t pid;
    uint64_t next; /* ina_shm_peek's record end, for ina_shm_next */
    char path[INA_SHM_NAME_MAX + 8];
    dev_t dev; /* the segment's file, to tell it from a later one of the same name */
    ino_t ino;
    double next_check; /* ina_shm_switch_gone: when to look again */
    int gone;
    pthread_mutex_t up; /* the up ring has one producer: the worker loop and the heartbeat thread take turns */
};

#define GONE_EVERY 0.1 /* seconds between ina_shm_switch_gone's checks */

/* a port whose owner is gone (a worker killed without closing) may be taken over */
static int claim(ina_shm_port *p, uint32_t me)
{
    uint32_t cur = 0;
    if (atomic_compare_exchange_strong(&p->owner, &cur, me))
        return 1;
    if (cur != me && kill((pid_t)cur, 0) < 0 && errno == ESRCH)
        return atomic_compare_exchange_strong(&p->owner, &cur, me);
    return 0;
}

static ina_shm_seg *map_segment(const char *name, char *path, size_t *size, struct stat *st_out, int *err)
{
    if (ina_shm_path(name, path, INA_SHM_NAME_MAX + 8)) {
        *err = EINVAL;
        return NULL;
    }
    int fd = shm_open(path, O_RDWR, 0);
    if (fd < 0) {
        *err = errno;
        return NULL;
    }
    struct stat st;
    ina_shm_seg *seg = NULL;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(ina_shm_seg)) {
        seg = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (seg == MAP_FAILED)
            seg = NULL;
    }
    *err = seg ? 0 : EPROTO;
    if (seg && (seg->magic != INA_SHM_MAGIC || seg->ring_bytes != INA_SHM_RING_BYTES ||
                ina_shm_seg_size(seg->ports) > (size_t)st.st_size)) {
        munmap(seg, (size_t)st.st_size);
        seg = NULL;
    }
    close(fd);
    *size = (size_t)st.st_size;
    *st_out = st;
    return seg;
}

ina_shm_client *ina_shm_connect(const char *name, int *err)
{
    size_t size;
    char path[INA_SHM_NAME_MAX + 8];
    struct stat st;
    ina_shm_seg *seg = map_segment(name, path, &size, &st, err);
    if (!seg)
        return NULL;
    ina_shm_client *c = calloc(1, sizeof *c);
    if (!c) {
        munmap(seg, size);
        *err = ENOMEM;
        return NULL;
    }
    c->seg = seg, c->size = size, c->pid = (uint32_t)getpid();
    pthread_mutex_init(&c->up, NULL);
    memcpy(c->path, path, sizeof path);
    c->dev = st.st_dev, c->ino = st.st_ino;
    for (uint32_t p = 0; p < seg->ports; p++)
        if (claim(&seg->port[p], c->pid)) {
            ina_ring *down = &seg->port[p].down; /* what the switch sent a previous owner is not ours */
            atomic_store(&down->tail, atomic_load(&down->head));
            c->port = p;
            return c;
        }
    munmap(seg, size);
    free(c);
    *err = EBUSY;
    return NULL;
}

void ina_shm_close(ina_shm_client *c)
{
    if (!c)
        return;
    uint32_t me = c->pid;
    atomic_compare_exchange_strong(&c->seg->port[c->port].owner, &me, 0);
    munmap(c->seg, c->size);
    pthread_mutex_destroy(&c->up);
    free(c);
}

uint32_t ina_shm_client_port(const ina_shm_client *c) { return c->port; }

int ina_shm_queue(ina_shm_client *c, const uint8_t *pkt, uint32_t len)
{
    if (len > INA_SHM_MAX_PACKET)
        return -1;
    pthread_mutex_lock(&c->up);
    int rc = ina_ring_push(&c->seg->port[c->port].up, pkt, len, NULL, 0);
    pthread_mutex_unlock(&c->up);
    return rc;
}

void ina_shm_flush(ina_shm_client *c) { ina_bell_ring(&c->seg->bell, &c->seg->sleeping); }

int ina_shm_send(ina_shm_client *c, const uint8_t *pkt, uint32_t len)
{
    int rc = ina_shm_queue(c, pkt, len);
    ina_shm_flush(c);
    return rc;
}

const uint8_t *ina_shm_peek(ina_shm_client *c, uint32_t *len)
{
    int bad = 0;
    return ina_ring_peek(&c->seg->port[c->port].down, INA_SHM_MAX_PACKET, len, &c->next, &bad);
}

void ina_shm_next(ina_shm_client *c) { ina_ring_pop(&c->seg->port[c->port].down, c->next); }

int ina_shm_recv(ina_shm_client *c, uint8_t *buf, uint32_t cap)
{
    int bad = 0;
    uint32_t len;
    const uint8_t *d = ina_ring_peek(&c->seg->port[c->port].down, INA_SHM_MAX_PACKET, &len, &c->next, &bad);
    if (!d)
        return bad ? -2 : -1;
    int rc = len <= cap ? (int)len : -2;
    if (rc >= 0)
        memcpy(buf, d, len);
    ina_shm_next(c);
    return rc;
}

static int down_ready(void *ctx)
{
    ina_shm_client *c = ctx;
    return !ina_ring_empty(&c->seg->port[c->port].down);
}

int ina_shm_wait(ina_shm_client *c, double seconds)
{
    ina_ring *down = &c->seg->port[c->port].down;
    ina_bell_wait(&down->bell, &down->sleeping, down_ready, c, seconds);
    return down_ready(c);
}

static double mono(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

int ina_shm_switch_gone(ina_shm_client *c)
{
    if (c->gone)
        return 1;
    double t = mono();
    if (t < c->next_check)
        return 0;
    c->next_check = t + GONE_EVERY;
    pid_t pid = (pid_t)c->seg->switch_pid; /* a switch in another pid namespace would look dead: none is */
    if (pid > 0 && kill(pid, 0) < 0 && errno == ESRCH) {
        c->gone = 1;
        return 1;
    }
    int fd = shm_open(c->path, O_RDONLY, 0); /* a switch that stopped removed its name (ina_shm_switch_free) */
    if (fd < 0) {
        c->gone = errno == ENOENT;
        return c->gone;
    }
    struct stat st;
    if (fstat(fd, &st) == 0 && (st.st_dev != c->dev || st.st_ino != c->ino))
        c->gone = 1; /* the name is another switch's segment now */
    close(fd);
    return c->gone;
}
