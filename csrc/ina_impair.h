/* Network faults for one direction, as switchsim.server.Impairment: drop with probability loss, deliver
 * twice with probability dup, hold a packet back behind the next one with probability reorder. A packet is
 * two parts (header, payload) so a sender can keep them apart; a held packet is copied. Header-only. */
#ifndef INA_IMPAIR_H
#define INA_IMPAIR_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ina_rng.h"

/* the impairment's decision for one packet (flags) */
#define INA_DECIDE_DROP 1
#define INA_DECIDE_DUP 2
#define INA_DECIDE_HOLD 4

/* transient: b's memory is reused once the sink returns (a held copy, or a caller's scratch buffer),
 * so a sink that keeps b past its return must copy it */
typedef void (*ina_sink)(void *ctx, uint64_t addr, const uint8_t *a, uint32_t alen, const uint8_t *b,
                         uint32_t blen, int transient);

typedef struct {
    double loss, dup, reorder;
    uint64_t key, ctr;
    uint64_t dropped, duplicated, reordered;
    uint8_t *held;
    uint32_t held_a, held_b;
    uint64_t held_addr;
    int full;
} ina_impair;

static inline int ina_impair_init(ina_impair *im, double loss, double dup, double reorder, uint64_t seed,
                                  size_t max_len)
{
    memset(im, 0, sizeof *im);
    im->loss = loss, im->dup = dup, im->reorder = reorder;
    im->key = ina_rng_key(seed);
    im->held = malloc(max_len);
    return im->held ? 0 : -1;
}

static inline void ina_impair_free(ina_impair *im) { free(im->held); }
static inline int ina_impair_active(const ina_impair *im) { return im->loss || im->dup || im->reorder; }

static inline double ina_impair_uniform(ina_impair *im)
{
    return (double)(ina_rng_word(im->key, im->ctr++) >> 11) * 0x1p-53;
}

/* deliver the held packet, if any; its buffer is free again before the sink runs only for a later hold */
static inline void ina_impair_flush(ina_impair *im, ina_sink sink, void *ctx)
{
    if (!im->full)
        return;
    im->full = 0;
    sink(ctx, im->held_addr, im->held, im->held_a, im->held + im->held_a, im->held_b, 1);
}

/* the faults for one packet, drawn in the order the Python server draws them (loss, then dup, then reorder
 * unless a packet is already held): INA_DECIDE_* flags, so a capture can note them before the packet goes */
static inline int ina_impair_decide(ina_impair *im)
{
    if (im->loss && ina_impair_uniform(im) < im->loss) {
        im->dropped++;
        return INA_DECIDE_DROP;
    }
    int d = 0;
    if (im->dup && ina_impair_uniform(im) < im->dup) {
        im->duplicated++;
        d |= INA_DECIDE_DUP;
    }
    if (!im->full && im->reorder && ina_impair_uniform(im) < im->reorder) {
        im->reordered++;
        d |= INA_DECIDE_HOLD;
    }
    return d;
}

/* carry out decision d: a held packet is copied and goes after the next one; one held before goes now */
static inline void ina_impair_act(ina_impair *im, int d, uint64_t addr, const uint8_t *a, uint32_t alen,
                                  const uint8_t *b, uint32_t blen, int transient, ina_sink sink, void *ctx)
{
    if (d & INA_DECIDE_DROP)
        return;
    if (d & INA_DECIDE_HOLD) {
        memcpy(im->held, a, alen);
        memcpy(im->held + alen, b, blen);
        im->held_a = alen, im->held_b = blen, im->held_addr = addr;
        im->full = 1;
        if (d & INA_DECIDE_DUP)
            sink(ctx, addr, a, alen, b, blen, transient);
        return;
    }
    sink(ctx, addr, a, alen, b, blen, transient);
    if (d & INA_DECIDE_DUP)
        sink(ctx, addr, a, alen, b, blen, transient);
    ina_impair_flush(im, sink, ctx);
}

static inline void ina_impair_apply(ina_impair *im, uint64_t addr, const uint8_t *a, uint32_t alen,
                                    const uint8_t *b, uint32_t blen, int transient, ina_sink sink, void *ctx)
{
    ina_impair_act(im, ina_impair_decide(im), addr, a, alen, b, blen, transient, sink, ctx);
}
#endif
