/* Reading and writing the header of csrc/ina_wire.h, shared by the switch core and the worker loop.
 * Not part of the cffi declarations (static inline). */
#ifndef INA_PACKET_H
#define INA_PACKET_H
#include <stddef.h>
#include <stdint.h>

#include "ina_wire.h"

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static inline uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline void wr16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }
static inline void wr32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}

typedef struct {
    uint8_t msg_type, codec, flags, rank, set;
    int8_t exp_cur, exp_next;
    uint16_t job, slot, count;
    uint32_t packet_id, session;
    uint32_t block, next_block; /* block-sparse messages only */
    uint8_t call_kind;          /* the call's identity (data messages): kind, number, length in elements */
    uint16_t call;
    uint32_t call_len;
    uint32_t boot; /* the switch's boot id (what it sends; a worker echoes its join_ack's) */
} header;

/* a call's identity in a header written by put_header (which leaves it 0) */
static inline void put_call(uint8_t *h, uint8_t call_kind, uint16_t call, uint32_t call_len)
{
    h[INA_OFF_CALL_KIND] = call_kind;
    wr16(h + INA_OFF_CALL, call);
    wr32(h + INA_OFF_CALL_LEN, call_len);
}

static inline void put_boot(uint8_t *h, uint32_t boot) { wr32(h + INA_OFF_BOOT, boot); }

static inline void put_header(uint8_t *h, uint8_t msg_type, uint16_t job, uint8_t rank, uint32_t packet_id,
                              uint16_t slot, uint8_t set, uint16_t count, uint8_t codec, int8_t exp_cur,
                              int8_t exp_next, uint8_t flags, uint32_t session)
{
    h[INA_OFF_VERSION] = INA_VERSION;
    h[INA_OFF_MSG_TYPE] = msg_type;
    h[INA_OFF_CODEC] = codec;
    h[INA_OFF_FLAGS] = flags;
    wr16(h + INA_OFF_JOB, job);
    h[INA_OFF_RANK] = rank;
    h[INA_OFF_EXP_CUR] = (uint8_t)exp_cur;
    wr32(h + INA_OFF_PACKET_ID, packet_id);
    wr16(h + INA_OFF_POOL, (uint16_t)(set << 15 | slot));
    wr16(h + INA_OFF_COUNT, count);
    h[INA_OFF_EXP_NEXT] = (uint8_t)exp_next;
    wr32(h + INA_OFF_SESSION, session);
    put_call(h, 0, 0, 0);
    put_boot(h, 0);
}

/* wire.unpack: 0 if the header is well formed (and an update/result's length matches its count) */
static inline int parse(const uint8_t *p, size_t len, header *h)
{
    if (len < INA_HEADER_SIZE || p[INA_OFF_VERSION] != INA_VERSION || p[INA_OFF_MSG_TYPE] >= INA_MSG_COUNT)
        return -1;
    uint16_t pool = rd16(p + INA_OFF_POOL);
    if (pool & INA_POOL_RESERVED_BIT)
        return -1;
    h->msg_type = p[INA_OFF_MSG_TYPE];
    h->codec = p[INA_OFF_CODEC];
    h->flags = p[INA_OFF_FLAGS];
    h->job = rd16(p + INA_OFF_JOB);
    h->rank = p[INA_OFF_RANK];
    h->exp_cur = (int8_t)p[INA_OFF_EXP_CUR];
    h->packet_id = rd32(p + INA_OFF_PACKET_ID);
    h->slot = pool & INA_POOL_SLOT_MASK;
    h->set = (uint8_t)(pool >> 15);
    h->count = rd16(p + INA_OFF_COUNT);
    h->exp_next = (int8_t)p[INA_OFF_EXP_NEXT];
    h->session = rd32(p + INA_OFF_SESSION);
    h->call_kind = p[INA_OFF_CALL_KIND];
    h->call = rd16(p + INA_OFF_CALL);
    h->call_len = rd32(p + INA_OFF_CALL_LEN);
    h->boot = rd32(p + INA_OFF_BOOT);
    h->block = h->next_block = INA_BLOCK_NONE;
    int sparse = h->msg_type == INA_MSG_SPARSE_UPDATE || h->msg_type == INA_MSG_SPARSE_RESULT;
    if (sparse || h->msg_type == INA_MSG_UPDATE || h->msg_type == INA_MSG_RESULT) {
        size_t size = h->codec == INA_CODEC_INT32 ? 4 : h->codec == INA_CODEC_NC8 ? 1 : 0;
        size_t ext = sparse ? INA_BLOCK_EXT_SIZE : 0;
        if (!size || len != INA_HEADER_SIZE + ext + (size_t)h->count * size)
            return -1;
    }
    if (h->msg_type == INA_MSG_JOIN && len != INA_JOIN_SIZE)
        return -1;
    if (sparse) {
        h->block = rd32(p + INA_HEADER_SIZE);
        h->next_block = rd32(p + INA_HEADER_SIZE + 4);
        if ((h->count == 0) != (h->block == INA_BLOCK_NONE))
            return -1;
        if (h->block != INA_BLOCK_NONE && h->next_block <= h->block)
            return -1;
    }
    return 0;
}

/* wire.nc_floor: lowest NC level usable in a block whose agreed exponent is exp */
static inline int nc_floor(int exp)
{
    int f = exp - INA_NC_SPAN + 1;
    return f > INA_NC_LEVEL_MIN ? f : INA_NC_LEVEL_MIN;
}
#endif
