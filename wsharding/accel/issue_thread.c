/* The issue thread: a native thread that puts each layer's gather on its streams, so that the
 * Python thread running the model only hands it over. See issue_thread.py for why it exists and
 * what the Python side guarantees; this file only keeps the queue.
 *
 * One producer (the model's thread) pushes entries; one consumer (the thread started here) runs
 * them in push order. An entry is a program -- a short list of driver calls prepared once per layer
 * (stream waits, graph launches, event records) -- plus the gate event of this push. The driver
 * functions are passed in as pointers, so this file needs no CUDA header and no link to libcuda.
 *
 * Nothing here takes the GIL: the consumer never calls into Python, and the producer's calls
 * (ctypes releases the GIL around them) only touch atomics, and a condition variable when the
 * consumer sleeps.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

typedef int (*ctx_set_fn)(void *ctx);
typedef int (*wait_fn)(void *stream, void *event, unsigned flags);
typedef int (*launch_fn)(void *exec, void *stream);
typedef int (*record_fn)(void *event, void *stream);

enum { OP_WAIT = 1, OP_WAIT_GATE = 2, OP_LAUNCH = 3, OP_RECORD = 4 };

/* OP_WAIT: a = stream, b = event; OP_WAIT_GATE: a = stream, the event is the entry's gate (skipped
 * when the gate is NULL); OP_LAUNCH: a = graph exec, b = stream; OP_RECORD: a = event, b = stream. */
typedef struct {
    int32_t kind;
    void *a;
    void *b;
} ws_op;

#define WS_MAX_OPS 8
typedef struct {
    int32_t n;
    ws_op ops[WS_MAX_OPS];
} ws_program;

#define WS_RING 1024
typedef struct {
    const ws_program *program;
    void *gate;
} ws_entry;

typedef struct {
    ctx_set_fn ctx_set;
    void *ctx;
    wait_fn wait;
    launch_fn launch;
    record_fn record;
    double spin_us;
    ws_entry ring[WS_RING];
    _Atomic uint64_t pushed;    /* seq of the last entry pushed (seqs start at 1) */
    _Atomic uint64_t issued;    /* seq of the last entry run (or skipped after an error) */
    _Atomic int32_t error;      /* the first non-zero CUresult; later entries are skipped */
    uint64_t error_seq;
    int32_t error_op;
    const ws_program *error_program;
    _Atomic int32_t stop;
    _Atomic int32_t sleeping;
    _Atomic int32_t exited;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
} ws_issuer;

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

static int run_entry(ws_issuer *q, const ws_entry *e, int32_t *failed_op) {
    const ws_program *p = e->program;
    for (int32_t i = 0; i < p->n; i++) {
        const ws_op *op = &p->ops[i];
        int rc = 0;
        switch (op->kind) {
        case OP_WAIT: rc = q->wait(op->a, op->b, 0); break;
        case OP_WAIT_GATE: rc = e->gate ? q->wait(op->a, e->gate, 0) : 0; break;
        case OP_LAUNCH: rc = q->launch(op->a, op->b); break;
        case OP_RECORD: rc = q->record(op->a, op->b); break;
        default: rc = -1;
        }
        if (rc) {
            *failed_op = i;
            return rc;
        }
    }
    return 0;
}

static void *consume(void *arg) {
    ws_issuer *q = (ws_issuer *)arg;
    if (q->ctx_set) {
        int rc = q->ctx_set(q->ctx);
        if (rc) {
            q->error_seq = 0;
            q->error_op = -1;
            atomic_store(&q->error, rc);
        }
    }
    uint64_t next = 1;
    for (;;) {
        if (next > atomic_load(&q->pushed)) {
            /* Spin a little first: a push that follows soon is issued without a wake-up. */
            double until = now_us() + q->spin_us;
            while (next > atomic_load(&q->pushed) && !atomic_load(&q->stop) && now_us() < until)
                ;
            if (next > atomic_load(&q->pushed)) {
                pthread_mutex_lock(&q->mu);
                atomic_store(&q->sleeping, 1);
                while (next > atomic_load(&q->pushed) && !atomic_load(&q->stop))
                    pthread_cond_wait(&q->cv, &q->mu);
                atomic_store(&q->sleeping, 0);
                pthread_mutex_unlock(&q->mu);
            }
            if (atomic_load(&q->stop)) break; /* entries not yet run stay un-issued */
            continue;
        }
        ws_entry e = q->ring[(next - 1) % WS_RING];
        if (!atomic_load(&q->error) && !atomic_load(&q->stop)) {
            int32_t op = -1;
            int rc = run_entry(q, &e, &op);
            if (rc) {
                q->error_seq = next;
                q->error_op = op;
                q->error_program = e.program;
                atomic_store(&q->error, rc); /* published last: error_seq and error_op are set */
            }
        }
        atomic_store(&q->issued, next);
        next++;
    }
    atomic_store(&q->exited, 1);
    return NULL;
}

ws_issuer *ws_issuer_new(void *ctx_set, void *ctx, void *wait, void *launch, void *record, double spin_us) {
    ws_issuer *q = (ws_issuer *)calloc(1, sizeof(ws_issuer));
    if (!q) return NULL;
    q->ctx_set = (ctx_set_fn)ctx_set;
    q->ctx = ctx;
    q->wait = (wait_fn)wait;
    q->launch = (launch_fn)launch;
    q->record = (record_fn)record;
    q->spin_us = spin_us;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    if (pthread_create(&q->thread, NULL, consume, q)) {
        free(q);
        return NULL;
    }
    return q;
}

/* Hot path (the model's thread): queue one entry, return its seq. Waits only when 1024 entries are
 * queued and not run, which the planner's backpressure (two steps) never reaches. */
uint64_t ws_issuer_push(ws_issuer *q, const ws_program *program, void *gate) {
    uint64_t seq = atomic_load(&q->pushed) + 1;
    while (seq - atomic_load(&q->issued) > WS_RING && !atomic_load(&q->exited))
        sched_yield();
    q->ring[(seq - 1) % WS_RING].program = program;
    q->ring[(seq - 1) % WS_RING].gate = gate;
    atomic_store(&q->pushed, seq);
    if (atomic_load(&q->sleeping)) {
        pthread_mutex_lock(&q->mu);
        pthread_cond_signal(&q->cv);
        pthread_mutex_unlock(&q->mu);
    }
    return seq;
}

/* Wait (spinning, then yielding) until entry `seq` was run or `timeout_us` passed; returns the
 * seq of the last entry run. Called without the GIL (ctypes), so the Python side can poll its
 * watchdog between calls. */
uint64_t ws_issuer_wait(const ws_issuer *q, uint64_t seq, double timeout_us) {
    double until = now_us() + timeout_us;
    uint64_t done;
    int spins = 0;
    while ((done = atomic_load(&q->issued)) < seq && !atomic_load(&q->exited) && now_us() < until) {
        if (++spins > 1000) sched_yield();
    }
    return done;
}

int32_t ws_issuer_error(const ws_issuer *q, uint64_t *seq, int32_t *op, const ws_program **program) {
    int32_t rc = atomic_load(&q->error);
    if (rc) {
        *seq = q->error_seq;
        *op = q->error_op;
        *program = q->error_program;
    }
    return rc;
}

int32_t ws_issuer_exited(const ws_issuer *q) { return atomic_load(&q->exited); }

/* Ask the thread to end after the driver call it is in (entries not yet run are dropped). */
void ws_issuer_stop(ws_issuer *q) {
    pthread_mutex_lock(&q->mu);
    atomic_store(&q->stop, 1);
    pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

/* Free the issuer once its thread exited (ws_issuer_exited); returns 0, or -1 while it runs. */
int32_t ws_issuer_free(ws_issuer *q) {
    if (!atomic_load(&q->exited)) return -1;
    pthread_join(q->thread, NULL);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    free(q);
    return 0;
}

/* The address of the issued counter: the Python side reads it as memory, without a call. */
const _Atomic uint64_t *ws_issuer_issued_ptr(const ws_issuer *q) { return &q->issued; }
const _Atomic uint64_t *ws_issuer_pushed_ptr(const ws_issuer *q) { return &q->pushed; }
const _Atomic int32_t *ws_issuer_error_ptr(const ws_issuer *q) { return &q->error; }
