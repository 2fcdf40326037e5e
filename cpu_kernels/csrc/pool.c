/* A small persistent thread pool for the kernels.
 *
 * Why our own and not OpenMP: torch brings its own OpenMP runtime, and two OpenMP runtimes in
 * one process each keep a team of spinning threads that fight for the same cores. The engine
 * gives the kernels its `threads` and turns torch's pool down to one thread while they run.
 *
 * Work is handed out one item at a time from an atomic counter (items are row tiles), so
 * threads that start late or run slow simply take fewer items, and a worker that another
 * process keeps off its core costs the caller nothing: it does the items itself. After a job,
 * workers spin for a short while (a decode step calls the kernels every few tens of microseconds) and then
 * sleep on a condition variable, so an idle engine costs no CPU.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define MAX_THREADS 256
#define SPIN_NANOSECONDS 2000000L

static struct {
    pthread_mutex_t call_lock; /* one job at a time */
    pthread_mutex_t sleep_lock;
    pthread_cond_t wake;
    pthread_t workers[MAX_THREADS];
    int threads; /* workers + the calling thread */
    atomic_uint_fast64_t generation; /* bumped once per job: what workers wait on */
    atomic_int sleepers;
    atomic_int stop;
    /* The current job. `cursor` packs the job's generation (high 32 bits) with the next
     * unclaimed item (low 32 bits), so a worker that wakes late cannot claim an item of a
     * later job by mistake, and the caller never waits for a worker that is not running: it
     * waits only for the items to be done. */
    pool_fn fn;
    void *ctx;
    int64_t items, chunk; /* items are claimed `chunk` at a time */
    _Alignas(64) atomic_uint_fast64_t cursor; /* own cache lines: both are hit from every core */
    _Alignas(64) atomic_int_fast64_t done_items;
} pool = {
    .call_lock = PTHREAD_MUTEX_INITIALIZER,
    .sleep_lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .threads = 1,
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Claims and runs items of job `job` until none are left or a later job has begun. */
static void take_items(uint32_t job) {
    uint_fast64_t cursor = atomic_load(&pool.cursor);
    for (;;) {
        const int64_t first = (int64_t)(cursor & 0xFFFFFFFFu), items = pool.items;
        if ((uint32_t)(cursor >> 32) != job || first >= items) return;
        const int64_t count = first + pool.chunk <= items ? pool.chunk : items - first;
        if (!atomic_compare_exchange_weak(&pool.cursor, &cursor, cursor + (uint_fast64_t)count)) continue;
        for (int64_t item = first; item < first + count; item++) pool.fn(pool.ctx, item);
        atomic_fetch_add(&pool.done_items, count);
        cursor = atomic_load(&pool.cursor);
    }
}

/* Waits until the generation moves past `seen`; returns 0 when the pool is stopping. */
static int wait_for_job(uint_fast64_t seen) {
    int64_t deadline = now_ns() + SPIN_NANOSECONDS;
    for (int spins = 0; atomic_load(&pool.generation) == seen; spins++) {
        if (atomic_load(&pool.stop)) return 0;
        if ((spins & 255) != 255 || now_ns() < deadline) {
            cpu_relax();
            continue;
        }
        pthread_mutex_lock(&pool.sleep_lock);
        atomic_fetch_add(&pool.sleepers, 1);
        while (atomic_load(&pool.generation) == seen && !atomic_load(&pool.stop)) {
            pthread_cond_wait(&pool.wake, &pool.sleep_lock);
        }
        atomic_fetch_sub(&pool.sleepers, 1);
        pthread_mutex_unlock(&pool.sleep_lock);
    }
    return !atomic_load(&pool.stop);
}

static void *worker_main(void *arg) {
    uint_fast64_t seen = (uint_fast64_t)(uintptr_t)arg;
    while (wait_for_job(seen)) {
        seen = atomic_load(&pool.generation);
        take_items((uint32_t)seen);
    }
    return NULL;
}

static void wake_sleepers(void) {
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.sleep_lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.sleep_lock);
    }
}

static void stop_workers(void) {
    atomic_store(&pool.stop, 1);
    pthread_mutex_lock(&pool.sleep_lock);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.sleep_lock);
    for (int i = 0; i < pool.threads - 1; i++) {
        pthread_join(pool.workers[i], NULL);
    }
    atomic_store(&pool.stop, 0);
    pool.threads = 1;
}

int pool_set_threads(int threads) {
    if (threads < 1 || threads > MAX_THREADS) return -1;
    pthread_mutex_lock(&pool.call_lock);
    int status = 0;
    if (threads != pool.threads) {
        stop_workers();
        uint_fast64_t seen = atomic_load(&pool.generation);
        for (int i = 0; i < threads - 1; i++) {
            if (pthread_create(&pool.workers[i], NULL, worker_main, (void *)(uintptr_t)seen) != 0) {
                status = -2;
                break;
            }
            pool.threads = i + 2;
        }
    }
    pthread_mutex_unlock(&pool.call_lock);
    return status;
}

int pool_threads(void) { return pool.threads; }

void pool_run(pool_fn fn, void *ctx, int64_t items) {
    pthread_mutex_lock(&pool.call_lock);
    if (pool.threads == 1 || items == 1) {
        for (int64_t i = 0; i < items; i++) fn(ctx, i);
        pthread_mutex_unlock(&pool.call_lock);
        return;
    }
    /* Close the previous job before touching its parameters: a worker still in take_items for
     * it may have loaded its cursor and be about to read `items`; with the cursor at the
     * sentinel its claim (a compare-and-swap on the old cursor) fails, so it can never run an
     * item with the next job's fn, ctx or count. */
    const uint_fast64_t previous = atomic_load(&pool.generation);
    atomic_store(&pool.cursor, ((uint_fast64_t)(uint32_t)previous << 32) | 0xFFFFFFFFu);
    atomic_thread_fence(memory_order_seq_cst);
    uint32_t job = (uint32_t)(previous + 1);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.items = items;
    /* About four claims per thread: few enough that claiming costs little, enough to balance. */
    pool.chunk = items / (4 * pool.threads) > 1 ? items / (4 * pool.threads) : 1;
    atomic_store(&pool.done_items, 0);
    atomic_store(&pool.cursor, (uint_fast64_t)job << 32);
    atomic_fetch_add(&pool.generation, 1);
    wake_sleepers();
    take_items(job);
    while (atomic_load(&pool.done_items) < items) {
        cpu_relax();
    }
    pthread_mutex_unlock(&pool.call_lock);
}
