/* ina_beat.h: the heartbeat thread. */
#define _GNU_SOURCE
#include "ina_beat.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "ina_shm.h"

struct ina_beat {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int fd, stop, fresh;
    struct ina_shm_client *shm;
    uint32_t every_ms, len;
    uint8_t pkt[INA_BEAT_MAX];
    uint64_t sent;
};

static void deadline_after(struct timespec *t, uint32_t ms)
{
    clock_gettime(CLOCK_MONOTONIC, t);
    t->tv_sec += ms / 1000;
    t->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (t->tv_nsec >= 1000000000L)
        t->tv_sec++, t->tv_nsec -= 1000000000L;
}

static void *beat(void *arg)
{
    ina_beat *b = arg;
    pthread_mutex_lock(&b->lock);
    while (!b->stop) {
        if (b->len) {
            if (b->shm)
                ina_shm_send(b->shm, b->pkt, b->len); /* a full ring loses it, like a full socket buffer */
            else
                send(b->fd, b->pkt, b->len, MSG_DONTWAIT); /* errors (refused, full) are the loops' to see */
            b->sent++;
        }
        b->fresh = 0;
        struct timespec t;
        deadline_after(&t, b->every_ms);
        while (!b->stop && !b->fresh && pthread_cond_timedwait(&b->wake, &b->lock, &t) != ETIMEDOUT)
            ;
    }
    pthread_mutex_unlock(&b->lock);
    return NULL;
}

ina_beat *ina_beat_start(int fd, struct ina_shm_client *shm, uint32_t every_ms)
{
    ina_beat *b = calloc(1, sizeof *b);
    if (!b)
        return NULL;
    b->fd = fd;
    b->shm = shm;
    b->every_ms = every_ms ? every_ms : 1;
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&b->wake, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&b->lock, NULL);
    int rc = pthread_create(&b->thread, NULL, beat, b);
    if (rc) {
        pthread_cond_destroy(&b->wake);
        pthread_mutex_destroy(&b->lock);
        free(b);
        errno = rc;
        return NULL;
    }
    return b;
}

void ina_beat_set(ina_beat *b, const uint8_t *pkt, uint32_t len)
{
    pthread_mutex_lock(&b->lock);
    b->len = len <= INA_BEAT_MAX ? len : 0;
    if (b->len)
        memcpy(b->pkt, pkt, b->len);
    b->fresh = 1;
    pthread_cond_signal(&b->wake);
    pthread_mutex_unlock(&b->lock);
}

uint64_t ina_beat_sent(ina_beat *b)
{
    pthread_mutex_lock(&b->lock);
    uint64_t n = b->sent;
    pthread_mutex_unlock(&b->lock);
    return n;
}

void ina_beat_stop(ina_beat *b)
{
    if (!b)
        return;
    pthread_mutex_lock(&b->lock);
    b->stop = 1;
    pthread_cond_signal(&b->wake);
    pthread_mutex_unlock(&b->lock);
    pthread_join(b->thread, NULL);
    pthread_cond_destroy(&b->wake);
    pthread_mutex_destroy(&b->lock);
    free(b);
}
