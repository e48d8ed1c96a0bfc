"""cffi (API mode) builders for the native parts; setup.py runs them at install time.

switchsim._native  the aggregator core and its recvmmsg/sendmmsg UDP loop
hostlib._kernels   NC / fixed-point codec kernels for workers
switchsim._dpdk    the core behind a DPDK poll loop (only where pkg-config finds libdpdk)

INA_CFLAGS replaces the optimisation flags (default -O3 -march=native: the build runs on the machine
that runs it; set INA_CFLAGS=-O3 for a portable build).
"""
import os
import shlex
import subprocess

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.relpath(HERE, os.getcwd()) if os.path.isabs(HERE) else HERE
CFLAGS = shlex.split(os.environ.get("INA_CFLAGS", "-O3 -march=native")) + ["-std=gnu11", "-Wall", "-fno-math-errno"]


def _src(*names):
    return [os.path.join(SRC, n) for n in names]


CORE_CDEF = """
#define INA_MAX_OUT 64
#define INA_PUNT -1
#define INA_HEADER_SIZE 20
#define INA_DROP_COUNT 8
#define INA_SLOT_COUNTERS 4
typedef struct {
    uint64_t dst;
    uint8_t hdr[20];
    const uint8_t *payload;
    uint32_t len;
    uint32_t stable;
} ina_out;
typedef struct { uint64_t packets_in, packets_out, overflows; uint64_t drops[8]; } ina_counters;
typedef struct ina_switch ina_switch;
ina_switch *ina_switch_new(uint32_t slots, uint32_t max_elements, int nc_deterministic, uint64_t seed);
void ina_switch_free(ina_switch *sw);
int ina_switch_add_job(ina_switch *sw, uint32_t job_id, uint32_t world_size);
int ina_switch_process(ina_switch *sw, const uint8_t *pkt, size_t len, uint64_t src, ina_out *out);
void ina_switch_count_out(ina_switch *sw, uint64_t n);
const ina_counters *ina_switch_counters(const ina_switch *sw);
uint32_t ina_switch_jobs(const ina_switch *sw);
void ina_switch_job_info(const ina_switch *sw, uint32_t i, uint32_t *job_id, uint32_t *world_size,
                         uint64_t *generation);
const uint64_t *ina_switch_job_slot_counters(const ina_switch *sw, uint32_t i);
uint32_t ina_switch_slots(const ina_switch *sw);
/* process n packets stored back to back (benchmarks: no interpreter per packet); returns packets emitted */
uint64_t ina_switch_replay(ina_switch *sw, const uint8_t *pkts, const uint32_t *lens, const uint64_t *srcs, size_t n);
"""

UDP_CDEF = """
typedef struct {
    uint64_t bytes_in, bytes_out, send_errors, recv_batches, punts_dropped;
    uint64_t dropped[2], duplicated[2], reordered[2];
} ina_udp_counters;
typedef struct ina_udp ina_udp;
ina_udp *ina_udp_new(ina_switch *sw, int fd, double loss, double dup, double reorder, uint64_t seed);
void ina_udp_free(ina_udp *u);
int ina_udp_run(ina_udp *u);
void ina_udp_stop(ina_udp *u);
const uint8_t *ina_udp_punt(const ina_udp *u, int i, uint32_t *len, uint32_t *ip, uint16_t *port);
void ina_udp_punt_clear(ina_udp *u);
const ina_udp_counters *ina_udp_counters_of(const ina_udp *u);
"""

KERNELS_CDEF = """
#define INA_KERNEL_NONFINITE 1
#define INA_KERNEL_OVERFLOW 2
#define INA_KERNEL_BAD_CODE 3
int ina_nc_encode(const float *x, size_t n, uint8_t *codes, uint64_t seed, uint64_t offset, int deterministic,
                  int floor);
int ina_nc_decode(const uint8_t *codes, size_t n, float *out);
void ina_fixed_quantize(const float *x, size_t n, double scale, int32_t limit, uint8_t *out_be);
"""

DPDK_CDEF = """
typedef struct {
    uint64_t rx_packets, tx_packets, rx_bytes, tx_bytes, tx_full, not_ina, arp_replies, punts_dropped;
    uint64_t dropped[2], duplicated[2], reordered[2]; /* impairments: [0] received side, [1] sent side */
} ina_dpdk_counters;
typedef struct ina_dpdk ina_dpdk;
int ina_dpdk_eal_init(int argc, char **argv);
ina_dpdk *ina_dpdk_new(ina_switch *sw, uint16_t port, uint32_t ip, uint16_t udp_port, double loss, double dup,
                       double reorder, uint64_t seed, char *err, size_t errlen);
int ina_dpdk_run(ina_dpdk *d);
void ina_dpdk_stop(ina_dpdk *d);
const uint8_t *ina_dpdk_punt(const ina_dpdk *d, int i, uint32_t *len, uint64_t *src);
void ina_dpdk_punt_clear(ina_dpdk *d);
int ina_dpdk_send(ina_dpdk *d, uint64_t dst, const uint8_t *pkt, uint32_t len);
const ina_dpdk_counters *ina_dpdk_counters_of(const ina_dpdk *d);
uint16_t ina_dpdk_port_count(void);
void ina_dpdk_mac(ina_dpdk *d, uint8_t *mac);
"""


def _ffi(name, cdef, header_includes, sources, **kw):
    ffi = FFI()
    ffi.cdef(cdef)
    ffi.set_source(name, "\n".join(f'#include "{h}"' for h in header_includes), sources=sources,
                   include_dirs=[SRC], extra_compile_args=CFLAGS + kw.pop("cflags", []), **kw)
    return ffi


core_ffi = _ffi("switchsim._native", CORE_CDEF + UDP_CDEF, ["ina_core.h", "ina_udp.h"],
                _src("ina_core.c", "ina_udp.c"))
kernels_ffi = _ffi("hostlib._kernels", KERNELS_CDEF, ["ina_kernels.h"], _src("ina_kernels.c"),
                   libraries=["m"])


def dpdk_available() -> bool:
    try:
        return subprocess.run(["pkg-config", "--exists", "libdpdk"], check=False).returncode == 0
    except OSError:
        return False


def _pkg_config(*args):
    return shlex.split(subprocess.run(["pkg-config", *args, "libdpdk"], check=True, capture_output=True,
                                      text=True).stdout)


if dpdk_available():
    dpdk_ffi = _ffi("switchsim._dpdk", CORE_CDEF + DPDK_CDEF, ["ina_core.h", "ina_dpdk.h"],
                    _src("ina_core.c", "ina_dpdk.c"), cflags=_pkg_config("--cflags"),
                    extra_link_args=_pkg_config("--libs"))
