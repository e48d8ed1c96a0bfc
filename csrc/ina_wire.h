/* The wire format for C. hostlib/wire.py is the definition; tests/test_native.py checks every constant
 * here against it, so the two cannot drift. */
#ifndef INA_WIRE_H
#define INA_WIRE_H

#define INA_VERSION 1
#define INA_DEFAULT_PORT 48864

#define INA_MSG_UPDATE 0
#define INA_MSG_RESULT 1
#define INA_MSG_JOIN 2
#define INA_MSG_JOIN_ACK 3
#define INA_MSG_JOIN_WAIT 4
#define INA_MSG_ERROR 5
#define INA_MSG_STATS_REQ 6
#define INA_MSG_STATS 7
#define INA_MSG_SPARSE_UPDATE 8
#define INA_MSG_SPARSE_RESULT 9
#define INA_MSG_COUNT 10

#define INA_CODEC_NONE 0
#define INA_CODEC_INT32 1
#define INA_CODEC_NC8 2

#define INA_FLAG_OVERFLOW 0x01

#define INA_EXP_NONE (-128)
#define INA_EXP_NONFINITE 127
#define INA_EXP_MIN (-127)
#define INA_EXP_MAX 126

#define INA_NC_BIAS 64
#define INA_NC_LEVEL_MIN (-63)
#define INA_NC_LEVEL_MAX 63
#define INA_NC_SPAN 56
#define INA_MAX_WORKERS 64

#define INA_HEADER_SIZE 20
#define INA_POOL_SET_BIT 0x8000
#define INA_POOL_RESERVED_BIT 0x4000
#define INA_POOL_SLOT_MASK 0x3FFF
#define INA_MAX_SLOTS 16384
#define INA_MAX_ELEMENTS 16384
#define INA_JOIN_PAYLOAD_SIZE 10
#define INA_JOIN_ACK_PAYLOAD_SIZE 8
/* block-sparse messages: u32 block, u32 next block between the header and the elements */
#define INA_BLOCK_EXT_SIZE 8
#define INA_BLOCK_NONE 0xFFFFFFFF

/* header byte offsets (big-endian fields) */
#define INA_OFF_VERSION 0
#define INA_OFF_TYPE 1
#define INA_OFF_CODEC 2
#define INA_OFF_FLAGS 3
#define INA_OFF_JOB 4
#define INA_OFF_RANK 6
#define INA_OFF_EXP_CUR 7
#define INA_OFF_PACKET_ID 8
#define INA_OFF_POOL 12
#define INA_OFF_COUNT 14
#define INA_OFF_EXP_NEXT 16

#endif
