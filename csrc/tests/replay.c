/* Replays a packet trace through the core and writes what it emits, for tests/test_native.py, which
 * builds this with AddressSanitizer and compares the output with the reference model's.
 * in:  u32 slots, u32 max_elements, u32 deterministic, u64 seed, u32 jobs, jobs x (u32 id, u32 world),
 *      then records (little-endian framing): u8 0, u32 len, u64 src, bytes (a packet), or
 *      u8 1, u32 job, u64 generation, u32 session, u32 first id, u32 n, n x u64 address (what the control
 *      plane admitted), or u8 2, u32 job, u8 code, u8 rank, u32 len, text (a generation the control plane
 *      failed; its errors are the control plane's, not written), or u8 3, u32 boot (the switch's boot id),
 *      or u8 4, u32 job, u32 world, u32 slots (a job a shared switch added), or u8 5, u32 job (one it removed)
 * out: per emitted packet: u32 index of the packet that caused it, u64 dst, u32 len, bytes
 * It also runs the codec kernels over odd-sized buffers so the sanitizer sees their loops. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ina_core.h"
#include "ina_kernels.h"

static int rd(FILE *f, void *p, size_t n) { return fread(p, 1, n, f) == n; }

/* a record of kind 4 (add a job) or 5 (remove one): applied to the core; 0, or nonzero for a bad one */
static int job_record(FILE *in, ina_switch *sw, uint8_t kind)
{
    uint32_t job, world, slots;
    if (kind == 5)
        return !rd(in, &job, 4) || ina_switch_remove_job(sw, job);
    return !rd(in, &job, 4) || !rd(in, &world, 4) || !rd(in, &slots, 4) || ina_switch_add_job(sw, job, world, slots);
}

/* a record of kind 1 (admit), 2 (fail), 3 (boot), 4 or 5 (jobs): applied to the core; 0, or nonzero for a
 * bad one */
static int control_record(FILE *in, ina_switch *sw, uint8_t kind)
{
    static ina_out o[INA_MAX_OUT];
    uint32_t job, session, first, n;
    uint64_t gen, addrs[INA_MAX_WORKERS];
    if (kind == 4 || kind == 5)
        return job_record(in, sw, kind);
    if (kind == 3) {
        uint32_t boot;
        if (!rd(in, &boot, 4))
            return 1;
        ina_switch_set_boot(sw, boot);
        return 0;
    }
    if (kind == 2) {
        uint8_t code, rank;
        char text[1024];
        return !rd(in, &job, 4) || !rd(in, &code, 1) || !rd(in, &rank, 1) || !rd(in, &n, 4) || n > sizeof text ||
               !rd(in, text, n) || ina_switch_fail(sw, job, code, rank, text, n, o) < 0;
    }
    return !rd(in, &job, 4) || !rd(in, &gen, 8) || !rd(in, &session, 4) || !rd(in, &first, 4) || !rd(in, &n, 4) ||
           n > INA_MAX_WORKERS || !rd(in, addrs, 8 * n) || ina_switch_admit(sw, job, gen, session, first, addrs, 0, 0);
}

static int kernels(void)
{
    for (size_t n = 0; n < 300; n += 37) {
        float *x = malloc((n + 1) * sizeof *x), *y = malloc((n + 1) * sizeof *y);
        uint8_t *codes = malloc(n + 1), *be = malloc(4 * n + 1);
        for (size_t i = 0; i < n; i++)
            x[i] = (float)((double)(i * 2654435761u % 1000) - 500.0) * 1e-3f;
        if (ina_nc_encode(x, n, codes, 1, 2, 0, -20) != 0 || ina_nc_decode(codes, n, y) != 0)
            return 1;
        ina_fixed_quantize(x, n, 1e6, 1 << 30, be);
        free(x), free(y), free(codes), free(be);
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (!in || !out)
        return 2;
    uint32_t slots, k, det, jobs;
    uint64_t seed;
    if (!rd(in, &slots, 4) || !rd(in, &k, 4) || !rd(in, &det, 4) || !rd(in, &seed, 8) || !rd(in, &jobs, 4))
        return 2;
    ina_switch *sw = ina_switch_new(slots, k, (int)det, seed);
    if (!sw)
        return 3;
    for (uint32_t i = 0; i < jobs; i++) {
        uint32_t id, world;
        if (!rd(in, &id, 4) || !rd(in, &world, 4) || ina_switch_add_job(sw, id, world, 0) != 0)
            return 3;
    }
    static ina_out o[INA_MAX_OUT];
    uint32_t len;
    uint64_t src;
    uint8_t kind;
    for (uint32_t index = 0; rd(in, &kind, 1); ) {
        if (kind != 0) {
            if (control_record(in, sw, kind))
                return 2;
            continue;
        }
        if (!rd(in, &len, 4) || !rd(in, &src, 8))
            return 2;
        uint8_t *pkt = malloc(len ? len : 1); /* exact size: a read past the end is a sanitizer report */
        if (!rd(in, pkt, len))
            return 2;
        int n = ina_switch_process(sw, pkt, len, src, o);
        for (int i = 0; i < n; i++) {
            uint32_t total = INA_HEADER_SIZE + o[i].len;
            fwrite(&index, 4, 1, out);
            fwrite(&o[i].dst, 8, 1, out);
            fwrite(&total, 4, 1, out);
            fwrite(o[i].hdr, 1, INA_HEADER_SIZE, out);
            fwrite(o[i].payload, 1, o[i].len, out);
        }
        free(pkt);
        index++;
    }
    ina_switch_free(sw);
    fclose(in);
    fclose(out);
    return kernels();
}
