/* How every loop that sleeps waits (the worker's and the switch's, on UDP sockets and on shared-memory rings):
 * a few yields, each followed by a look, before the sleep.
 *
 * Why: where the ranks and the switch share a few cores, a datagram or ring record for a loop asleep is a wakeup
 * (an IPI and two context switches; a VM exit in a VM): about 1800 in a 64 MiB int32 call of 4 ranks on 2 cores,
 * and up to a third of a 1 KiB call's time. A loop that yields first lets the others on its core run, and finds
 * their packets at its next look without being woken. On an idle core a yield returns at once: a few
 * microseconds of looking before the sleep. docs/performance.md, "Yield, then sleep". Header-only. */
#ifndef INA_WAIT_H
#define INA_WAIT_H
#include <sched.h>

#define INA_WAIT_YIELDS 32

/* 1 after a yield (*yields counted: look again, then call again), 0 when the loop should sleep now (*yields
 * reset: its next wait yields again) */
static inline int ina_wait_yield(int *yields)
{
    if (*yields >= INA_WAIT_YIELDS) {
        *yields = 0;
        return 0;
    }
    ++*yields;
    sched_yield();
    return 1;
}
#endif
