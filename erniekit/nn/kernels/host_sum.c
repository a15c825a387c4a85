/* A float32 sum over the ranks of one host through a shared mapping
 * (erniekit/distributed/collective/host_sum.py).
 *
 * The mapping holds a header of per-rank flags (one 64-byte line each) and one slot of `cap` floats
 * per rank. Each rank has written its values into its own slot before the call; the call then
 *   1. publishes "written" (release) and waits until every rank has written (acquire);
 *   2. sums its own chunk of the elements over the slots in rank order (the same additions on every
 *      rank, so every rank ends with the same bits) and writes that sum into every rank's slot;
 *   3. publishes "summed" and waits until every rank has summed: every slot then holds the whole sum.
 * Chunks are disjoint, so no element is written by two ranks or read while written. A rank's next
 * call cannot overwrite its slot before the others are past step 2 of this one: they publish this
 * call's "summed" only after reading. Build with -ffp-contract=off (plain additions).
 */
#include <sched.h>
#include <stdint.h>
#include <time.h>

#define LINE 8     /* int64 flags per 64-byte line */
#define BLOCK 1024 /* floats summed at a time, in L1 */
#define SPIN_S 0.005

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* 0 once flags[r * LINE] >= seq for every rank r < ranks, 1 after timeout_s seconds. Spins for the
 * first SPIN_S (a step's skew between ranks is ~1 ms), then sleeps 50 us between looks, so a rank
 * waiting out another's checkpoint or evaluation does not hold a core the other may need. */
static int64_t wait_all(int64_t *flags, int64_t ranks, int64_t seq, double timeout_s) {
    const struct timespec nap = {0, 50000};
    double start = now_s();
    int sleeping = 0;
    for (int64_t spins = 0;; spins++) {
        int64_t r = 0;
        while (r < ranks && __atomic_load_n(&flags[r * LINE], __ATOMIC_ACQUIRE) >= seq) r++;
        if (r == ranks) return 0;
        if ((spins & 255) == 255) {
            double waited = now_s() - start;
            if (waited > timeout_s) return 1;
            sleeping = waited > SPIN_S;
        }
        if (sleeping) nanosleep(&nap, NULL);
        else sched_yield(); /* gives the core away only when something else wants it */
    }
}

/* header: `written` flags for ranks at line r (the call's n beside it), `summed` flags at line
 * ranks + r; slots follow at `slots` (float32, cap each). n <= cap elements are summed. Returns 0,
 * 1 on a timeout, 2 when the ranks asked for different sizes (every rank sees it; nothing summed). */
int64_t erniekit_host_sum(int64_t *header, float *slots, int64_t rank, int64_t ranks, int64_t cap, int64_t n,
                          int64_t seq, double timeout_s) {
    int64_t *written = header, *summed = header + ranks * LINE;
    __atomic_store_n(&written[rank * LINE + 1], n, __ATOMIC_RELAXED); /* published by the release below */
    __atomic_store_n(&written[rank * LINE], seq, __ATOMIC_RELEASE);
    if (wait_all(written, ranks, seq, timeout_s)) return 1;
    for (int64_t r = 0; r < ranks; r++)
        if (__atomic_load_n(&written[r * LINE + 1], __ATOMIC_RELAXED) != n) return 2;
    /* chunks of whole 64-byte lines: no two ranks write the same cache line */
    int64_t lines = (n + 15) / 16;
    int64_t lo = lines * rank / ranks * 16, hi = lines * (rank + 1) / ranks * 16;
    if (hi > n) hi = n;
    if (lo > n) lo = n;
    float acc[BLOCK];
    for (int64_t b = lo; b < hi; b += BLOCK) {
        int64_t len = hi - b < BLOCK ? hi - b : BLOCK;
        for (int64_t i = 0; i < len; i++) acc[i] = slots[b + i];
        for (int64_t r = 1; r < ranks; r++) {
            const float *src = slots + r * cap + b;
            for (int64_t i = 0; i < len; i++) acc[i] = acc[i] + src[i];
        }
        for (int64_t r = 0; r < ranks; r++) {
            float *dst = slots + r * cap + b;
            for (int64_t i = 0; i < len; i++) dst[i] = acc[i];
        }
    }
    __atomic_store_n(&summed[rank * LINE], seq, __ATOMIC_RELEASE);
    return wait_all(summed, ranks, seq, timeout_s);
}
