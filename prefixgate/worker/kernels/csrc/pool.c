/* The library's thread pool (pg_internal.h: pg_pool_run) and its spin setting. */
#define _GNU_SOURCE
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#else
#define _mm_pause() ((void)0)
#endif
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pg_internal.h"
#include "pg_kernels.h"

/* ---- a small persistent thread pool ------------------------------------------------
   pg_pool_run(fn, arg, nitems, nth) calls fn(arg, i) once for every item i < nitems, on the
   caller and up to nth - 1 pool threads. Items are claimed one at a time with a CAS on
   `claim` = (job generation << 32 | next item), and the caller waits for the number of
   *finished* items, never for a thread to show up: a pool thread that the OS has not
   scheduled (a loaded machine) simply takes no part, and the caller does its items. A
   late thread's CAS fails on the generation, so it never touches a finished job. */
#define MAXT 64
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static int pool_started = 0;
static _Atomic unsigned pool_gen = 0;       /* futex word: bumped per job */
static _Atomic uint64_t pool_claim = 0;     /* gen << 32 | next item */
static _Atomic int pool_done = 0;
static _Atomic int pool_sleepers = 0;
static pg_item_fn pool_fn; static void *pool_arg; static int pool_items;
static long spin_ns = 200000;

static inline long now_ns(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Claim and run items of job `gen` until none is left; returns items run. */
static int pool_work(unsigned gen) {
    int ran = 0;
    for (;;) {
        uint64_t c = atomic_load(&pool_claim);
        if ((unsigned)(c >> 32) != gen || (int)(uint32_t)c >= pool_items) return ran;
        if (!atomic_compare_exchange_weak(&pool_claim, &c, c + 1)) continue;
        pool_fn(pool_arg, (int)(uint32_t)c);
        atomic_fetch_add(&pool_done, 1);
        ran++;
    }
}

static void *pool_main(void *p) {
    (void)p;
    unsigned seen = atomic_load(&pool_gen);
    for (;;) {
        unsigned g;
        long t0 = 0; int i = 0;
        while ((g = atomic_load(&pool_gen)) == seen) {
            if (++i < 64) { _mm_pause(); continue; }
            i = 0;
            long t = now_ns();
            if (!t0) t0 = t;
            if (t - t0 < spin_ns) continue;
            atomic_fetch_add(&pool_sleepers, 1);
            if (atomic_load(&pool_gen) == seen)
                syscall(SYS_futex, &pool_gen, FUTEX_WAIT_PRIVATE, seen, 0, 0, 0);
            atomic_fetch_sub(&pool_sleepers, 1);
            t0 = 0;
        }
        seen = g;
        pool_work(g);
    }
    return 0;
}

void pg_pool_run(pg_item_fn fn, void *arg, int nitems, int nth) {
    if (nitems <= 0) return;
    if (nth > MAXT) nth = MAXT;
    if (nth > nitems) nth = nitems;
    if (nth <= 1) { for (int i = 0; i < nitems; i++) fn(arg, i); return; }
    pthread_mutex_lock(&pool_lock);  /* one job at a time; threads started on demand */
    while (pool_started < nth - 1) {
        pthread_t th;
        if (pthread_create(&th, 0, pool_main, 0)) break;
        pthread_detach(th);
        pool_started++;
    }
    pool_fn = fn; pool_arg = arg; pool_items = nitems;
    atomic_store(&pool_done, 0);
    unsigned gen = atomic_load(&pool_gen) + 1;
    atomic_store(&pool_claim, (uint64_t)gen << 32);
    atomic_store(&pool_gen, gen);
    if (atomic_load(&pool_sleepers))
        syscall(SYS_futex, &pool_gen, FUTEX_WAKE_PRIVATE, nth - 1, 0, 0, 0);
    pool_work(gen);
    int i = 0;
    while (atomic_load(&pool_done) < nitems) {
        if (++i < 4096) _mm_pause(); else { sched_yield(); i = 0; }
    }
    pthread_mutex_unlock(&pool_lock);
}

void pg_set_spin_us(int us) { spin_ns = (long)us * 1000; }
