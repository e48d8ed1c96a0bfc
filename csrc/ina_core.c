/* switchsim/model.py in C. The model is the specification: every branch below names the model's, in the
 * same order, so that outputs and counters agree (tests/test_native.py checks it on random traffic). */
#include "ina_core.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ina_core_lanes.h"
#include "ina_packet.h"
#include "ina_rng.h"

typedef struct {
    uint64_t bitmap;
    uint32_t count;
    uint32_t round_id;
    uint8_t has_round, complete, codec, flags;
    int8_t exp_cur, exp_max;
    uint16_t n_elems;
    uint8_t sparse;                /* a block-sparse round: block and next_block apply */
    uint32_t block, next_block;    /* the round's block; smallest next block over workers heard so far */
    uint8_t call_kind, writer;     /* the round's call (of its first packet) and the rank that sent that */
    uint16_t call;
    uint32_t call_len;
    uint8_t narrow;  /* a round summed in int32 lanes (NC: counted from narrow_floor; values()) */
    int8_t narrow_floor;
    int64_t *acc;    /* elements (job_reset_slots): int64 sums, or int32 ones in the first half (narrow) */
    uint8_t *result; /* INA_BLOCK_EXT_SIZE + elements * 4: the result payload, kept for unicast resends */
    uint32_t result_len;
} slot_set;

typedef struct {
    uint32_t job_id, world_size;
    uint32_t slots; /* its own (a shared switch gives each job the slots it admitted) */
    int narrow_span; /* levels above a narrow round's floor: world_size * 2^narrow_span <= 2^30 */
    uint64_t generation;
    slot_set *sets; /* sets[2 * slot + set] */
    int64_t *acc_mem;
    uint8_t *result_mem;
    uint64_t *counters; /* [INA_SLOT_COUNTERS][slots] */
    uint32_t session;   /* of the admitted generation (generation 0: none admitted) */
    uint32_t first_id;  /* every slot's first packet id in this generation */
    uint32_t elements;  /* the generation's agreed elements per packet: a data packet with more is bad_slot */
    uint64_t addresses[INA_MAX_WORKERS]; /* rank -> the address it joined from */
    uint64_t group;                      /* where results go once for every member; 0: a copy to each */
    uint64_t heard[INA_MAX_WORKERS];     /* rank -> admitted packets */
    /* the generation failed (failed_len > 0): the error payload (code, rank, text) its packets get */
    uint8_t failed[INA_ERROR_PAYLOAD_SIZE + INA_MAX_ERROR_TEXT];
    uint32_t failed_len;
    uint32_t told[INA_MAX_WORKERS]; /* rank -> bit (1 << drop reason) per reason answered this generation */
} job_t;

#define TOLD_TEXT 160 /* an ERR_DROPPED's text, at most (and never more than the dropped packet has room for) */

struct ina_switch {
    uint32_t slots, max_elements;
    int nc_deterministic;
    const ina_lane_ops *lanes; /* scalar, AVX2 or AVX-512 lane arithmetic, chosen once (ina_core_simd.c) */
    uint64_t seed, rng_key;
    uint64_t nc_elements_rounded;
    uint32_t boot; /* the switch's boot id, in everything it sends (the control plane sets it) */
    ina_counters c;
    uint32_t n_jobs;
    job_t *jobs;
    int32_t job_index[65536];
    uint8_t told[INA_ERROR_PAYLOAD_SIZE + TOLD_TEXT]; /* the last ERR_DROPPED's payload (transient) */
};

/* the packet being processed: its header (NULL: it did not parse), elements, size and source, and where the
 * packets it causes go */
typedef struct {
    const header *h;
    const uint8_t *payload;
    size_t len;
    uint64_t src;
    ina_out *out;
} packet;

static inline int serial_gt(uint32_t a, uint32_t b)
{
    uint32_t d = a - b;
    return d != 0 && d < 0x80000000u;
}

/* ------------------------------------------------------------------ life cycle */
ina_switch *ina_switch_new(uint32_t slots, uint32_t max_elements, int nc_deterministic, uint64_t seed)
{
    if (slots < 1 || slots > INA_MAX_SLOTS || max_elements < 1 || max_elements > INA_MAX_ELEMENTS)
        return NULL;
    ina_switch *sw = calloc(1, sizeof *sw);
    if (!sw)
        return NULL;
    sw->slots = slots;
    sw->max_elements = max_elements;
    sw->nc_deterministic = nc_deterministic;
    sw->seed = seed;
    sw->rng_key = ina_rng_key(seed);
    sw->lanes = ina_lanes_pick();
    memset(sw->job_index, 0xff, sizeof sw->job_index);
    return sw;
}

/* A set's sums and result, in elements of the generation's packets: whole cache lines, and one line more, so
 * that the sets lie densely and start on every cache set (at max_elements apart, a 1 KiB packet's sums used 1/8
 * of the L2's sets, and a window of slots missed it) */
static size_t acc_stride(uint32_t elements) { return ((size_t)elements + 7) / 8 * 8 + 8; }
static size_t result_stride(uint32_t elements)
{
    return (INA_BLOCK_EXT_SIZE + 4 * (size_t)elements + 63) / 64 * 64 + 64;
}

/* every set empty, laid out for packets of j->elements */
static void job_reset_slots(job_t *j)
{
    size_t acc = acc_stride(j->elements), result = result_stride(j->elements);
    for (uint32_t i = 0; i < 2 * j->slots; i++) {
        slot_set *st = &j->sets[i];
        memset(st, 0, sizeof *st);
        st->acc = j->acc_mem + i * acc;
        st->result = j->result_mem + i * result;
        st->exp_max = INA_EXP_NONE;
        st->block = st->next_block = INA_BLOCK_NONE;
    }
}

static void job_free(job_t *j)
{
    free(j->sets); free(j->acc_mem); free(j->result_mem); free(j->counters);
}

/* j's sets, sums, results and counters for its slots; -1 (nothing kept) when out of memory */
static int job_alloc(const ina_switch *sw, job_t *j)
{
    size_t n_sets = 2 * (size_t)j->slots;
    j->sets = calloc(n_sets, sizeof *j->sets);
    /* calloc: pages of slots never used are never touched */
    j->acc_mem = calloc(n_sets * acc_stride(sw->max_elements), sizeof(int64_t));
    j->result_mem = calloc(n_sets, result_stride(sw->max_elements));
    j->counters = calloc((size_t)INA_SLOT_COUNTERS * j->slots, sizeof(uint64_t));
    if (!j->sets || !j->acc_mem || !j->result_mem || !j->counters) {
        job_free(j);
        return -1;
    }
    j->elements = sw->max_elements;
    job_reset_slots(j);
    return 0;
}

int ina_switch_add_job(ina_switch *sw, uint32_t job_id, uint32_t world_size, uint32_t slots)
{
    slots = slots ? slots : sw->slots;
    if (job_id > 0xFFFF || world_size < 1 || world_size > INA_MAX_WORKERS || slots > INA_MAX_SLOTS ||
        sw->job_index[job_id] >= 0)
        return -1;
    job_t *jobs = realloc(sw->jobs, (sw->n_jobs + 1) * sizeof *jobs);
    if (!jobs)
        return -1;
    sw->jobs = jobs;
    job_t *j = &jobs[sw->n_jobs];
    memset(j, 0, sizeof *j);
    j->slots = slots;
    if (job_alloc(sw, j) != 0)
        return -1;
    j->job_id = job_id;
    j->world_size = world_size;
    j->narrow_span = 30;
    while ((1u << (30 - j->narrow_span)) < world_size)
        j->narrow_span--;
    sw->job_index[job_id] = (int32_t)sw->n_jobs++;
    return 0;
}

int ina_switch_remove_job(ina_switch *sw, uint32_t job_id)
{
    int32_t ji = job_id <= 0xFFFF ? sw->job_index[job_id] : -1;
    if (ji < 0)
        return -1;
    job_free(&sw->jobs[ji]);
    sw->job_index[job_id] = -1;
    /* the later jobs move down one, so jobs stay in the order added (the model's dict order in stats) */
    memmove(&sw->jobs[ji], &sw->jobs[ji + 1], (sw->n_jobs - (uint32_t)ji - 1) * sizeof *sw->jobs);
    sw->n_jobs--;
    for (uint32_t i = (uint32_t)ji; i < sw->n_jobs; i++)
        sw->job_index[sw->jobs[i].job_id] = (int32_t)i;
    return 0;
}

void ina_switch_free(ina_switch *sw)
{
    if (!sw)
        return;
    for (uint32_t i = 0; i < sw->n_jobs; i++)
        job_free(&sw->jobs[i]);
    free(sw->jobs);
    free(sw);
}

/* ------------------------------------------------------------------ counters */
const ina_counters *ina_switch_counters(const ina_switch *sw) { return &sw->c; }
uint32_t ina_switch_jobs(const ina_switch *sw) { return sw->n_jobs; }
uint32_t ina_switch_slots(const ina_switch *sw) { return sw->slots; }
const char *ina_switch_lanes(const ina_switch *sw) { return sw->lanes->name; }
void ina_switch_count_out(ina_switch *sw, uint64_t n) { sw->c.packets_out += n; }
void ina_switch_set_boot(ina_switch *sw, uint32_t boot) { sw->boot = boot; }

void ina_switch_count_dropped_in(ina_switch *sw, int reason)
{
    sw->c.packets_in++;
    ina_switch_count_drop(sw, reason);
}

void ina_switch_job_info(const ina_switch *sw, uint32_t i, uint32_t *job_id, uint32_t *world_size,
                         uint64_t *generation, uint32_t *slots)
{
    *job_id = sw->jobs[i].job_id;
    *world_size = sw->jobs[i].world_size;
    *generation = sw->jobs[i].generation;
    *slots = sw->jobs[i].slots;
}

const uint64_t *ina_switch_job_slot_counters(const ina_switch *sw, uint32_t i) { return sw->jobs[i].counters; }

static inline uint64_t *slot_counter(job_t *j, int which, uint32_t slot)
{
    return &j->counters[(size_t)which * j->slots + slot];
}

static int drop(ina_switch *sw, int reason, job_t *j, int slot)
{
    sw->c.drops[reason]++;
    if (j && slot >= 0)
        (*slot_counter(j, INA_SLOT_DROPPED, (uint32_t)slot))++;
    return 0;
}

/* ------------------------------------------------------------------ what the control plane calls */
static job_t *job_of(const ina_switch *sw, uint32_t job_id)
{
    int32_t ji = job_id <= 0xFFFF ? sw->job_index[job_id] : -1;
    return ji < 0 ? NULL : &sw->jobs[ji];
}

int ina_switch_admit(ina_switch *sw, uint32_t job_id, uint64_t generation, uint32_t session, uint32_t first_id,
                     const uint64_t *addrs, uint32_t elements, uint64_t group)
{
    job_t *j = job_of(sw, job_id);
    if (!j || elements > sw->max_elements)
        return -1;
    j->elements = elements ? elements : sw->max_elements;
    j->generation = generation;
    j->session = session;
    j->first_id = first_id;
    j->failed_len = 0;
    memset(j->told, 0, sizeof j->told);
    memcpy(j->addresses, addrs, j->world_size * sizeof *addrs);
    j->group = group;
    job_reset_slots(j);
    return 0;
}

int ina_switch_member_packets(const ina_switch *sw, uint32_t job_id, uint64_t *out)
{
    const job_t *j = job_of(sw, job_id);
    if (!j)
        return -1;
    memcpy(out, j->heard, j->world_size * sizeof *out);
    return 0;
}

int ina_switch_is_member(const ina_switch *sw, const uint8_t *pkt, size_t len, uint64_t src)
{
    if (len < INA_HEADER_SIZE)
        return 0;
    const job_t *j = job_of(sw, (uint32_t)pkt[INA_OFF_JOB] << 8 | pkt[INA_OFF_JOB + 1]);
    uint8_t rank = pkt[INA_OFF_RANK];
    return j && j->generation && rank < j->world_size && j->addresses[rank] == src;
}

/* model: Switch._error. The generation's error to a rank: a header (count 0) and the failure's payload,
 * transient (a later generation's failure rewrites it), with the switch's boot id. As the answer to a data
 * packet (answered, else NULL) it echoes the packet's id and pool with INA_FLAG_REPLY */
static void error_to(const ina_switch *sw, const job_t *j, uint8_t rank, uint64_t dst, const header *answered,
                     ina_out *o)
{
    const header none = {0};
    const header *a = answered ? answered : &none;
    o->dst = dst;
    put_header(o->hdr, INA_MSG_ERROR, (uint16_t)j->job_id, rank, a->packet_id, a->slot, a->set, 0, INA_CODEC_NONE, 0,
               INA_EXP_NONE, answered ? INA_FLAG_REPLY : 0, j->session);
    put_boot(o->hdr, sw->boot);
    o->payload = j->failed;
    o->len = j->failed_len;
    o->stable = 0;
}

/* model: Switch.fail. The first failure of a generation stands (text cut to INA_MAX_ERROR_TEXT bytes); every
 * failure sends it to every member. The number of packets in out (0: no generation admitted) */
static int fail_generation(const ina_switch *sw, job_t *j, uint8_t code, uint8_t rank, const char *text,
                           size_t text_len, ina_out *out)
{
    if (!j->generation)
        return 0;
    if (!j->failed_len) {
        size_t n = text_len < INA_MAX_ERROR_TEXT ? text_len : INA_MAX_ERROR_TEXT;
        j->failed[0] = code;
        j->failed[1] = rank;
        memcpy(j->failed + INA_ERROR_PAYLOAD_SIZE, text, n);
        j->failed_len = (uint32_t)(INA_ERROR_PAYLOAD_SIZE + n);
    }
    for (uint32_t r = 0; r < j->world_size; r++)
        error_to(sw, j, (uint8_t)r, j->addresses[r], NULL, &out[r]);
    return (int)j->world_size;
}

int ina_switch_fail(ina_switch *sw, uint32_t job_id, uint8_t code, uint8_t rank, const char *text, size_t text_len,
                    ina_out *out)
{
    job_t *j = job_of(sw, job_id);
    return j ? fail_generation(sw, j, code, rank, text, text_len, out) : -1;
}

int ina_switch_failed(const ina_switch *sw, uint32_t job_id)
{
    const job_t *j = job_of(sw, job_id);
    return j ? j->failed_len != 0 : -1;
}

void ina_switch_count_drop(ina_switch *sw, int reason)
{
    if (reason >= 0 && reason < INA_DROP_COUNT)
        sw->c.drops[reason]++;
}

/* ------------------------------------------------------------------ data plane */
/* payload -> the round's sums (int32 elements, or NC codes as multiples of the round's floor level); 0 if a
 * code is invalid for the block's exponent (model: natural.codes_to_int) */
/* values' add modes: 0 write, 1 add, ADD_AT_FINISH validate only (the round's last NC packet or narrow int32
 * one: finish adds it) */
#define ADD_AT_FINISH 2

/* A round's NC sums are exact in int32 lanes when counted from a floor narrow_span levels below the block's
 * top (world_size values of at most 2^narrow_span each), and gradients' codes rarely spread wider: such a
 * round is narrow, twice the lanes per vector and half the memory. A packet with a code below that floor
 * widens the round first (its sums to int64, counted from the block's floor). Rounding from the higher floor
 * gives the same codes (ina_nc_sum_code: the extra low bits never change the comparison), so no peer sees
 * the difference. */
static void widen(slot_set *st, uint32_t n, int floor)
{
    uint64_t scale = (uint64_t)1 << (st->narrow_floor - floor);
    for (uint32_t i = n; i-- > 0;) { /* backwards: int64 i covers int32 2i and 2i + 1, read before */
        int32_t x;
        memcpy(&x, (const uint8_t *)st->acc + 4 * (size_t)i, sizeof x);
        st->acc[i] = (int64_t)((uint64_t)(int64_t)x * scale);
    }
    st->narrow = 0;
}

static int nc_values(const ina_switch *sw, const job_t *j, const header *h, const uint8_t *p, slot_set *st, int add)
{
    const ina_lane_ops *l = sw->lanes;
    uint32_t n = h->count;
    int floor = nc_floor(h->exp_cur);
    int top = h->exp_cur < INA_NC_LEVEL_MAX ? h->exp_cur : INA_NC_LEVEL_MAX;
    int low = top - j->narrow_span > floor ? top - j->narrow_span : floor; /* a narrow round's floor */
    /* validate first, so a bad packet leaves the sums untouched */
    int may = l->nc_values32 && (!add || st->narrow); /* a wide round stays wide */
    int narrow = may && l->nc_valid(p, n, low, top);
    if (!narrow && ((may && low == floor) || !l->nc_valid(p, n, floor, top)))
        return 0; /* (the first check already covered the block's whole range) */
    if (!add) {
        st->narrow = (uint8_t)narrow;
        st->narrow_floor = (int8_t)low;
    } else if (st->narrow && !narrow) {
        widen(st, n, floor);
    }
    if (add == ADD_AT_FINISH)
        return 1;
    if (narrow)
        l->nc_values32(p, n, low, (int32_t *)(void *)st->acc, add);
    else
        l->nc_values(p, n, floor, st->acc, add);
    return 1;
}

/* An int32 round is summed in int32 lanes until an add wraps: that packet widens it to int64. Every earlier
 * add fit, so each lane's wrapped sum less the packet's element (mod 2^32) is its exact sum before it; the
 * int64 sums then decide OVERFLOW at finish as before. Half the memory and twice the lanes per vector of
 * int64 sums, and the bytes and flags of the model (no peer sees the difference). */
static void widen_int32(slot_set *st, const uint8_t *p, uint32_t n)
{
    for (uint32_t i = n; i-- > 0;) { /* backwards, as widen() */
        int32_t s;
        memcpy(&s, (const uint8_t *)st->acc + 4 * (size_t)i, sizeof s);
        uint32_t x = rd32(p + 4 * i);
        st->acc[i] = (int64_t)(int32_t)((uint32_t)s - x) + (int32_t)x;
    }
    st->narrow = 0;
}

static void int32_values(const ina_switch *sw, const uint8_t *p, uint32_t n, slot_set *st, int add)
{
    const ina_lane_ops *l = sw->lanes;
    int32_t *acc32 = (int32_t *)(void *)st->acc;
    if (!add && l->int32_values32) {
        l->int32_values32(p, n, acc32, 0);
        st->narrow = 1;
    } else if (add && st->narrow) {
        if (l->int32_values32(p, n, acc32, 1))
            widen_int32(st, p, n);
    } else {
        l->int32_values(p, n, st->acc, add);
    }
}

static int values(const ina_switch *sw, const job_t *j, const header *h, const uint8_t *p, slot_set *st, int add)
{
    uint32_t n = h->count;
    if (!add)
        st->narrow = 0; /* nc_values and int32_values set it for the rounds they sum */
    if (h->codec == INA_CODEC_INT32) {
        if (add != ADD_AT_FINISH)
            int32_values(sw, p, n, st, add);
        return 1;
    }
    if (h->exp_cur == INA_EXP_NONE) {
        uint8_t any = 0;
        for (uint32_t i = 0; i < n; i++)
            any |= p[i];
        if (any)
            return 0;
        if (!add)
            memset(st->acc, 0, n * sizeof *st->acc);
        return 1;
    }
    return nc_values(sw, j, h, p, st, add);
}

/* the round's sums with the last packet's codes added, rounded to codes (finish); acc is left as it was */
static int nc_add_finish(const ina_switch *sw, const uint8_t *p, const int64_t *acc, uint32_t n, int floor,
                         uint64_t base, uint8_t *res)
{
    const ina_lane_ops *l = sw->lanes;
    if (l->nc_add_finish)
        return l->nc_add_finish(p, acc, n, floor, sw->nc_deterministic, sw->rng_key, base, res);
    int over = 0;
    int64_t sums[256];
    for (uint32_t i = 0; i < n; i += 256) { /* the same two passes on a chunk that stays in L1 */
        uint32_t m = n - i < 256 ? n - i : 256;
        memcpy(sums, acc + i, m * sizeof *sums);
        l->nc_values(p + i, m, floor, sums, 1);
        over |= l->nc_finish(sums, m, floor, sw->nc_deterministic, sw->rng_key, base + i, res + i);
    }
    return over;
}

/* a round's NC codes from element h on (h: 0 or 1), counter base + h (even: the lanes pair elements on a word),
 * with its last packet's codes added first when last is not NULL; narrow rounds from their int32 sums */
static int nc_finish_from(const ina_switch *sw, const slot_set *st, const uint8_t *last, uint32_t h, int floor,
                          uint64_t base, uint8_t *res)
{
    const ina_lane_ops *l = sw->lanes;
    uint32_t n = st->n_elems - h;
    int det = sw->nc_deterministic;
    const uint8_t *p = last ? last + h : NULL;
    if (st->narrow) {
        const int32_t *acc = (const int32_t *)(const void *)st->acc + h;
        return p ? l->nc_add_finish32(p, acc, n, st->narrow_floor, det, sw->rng_key, base + h, res + h)
                 : l->nc_finish32(acc, n, st->narrow_floor, det, sw->rng_key, base + h, res + h);
    }
    return p ? nc_add_finish(sw, p, st->acc + h, n, floor, base + h, res + h)
             : l->nc_finish(st->acc + h, n, floor, det, sw->rng_key, base + h, res + h);
}

/* a round's NC codes; an element at an odd counter first is rounded alone (its word's other half was the
 * previous round's) */
static int nc_finish_round(const ina_switch *sw, const slot_set *st, const uint8_t *last, int floor, uint8_t *res)
{
    uint64_t base = sw->nc_elements_rounded;
    uint32_t h = (base & 1) && st->n_elems, over = 0;
    if (h) {
        int f = st->narrow ? st->narrow_floor : floor;
        int64_t s = st->narrow ? ((const int32_t *)(const void *)st->acc)[0] : st->acc[0];
        s += last ? ina_nc_code_int(last[0], f) : 0;
        res[0] = ina_nc_sum_code(s, f, sw->nc_deterministic, sw->rng_key, base, &over);
    }
    return (int)over | nc_finish_from(sw, st, last, h, floor, base, res);
}

/* model: Switch._finish; the result payload is computed once per round so resends are identical. last: the
 * payload of the round's last NC or narrow int32 packet, validated but not yet added (join_round), or NULL */
static void finish(ina_switch *sw, slot_set *st, const uint8_t *last)
{
    uint32_t n = st->n_elems;
    const int64_t *acc = st->acc;
    uint32_t ext = st->sparse ? INA_BLOCK_EXT_SIZE : 0;
    uint8_t *res = st->result + ext;
    if (ext) {
        wr32(st->result, st->block);
        wr32(st->result + 4, st->next_block);
    }
    if (st->codec == INA_CODEC_INT32) {
        if (last && st->narrow && !sw->lanes->int32_add_finish32(last, (const int32_t *)(const void *)acc, n, res)) {
            st->result_len = ext + 4 * n; /* every add fit, the last one too */
            return;
        }
        if (last)
            int32_values(sw, last, n, st, 1); /* it wrapped: add it again, widening the round */
        if (st->narrow) /* every add fit: so does the sum */
            sw->lanes->int32_finish32((const int32_t *)(const void *)acc, n, res);
        else if (sw->lanes->int32_finish(acc, n, res)) { /* wraps like the hardware; the flag says so */
            st->flags |= INA_FLAG_OVERFLOW;
            sw->c.overflows++;
        }
        st->result_len = ext + 4 * n;
        return;
    }
    int floor = st->exp_cur != INA_EXP_NONE ? nc_floor(st->exp_cur) : INA_NC_LEVEL_MIN;
    /* element i of the switch's paired stream rounds the round's element i, counting over every NC round finished */
    if (nc_finish_round(sw, st, last, floor, res)) {
        st->flags |= INA_FLAG_OVERFLOW;
        sw->c.overflows++;
    }
    sw->nc_elements_rounded += n;
    st->result_len = ext + n;
}

/* model: Switch._result. The round's result for rank at dst, with the round's call and the switch's boot id (the
 * group's one copy: rank INA_NO_RANK with INA_FLAG_GROUP) */
static void result(const ina_switch *sw, const job_t *j, const header *h, const slot_set *st, uint8_t rank,
                   uint64_t dst, ina_out *o)
{
    o->dst = dst;
    uint8_t group = rank == INA_NO_RANK ? INA_FLAG_GROUP : 0;
    put_header(o->hdr, st->sparse ? INA_MSG_SPARSE_RESULT : INA_MSG_RESULT, (uint16_t)j->job_id, rank,
               st->round_id, h->slot, h->set, st->n_elems, st->codec, st->exp_cur, st->exp_max, st->flags | group,
               j->session);
    put_call(o->hdr, st->call_kind, st->call, st->call_len);
    put_boot(o->hdr, sw->boot);
    o->payload = st->result;
    o->len = st->result_len;
    o->stable = 1;
}

/* model: Switch._sparse_fits */
static int sparse_fits(const slot_set *st, const header *h)
{
    if (!st->sparse || h->codec != st->codec || h->exp_cur != st->exp_cur)
        return 0;
    if (h->count && st->block != INA_BLOCK_NONE && (h->block != st->block || h->count != st->n_elems))
        return 0;
    uint32_t block = h->count ? h->block : st->block;
    uint32_t next = h->next_block < st->next_block ? h->next_block : st->next_block;
    return block == INA_BLOCK_NONE || next > block;
}

/* model: Switch._sparse_add, after values() wrote or added the elements */
static void sparse_add(slot_set *st, const header *h)
{
    if (h->count && st->block == INA_BLOCK_NONE) {
        st->block = h->block;
        st->n_elems = h->count;
    }
    if (h->next_block < st->next_block) {
        st->next_block = h->next_block;
        st->exp_max = h->exp_next;
    } else if (h->next_block == st->next_block && h->exp_next > st->exp_max) {
        st->exp_max = h->exp_next;
    }
}

/* model: _next_round. The one packet id a new round of (slot, set x) may have; *none: no round may start */
static uint32_t next_round(const slot_set *st, const slot_set *other, uint32_t x, uint32_t first_id, int *none)
{
    *none = 0;
    if (!other->has_round) {
        *none = x != 0 || st->has_round;
        return first_id;
    }
    *none = !other->complete;
    return other->round_id + 1;
}

/* model: _behind_or_ahead */
static int behind_or_ahead(uint32_t pid, uint32_t expected, int none)
{
    return none || serial_gt(pid, expected) ? INA_DROP_AHEAD : INA_DROP_STALE;
}

/* model: _admitted. The job, or NULL with the drop reason in *reason */
static job_t *admitted(ina_switch *sw, const header *h, uint64_t src, int *reason)
{
    int32_t ji = sw->job_index[h->job];
    job_t *j = ji < 0 ? NULL : &sw->jobs[ji];
    *reason = !j ? INA_DROP_UNKNOWN_JOB
              : h->rank >= j->world_size || !j->generation ? INA_DROP_UNKNOWN_WORKER
              : src != j->addresses[h->rank] ? INA_DROP_SPOOFED
              : h->session != j->session ? INA_DROP_WRONG_SESSION : -1;
    if (*reason >= 0)
        return NULL;
    j->heard[h->rank]++;
    return j;
}

/* model: Switch._not_member. A data packet of a generation the switch does not have: a header-only error
 * (never larger than the packet) to its source, the answer to it (its packet id and pool, INA_FLAG_REPLY)
 * with its session and the switch's boot id */
static int not_member(ina_switch *sw, const header *h, uint64_t src, int reason, ina_out *o)
{
    drop(sw, reason, NULL, -1);
    o->dst = src;
    put_header(o->hdr, INA_MSG_ERROR, h->job, h->rank, h->packet_id, h->slot, h->set, 0, INA_CODEC_NONE, 0,
               INA_EXP_NONE, INA_FLAG_REPLY, h->session);
    put_boot(o->hdr, sw->boot);
    o->payload = o->hdr; /* no payload */
    o->len = 0;
    o->stable = 0;
    return 1;
}

/* the drop reasons a member is told of (wire.TOLD_DROPS), by their names in wire.DROP_REASONS */
static const char *const told_names[INA_DROP_COUNT] = {
    [INA_DROP_MALFORMED] = "malformed", [INA_DROP_BAD_SLOT] = "bad_slot", [INA_DROP_STALE] = "stale",
    [INA_DROP_AHEAD] = "ahead", [INA_DROP_MISMATCH] = "mismatch", [INA_DROP_BAD_CODES] = "bad_codes",
};

/* the ERR_DROPPED of tell(): sw->told's first n bytes to the packet's source, a reply (FLAG_REPLY) that echoes
 * its packet id and pool when it parsed (else 0), with the generation's session and the switch's boot id */
static void told_to(const ina_switch *sw, const job_t *j, uint8_t rank, const packet *p, uint32_t n)
{
    const header none = {0};
    const header *a = p->h ? p->h : &none;
    ina_out *o = p->out;
    o->dst = p->src;
    put_header(o->hdr, INA_MSG_ERROR, (uint16_t)j->job_id, rank, a->packet_id, a->slot, a->set, 0, INA_CODEC_NONE,
               0, INA_EXP_NONE, INA_FLAG_REPLY, j->session);
    put_boot(o->hdr, sw->boot);
    o->payload = sw->told;
    o->len = n;
    o->stable = 0;
}

/* model: Switch._tell. A member's packet dropped for its sender's mistake: counted (slot -1: no slot's);
 * the first time this generation for this rank and reason, answered with ERR_DROPPED (code, the reason's
 * index, "<reason>: " and the detail fmt words), cut so that it is never larger than the packet (none for a
 * packet too short for the two code bytes). The packets written: 0 or 1 */
__attribute__((format(printf, 7, 8)))
static int tell(ina_switch *sw, job_t *j, uint8_t rank, const packet *p, int reason, int slot, const char *fmt, ...)
{
    drop(sw, reason, j, slot);
    uint32_t bit = 1u << reason;
    if ((j->told[rank] & bit) || p->len < INA_HEADER_SIZE + INA_ERROR_PAYLOAD_SIZE)
        return 0;
    j->told[rank] |= bit;
    char text[TOLD_TEXT + 1];
    int n = snprintf(text, sizeof text, "%s: ", told_names[reason]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text + n, sizeof text - (size_t)n, fmt, ap);
    va_end(ap);
    size_t len = strlen(text), room = p->len - INA_HEADER_SIZE - INA_ERROR_PAYLOAD_SIZE;
    len = len < room ? len : room;
    sw->told[0] = INA_ERR_DROPPED;
    sw->told[1] = (uint8_t)reason;
    memcpy(sw->told + INA_ERROR_PAYLOAD_SIZE, text, len);
    told_to(sw, j, rank, p, (uint32_t)(INA_ERROR_PAYLOAD_SIZE + len));
    return 1;
}

/* wire.unpack's words for a data message's length or block extension that parse() refused */
static void data_why(const uint8_t *d, size_t len, char *t, size_t size)
{
    unsigned count = rd16(d + INA_OFF_COUNT), codec = d[INA_OFF_CODEC];
    unsigned esize = codec == INA_CODEC_INT32 ? 4 : codec == INA_CODEC_NC8 ? 1 : 0;
    int sparse = d[INA_OFF_MSG_TYPE] == INA_MSG_SPARSE_UPDATE || d[INA_OFF_MSG_TYPE] == INA_MSG_SPARSE_RESULT;
    unsigned ext = sparse ? INA_BLOCK_EXT_SIZE : 0;
    if (!esize) {
        snprintf(t, size, "unknown codec %u", codec);
        return;
    }
    if (len != INA_HEADER_SIZE + ext + (size_t)count * esize) {
        snprintf(t, size, "payload is %zu bytes, header says %u + %u x %u", len - INA_HEADER_SIZE, ext, count, esize);
        return;
    }
    if (!sparse) { /* parse() takes every other data message of the right length */
        snprintf(t, size, "bad header");
        return;
    }
    uint32_t block = rd32(d + INA_HEADER_SIZE), next = rd32(d + INA_HEADER_SIZE + 4);
    if ((count == 0) != (block == INA_BLOCK_NONE))
        snprintf(t, size, "block extension: block 0x%x with %u elements", block, count);
    else
        snprintf(t, size, "block extension: next block %u is not after block %u", next, block);
}

/* wire.unpack's words for a datagram parse() refused, or (parsed) what the message no worker sends is */
static void malformed_why(const uint8_t *d, size_t len, int parsed, char *t, size_t size)
{
    static const char *const names[INA_MSG_COUNT] = {"update", "result", "join", "join_ack", "join_wait", "error",
                                                      "stats_req", "stats", "sparse_update", "sparse_result"};
    unsigned type = len > INA_OFF_MSG_TYPE ? d[INA_OFF_MSG_TYPE] : 0;
    if (parsed)
        snprintf(t, size, "a %s is never sent to a switch", names[type] ? names[type] : "message of this type");
    else if (len < INA_HEADER_SIZE)
        snprintf(t, size, "truncated header: %zu < %d bytes", len, INA_HEADER_SIZE);
    else if (d[INA_OFF_VERSION] != INA_VERSION)
        snprintf(t, size, "unknown version %u", d[INA_OFF_VERSION]);
    else if (type >= INA_MSG_COUNT)
        snprintf(t, size, "unknown message type %u", type);
    else if (rd16(d + INA_OFF_POOL) & INA_POOL_RESERVED_BIT)
        snprintf(t, size, "reserved pool-index bit 14 is set");
    else if (type == INA_MSG_UPDATE || type == INA_MSG_RESULT || type == INA_MSG_SPARSE_UPDATE ||
             type == INA_MSG_SPARSE_RESULT)
        data_why(d, len, t, size);
    else
        snprintf(t, size, "join is %zu bytes, not %d", len, INA_JOIN_SIZE); /* parse() refuses nothing else */
}

/* model: Switch._malformed. A datagram that does not parse, or (parsed) a message no worker sends to a switch:
 * if its job and rank bytes (offsets 4 and 6 in every version) name a member of an admitted generation that
 * sent it from its address, it is told why; anyone else's is only counted */
static int malformed(ina_switch *sw, const uint8_t *pkt, size_t len, int parsed, uint64_t src, ina_out *out)
{
    if (len < INA_OFF_RANK + 1)
        return drop(sw, INA_DROP_MALFORMED, NULL, -1);
    job_t *j = job_of(sw, rd16(pkt + INA_OFF_JOB));
    uint8_t rank = pkt[INA_OFF_RANK];
    if (!j || !j->generation || rank >= j->world_size || j->addresses[rank] != src)
        return drop(sw, INA_DROP_MALFORMED, NULL, -1);
    char why[TOLD_TEXT];
    malformed_why(pkt, len, parsed, why, sizeof why);
    const packet p = {NULL, NULL, len, src, out};
    return tell(sw, j, rank, &p, INA_DROP_MALFORMED, -1, "%s", why);
}

/* model: Switch._out_of_order. A packet id the slot does not take now (expected; none: no new round yet) */
static int out_of_order(ina_switch *sw, job_t *j, const packet *p, uint32_t expected, int none)
{
    const header *h = p->h;
    char wanted[48];
    if (none)
        snprintf(wanted, sizeof wanted, "no new round yet");
    else
        snprintf(wanted, sizeof wanted, "the slot's round is %u", expected);
    return tell(sw, j, h->rank, p, behind_or_ahead(h->packet_id, expected, none), h->slot,
                "packet id %u on slot %u set %u; %s", h->packet_id, h->slot, h->set, wanted);
}

/* model: Switch._bad_codes */
static int bad_codes(ina_switch *sw, job_t *j, const packet *p)
{
    return tell(sw, j, p->h->rank, p, INA_DROP_BAD_CODES, p->h->slot,
                "NC codes outside the block's range for exponent %d, or 0x80", p->h->exp_cur);
}

/* model: Switch._failed. A packet of a failed generation that no completed round answers: the error again,
 * as the answer to it, to the (admitted) sender only */
static int answer_failed(ina_switch *sw, job_t *j, const header *h, uint64_t src, ina_out *out)
{
    drop(sw, INA_DROP_FAILED, j, h->slot);
    error_to(sw, j, h->rank, src, h, out);
    return 1;
}

/* model: Switch._duplicate. A packet from a rank already counted in (slot, set): resend a completed round */
static int duplicate(ina_switch *sw, job_t *j, const packet *p, slot_set *st, slot_set *other)
{
    const header *h = p->h;
    if (h->packet_id != st->round_id) /* same set, other round: a protocol violation */
        return out_of_order(sw, j, p, st->round_id, 0);
    other->bitmap &= ~(1ULL << h->rank);
    if (st->complete) {
        (*slot_counter(j, INA_SLOT_RESENT, h->slot))++;
        result(sw, j, h, st, h->rank, p->src, p->out); /* unicast back where it came from */
        return 1;
    }
    if (j->failed_len)
        return answer_failed(sw, j, h, p->src, p->out);
    return drop(sw, INA_DROP_DUPLICATE, j, h->slot);
}

/* wire.describe_kind */
static void describe_kind(uint8_t kind, char *buf, size_t size)
{
    static const char *const names[INA_CALL_KIND_COUNT] = INA_CALL_KIND_NAMES;
    unsigned k = kind & (unsigned)~INA_CALL_SPARSE & 0xFF;
    const char *sparse = kind & INA_CALL_SPARSE ? " sparse" : "";
    if (k < INA_CALL_KIND_COUNT && names[k])
        snprintf(buf, size, "codec %s%s", names[k], sparse);
    else
        snprintf(buf, size, "codec kind %u%s", k, sparse);
}

/* wire.call_mismatch_text, word for word: how the packet's call differs from its round's (the writer's);
 * the text's length (cut to size - 1) */
static size_t call_mismatch_text(char *t, size_t size, const job_t *j, const header *h, const slot_set *st)
{
    int n;
    if (h->call != st->call) {
        n = snprintf(t, size, "job %u: ranks out of step: rank %u is at call %u, rank %u at call %u", j->job_id,
                     h->rank, h->call, st->writer, st->call);
    } else if (h->call_kind != st->call_kind) {
        char mine[32], theirs[32];
        describe_kind(h->call_kind, mine, sizeof mine);
        describe_kind(st->call_kind, theirs, sizeof theirs);
        n = snprintf(t, size, "job %u call %u: rank %u called allreduce with %s, rank %u with %s", j->job_id,
                     h->call, h->rank, mine, st->writer, theirs);
    } else {
        n = snprintf(t, size, "job %u call %u: rank %u called allreduce with %u elements, rank %u with %u",
                     j->job_id, h->call, h->rank, h->call_len, st->writer, st->call_len);
    }
    return n < 0 ? 0 : (size_t)n < size ? (size_t)n : size - 1;
}

/* model: the call check of Switch._update. A packet of another call than its round's fails the generation */
static int call_mismatch(ina_switch *sw, job_t *j, const header *h, const slot_set *st, ina_out *out)
{
    char text[INA_MAX_ERROR_TEXT + 1];
    drop(sw, INA_DROP_CALL_MISMATCH, j, h->slot);
    size_t n = call_mismatch_text(text, sizeof text, j, h, st);
    return fail_generation(sw, j, INA_ERR_CALL_MISMATCH, h->rank, text, n, out);
}

#define SUMMED (-2) /* start_round / join_round: the packet is in the round (else: packets to send) */

/* model: Switch._update, before == 0. The round's first packet: the one packet id it may have; its call,
 * shape and elements are the round's */
static int start_round(ina_switch *sw, job_t *j, const packet *p, slot_set *st, const slot_set *other)
{
    const header *h = p->h;
    int none;
    uint32_t expected = next_round(st, other, h->set, j->first_id, &none);
    if (none || h->packet_id != expected)
        return out_of_order(sw, j, p, expected, none);
    if (!values(sw, j, h, p->payload, st, 0))
        return bad_codes(sw, j, p);
    st->round_id = h->packet_id;
    st->has_round = 1;
    st->complete = 0;
    st->count = 0;
    st->call_kind = h->call_kind;
    st->call = h->call;
    st->call_len = h->call_len;
    st->writer = h->rank;
    st->codec = h->codec;
    st->n_elems = h->count;
    st->exp_cur = h->exp_cur;
    st->exp_max = h->exp_next;
    st->flags = 0;
    st->sparse = h->msg_type == INA_MSG_SPARSE_UPDATE;
    st->block = h->block;
    st->next_block = h->next_block;
    return SUMMED;
}

/* model: the mismatch branch of Switch._update. A packet of the round's call whose shape differs from the
 * round's (sparse: Switch._sparse_fits) */
static int mismatch(ina_switch *sw, job_t *j, const packet *p, const slot_set *st)
{
    const header *h = p->h;
    return tell(sw, j, h->rank, p, INA_DROP_MISMATCH, h->slot,
                "codec %u, %u elements, exponent %d; the round has codec %u, %u elements, exponent %d", h->codec,
                h->count, h->exp_cur, st->codec, st->n_elems, st->exp_cur);
}

/* a dense NC packet, or a narrow int32 round's, that completes its round (every other rank in): its values go
 * straight into the result */
static int last_dense(const job_t *j, const header *h, const slot_set *st)
{
    if (h->msg_type != INA_MSG_UPDATE || st->count + 1 != j->world_size)
        return 0;
    return h->codec == INA_CODEC_NC8 ? h->exp_cur != INA_EXP_NONE : h->codec == INA_CODEC_INT32 && st->narrow;
}

/* model: Switch._update, before != 0. A later packet of the round: same round and call, the same shape
 * (sparse: Switch._sparse_fits), its elements added */
static int join_round(ina_switch *sw, job_t *j, const packet *p, slot_set *st, int last)
{
    const header *h = p->h;
    int sparse = h->msg_type == INA_MSG_SPARSE_UPDATE;
    if (h->packet_id != st->round_id || st->complete) /* late retransmission from a worker that moved on */
        return out_of_order(sw, j, p, st->round_id, 0);
    if (h->call != st->call || h->call_kind != st->call_kind || h->call_len != st->call_len)
        return call_mismatch(sw, j, h, st, p->out);
    if (sparse ? !sparse_fits(st, h)
               : (st->sparse || h->codec != st->codec || h->count != st->n_elems || h->exp_cur != st->exp_cur))
        return mismatch(sw, j, p, st);
    /* a sparse round's first elements are written, later ones added; a dense NC round's last packet is added
     * as the round finishes (complete), so its sums never go back to memory */
    int add = last ? ADD_AT_FINISH : !sparse || st->block != INA_BLOCK_NONE;
    if (!values(sw, j, h, p->payload, st, add))
        return bad_codes(sw, j, p);
    if (sparse)
        sparse_add(st, h);
    else if (h->exp_next > st->exp_max)
        st->exp_max = h->exp_next;
    return SUMMED;
}

/* model: Switch._complete. Every rank contributed: the result, computed once, to every member (last: as finish) */
static int complete(ina_switch *sw, job_t *j, const header *h, slot_set *st, ina_out *out, const uint8_t *last)
{
    st->complete = 1;
    finish(sw, st, last);
    (*slot_counter(j, INA_SLOT_MULTICAST, h->slot))++;
    if (j->group) {
        result(sw, j, h, st, INA_NO_RANK, j->group, out);
        return 1;
    }
    for (uint32_t r = 0; r < j->world_size; r++)
        result(sw, j, h, st, (uint8_t)r, j->addresses[r], &out[r]);
    return (int)j->world_size;
}

/* model: Switch._update */
static int on_update(ina_switch *sw, const header *h, const uint8_t *pkt, size_t len, uint64_t src, ina_out *out)
{
    int reason;
    job_t *j = admitted(sw, h, src, &reason);
    if (!j && (reason == INA_DROP_UNKNOWN_WORKER || reason == INA_DROP_WRONG_SESSION))
        return not_member(sw, h, src, reason, out);
    if (!j)
        return drop(sw, reason, NULL, -1);
    const uint8_t *payload = pkt + INA_HEADER_SIZE + (h->msg_type == INA_MSG_SPARSE_UPDATE ? INA_BLOCK_EXT_SIZE : 0);
    const packet p = {h, payload, len, src, out};
    if (h->slot >= j->slots || h->count > j->elements)
        return tell(sw, j, h->rank, &p, INA_DROP_BAD_SLOT, -1, "slot %u with %u elements; the job has %u slots of %u "
                    "elements", h->slot, h->count, j->slots, j->elements);
    (*slot_counter(j, INA_SLOT_RECEIVED, h->slot))++;
    slot_set *st = &j->sets[2 * h->slot + h->set], *other = &j->sets[2 * h->slot + (1 - h->set)];
    uint64_t bit = 1ULL << h->rank;
    if (st->bitmap & bit)
        return duplicate(sw, j, &p, st, other);
    if (j->failed_len) /* no new contribution after a failure; completed rounds still resend */
        return answer_failed(sw, j, h, src, out);
    int last = st->bitmap != 0 && last_dense(j, h, st); /* join_round leaves its values to complete */
    int n = st->bitmap == 0 ? start_round(sw, j, &p, st, other) : join_round(sw, j, &p, st, last);
    if (n != SUMMED)
        return n;
    st->bitmap |= bit;
    other->bitmap &= ~bit;
    if (h->flags & INA_FLAG_CONGESTED) { /* a counted contribution's congestion is the round's */
        st->flags |= INA_FLAG_CONGESTED;
        (*slot_counter(j, INA_SLOT_CONGESTED, h->slot))++;
    }
    return ++st->count < j->world_size ? 0 : complete(sw, j, h, st, out, last ? payload : NULL);
}

int ina_switch_process(ina_switch *sw, const uint8_t *pkt, size_t len, uint64_t src, ina_out *out)
{
    header h;
    int n;
    sw->c.packets_in++;
    if (parse(pkt, len, &h) < 0)
        n = malformed(sw, pkt, len, 0, src, out);
    else if (h.msg_type == INA_MSG_UPDATE || h.msg_type == INA_MSG_SPARSE_UPDATE)
        n = on_update(sw, &h, pkt, len, src, out);
    else if (INA_CONTROL_REQUESTS >> h.msg_type & 1)
        return INA_PUNT; /* the control plane answers (join, leave, abort, heartbeat, stats), and counts its replies */
    else
        n = malformed(sw, pkt, len, 1, src, out); /* results, acks... are never sent to a switch */
    sw->c.packets_out += (uint64_t)n;
    return n;
}

uint64_t ina_switch_replay(ina_switch *sw, const uint8_t *pkts, const uint32_t *lens, const uint64_t *srcs, size_t n)
{
    ina_out out[INA_MAX_OUT];
    uint64_t emitted = 0;
    for (size_t i = 0; i < n; pkts += lens[i], i++) {
        int k = ina_switch_process(sw, pkts, lens[i], srcs[i], out);
        emitted += k > 0 ? (uint64_t)k : 0;
    }
    return emitted;
}
