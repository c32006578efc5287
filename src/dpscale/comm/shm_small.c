/* The shm transport's one-round all-reduce of a small tensor, in C (see shm_small.py and
 * shm_native.py, which builds this file with the system C compiler at first use).
 *
 * In Python the call's few microseconds of work take ~20 interpreter calls, each costing more
 * than the bytes; here they are one foreign call: copy my tensor into my mailbox of this call's
 * parity, publish the new sequence number, wake a peer that sleeps on me, spin briefly for every
 * peer (or, when the ranks share CPUs, hand the CPU to them for a while: `struct dps_wait`), and
 * sum every rank's mailbox into the tensor in sum_order.py's order. The layout of the
 * control lines and mailboxes and the wake-up protocol are shm_wait.py's and shm_small.py's; a
 * rank on this path and a rank on the Python path interoperate (but for flagged words, which only
 * this path posts: a transport takes it on every rank or on none). If a peer has not arrived within
 * the spin (and the yields), the call returns 1, the Python wait policy (futex sleep, timeout
 * with the rank's name) takes over, and dps_small_sum finishes.
 *
 * A tensor above the control line's slots (24 B) and up to shm_small.LL_MAX_BYTES is posted as
 * flagged words (`ll`, after NCCL's LL protocol): each 8-byte word holds 4 bytes of the tensor and
 * the low 32 bits of the collective's number, stored at once, so a peer's word is valid as soon as
 * it carries this call's number. Peers then wait on the words themselves and fetch all of a
 * mailbox's lines at once, where waiting on the counter fetches the counter's line and only then
 * the mailbox's: 2 ranks, 28-64 B, 0.72 against 0.87-0.90 us a call (BENCHMARKS.md, "Flagged
 * words").
 * The counter is still stored after the words, for sleepers and the Python wait.
 *
 * Built without -ffast-math and with -ffp-contract=off: every addition is one IEEE addition of
 * the same two numbers as numpy's, so the bits equal the Python path's.
 */
#ifdef DPS_PYTHON_MODULE /* built as an extension module: Python.h comes before any other header */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <limits.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define COUNT 0     /* control-line slot: collectives this rank has reached */
#define ASLEEP_ON 8 /* slot (of the second line): 1 + the rank this one sleeps on, 0 if none */
#define FUTEX_WAKE_OP 1
/* How a rank waits for its peers in C, before it hands the wait to the Python policy: one per
 * transport, shared by its plans, written only by this rank (the GIL is held). Field order and
 * types are mirrored by shm_native.Wait. */
struct dps_wait {
    int64_t spin_ns;  /* busy-wait this long for the peers */
    int64_t yield_ns; /* then, if > 0 (the ranks share CPUs), yield the CPU to them this long: a
                         late peer is then often waiting for this very CPU, and a yield hands it
                         over at once where a futex sleep costs a wake-up on its arrival (Open
                         MPI's progress loop yields likewise when oversubscribed) */
    int64_t slow_ns;  /* a yield that gave the CPU away longer ran something else than a peer that
                         only had to arrive (a busy process sharing the CPU, or a peer computing):
                         yielding then costs whole time slices, so the next calls do not yield */
    int64_t backoff_min, backoff_max; /* calls without yields after a first slow yield, and the
                                         most after many in a row */
    int64_t skip;     /* (the helper's) calls left that do not yield */
    int64_t backoff;  /* (the helper's) the next such pause: doubles at each slow yield, halves
                         at each wait that a yield ended */
    int64_t yielded;  /* (the helper's) waits that a yield ended, for tests and probes */
    int64_t slow;     /* (the helper's) slow yields */
};

/* Field order and types are mirrored by shm_native.Plan. */
struct dps_small_plan {
    int64_t **lines;       /* lines[j]: rank j's control line */
    void **boxes;          /* boxes[slot * world + j]: rank j's mailbox `slot` */
    void *tensor;          /* my tensor: posted from, summed into */
    int64_t nbytes;        /* of the tensor */
    const int64_t *bounds; /* nranges x (lo, hi), in elements */
    const int32_t *orders; /* nranges x world: the ranks whose copies are added, in order */
    int32_t nranges;
    int32_t world;
    int32_t rank;
    int32_t dtype; /* 0: float32, 1: float64 */
    int32_t wake;  /* 1: peers may sleep on my counter (the `block` wait) */
    int32_t ll;    /* 1: the mailboxes hold flagged words, 2 x nbytes (a multiple of 4) */
    struct dps_wait *wait; /* how long to wait for the peers before handing the wait back */
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int all_arrived(const struct dps_small_plan *p, int64_t seq) {
    for (int j = 0; j < p->world; j++) {
        if (j != p->rank && __atomic_load_n(&p->lines[j][COUNT], __ATOMIC_ACQUIRE) < seq) {
            return 0;
        }
    }
    return 1;
}

/* Rank j's mailbox `slot` as flagged words (`ll`). */
static inline uint64_t *ll_box(const struct dps_small_plan *p, int slot, int j) {
    return (uint64_t *)p->boxes[(int64_t)slot * p->world + j];
}

/* Whether every peer's words of collective `seq` are there: every word is loaded before any is
 * tested, so the loads of a mailbox's lines overlap (an early exit would fetch them in turn). */
static int ll_arrived(const struct dps_small_plan *p, int64_t seq) {
    const uint32_t flag = (uint32_t)seq;
    const int64_t nwords = p->nbytes / 4;
    for (int j = 0; j < p->world; j++) {
        if (j == p->rank) {
            continue;
        }
        const uint64_t *w = ll_box(p, (int)(seq & 1), j);
        uint32_t stale = 0;
        for (int64_t i = 0; i < nwords; i++) {
            stale |= (uint32_t)(__atomic_load_n(&w[i], __ATOMIC_RELAXED) >> 32) ^ flag;
        }
        if (stale) {
            return 0;
        }
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the sum's reads of the words come after */
    return 1;
}

static inline int arrived(const struct dps_small_plan *p, int64_t seq) {
    return p->ll ? ll_arrived(p, seq) : all_arrived(p, seq);
}

static int spin_for_peers(const struct dps_small_plan *p, int64_t seq) {
    if (arrived(p, seq)) {
        return 1;
    }
    if (p->wait->spin_ns <= 0) {
        return 0;
    }
    int64_t deadline = now_ns() + p->wait->spin_ns;
    for (;;) {
        for (int i = 0; i < 64; i++) { /* the clock only every few dozen checks */
            cpu_relax();
            if (arrived(p, seq)) {
                return 1;
            }
        }
        if (now_ns() > deadline) {
            return 0;
        }
    }
}

static int yield_for_peers(const struct dps_small_plan *p, int64_t seq) {
    struct dps_wait *w = p->wait;
    if (w->yield_ns <= 0) {
        return 0;
    }
    if (w->skip > 0) {
        w->skip--;
        return 0;
    }
    int64_t start = now_ns(), last = start;
    for (;;) {
        sched_yield();
        int64_t t = now_ns();
        int here = arrived(p, seq);
        if (t - last > w->slow_ns) {
            int64_t pause = w->backoff < w->backoff_min ? w->backoff_min : w->backoff;
            w->slow++;
            w->skip = pause;
            w->backoff = 2 * pause < w->backoff_max ? 2 * pause : w->backoff_max;
            return here;
        }
        if (here) {
            w->yielded++;
            w->backoff /= 2;
            return 1;
        }
        if (t - start > w->yield_ns) {
            return 0;
        }
        last = t;
    }
}

#define SUM_RANGES(T)                                                                          \
    do {                                                                                       \
        T *out = (T *)p->tensor;                                                               \
        for (int r = 0; r < p->nranges; r++) {                                                 \
            int64_t lo = p->bounds[2 * r], hi = p->bounds[2 * r + 1];                          \
            const int32_t *order = p->orders + (int64_t)r * p->world;                          \
            const T *a = (const T *)boxes[order[0]];                                           \
            const T *b = (const T *)boxes[order[1]];                                           \
            for (int64_t i = lo; i < hi; i++) {                                                \
                out[i] = a[i] + b[i];                                                          \
            }                                                                                  \
            for (int k = 2; k < p->world; k++) {                                               \
                const T *c = (const T *)boxes[order[k]];                                       \
                for (int64_t i = lo; i < hi; i++) {                                            \
                    out[i] = out[i] + c[i];                                                    \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    } while (0)

/* The 4-byte pieces of flagged words, as the tensor's elements: a float32 is one word's, a
 * float64 two words' (little-endian: the low half first). */
static inline float ll_float(const uint64_t *w, int64_t i) {
    uint32_t bits = (uint32_t)w[i];
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline double ll_double(const uint64_t *w, int64_t i) {
    uint64_t bits = (uint64_t)(uint32_t)w[2 * i] | (uint64_t)(uint32_t)w[2 * i + 1] << 32;
    double x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* SUM_RANGES over flagged words: the same additions in the same order, element by element. */
#define LL_SUM_RANGES(T, GET)                                                                  \
    do {                                                                                       \
        T *out = (T *)p->tensor;                                                               \
        for (int r = 0; r < p->nranges; r++) {                                                 \
            int64_t lo = p->bounds[2 * r], hi = p->bounds[2 * r + 1];                          \
            const int32_t *order = p->orders + (int64_t)r * p->world;                          \
            for (int64_t i = lo; i < hi; i++) {                                                \
                T acc = GET(ll_box(p, slot, order[0]), i) + GET(ll_box(p, slot, order[1]), i); \
                for (int k = 2; k < p->world; k++) {                                           \
                    acc = acc + GET(ll_box(p, slot, order[k]), i);                             \
                }                                                                              \
                out[i] = acc;                                                                  \
            }                                                                                  \
        }                                                                                      \
    } while (0)

/* Every rank's mailbox `slot` (0 or 1), summed into my tensor. (-O3 vectorizes the loops with
 * the x86-64 baseline's SSE2, 1.5-2x faster than -O2's scalar adds here; AVX2 clones gained ~5%:
 * the peers' mailboxes come from another core's cache, not from the adds.) */
void dps_small_sum(const struct dps_small_plan *p, int slot) {
    void *const *boxes = p->boxes + (int64_t)slot * p->world;
    if (p->ll) {
        if (p->dtype == 0) {
            LL_SUM_RANGES(float, ll_float);
        } else {
            LL_SUM_RANGES(double, ll_double);
        }
    } else if (p->dtype == 0) {
        SUM_RANGES(float);
    } else {
        SUM_RANGES(double);
    }
}

/* Wait for every peer to reach collective `seq` as dps_small_all_reduce waits (spin, or yields
 * where the ranks share CPUs): 0 when they have, else 1 (the caller's Python policy then waits).
 * The plan's tensor is not touched. The in-place path's barriers wait through this. */
int dps_wait_all(const struct dps_small_plan *p, int64_t seq) {
    return spin_for_peers(p, seq) || yield_for_peers(p, seq) ? 0 : 1;
}

/* Post my tensor, arrive, and sum if every peer arrives within the wait: 0 when done, else 1
 * (then the caller waits for every peer to reach my counter's value, seq, and calls
 * dps_small_sum(p, seq & 1)). */
int dps_small_all_reduce(const struct dps_small_plan *p) {
    int64_t *mine = p->lines[p->rank];
    int64_t seq = mine[COUNT] + 1; /* only this rank writes its counter */
    if (p->ll) {
        uint64_t *w = ll_box(p, (int)(seq & 1), p->rank);
        const uint64_t flag = (uint64_t)(uint32_t)seq << 32;
        const char *src = (const char *)p->tensor;
        for (int64_t i = 0; i < p->nbytes / 4; i++) {
            uint32_t piece;
            memcpy(&piece, src + 4 * i, sizeof piece);
            __atomic_store_n(&w[i], flag | piece, __ATOMIC_RELAXED);
        }
    } else {
        memcpy(p->boxes[(seq & 1) * p->world + p->rank], p->tensor, (size_t)p->nbytes);
    }
    __atomic_store_n(&mine[COUNT], seq, __ATOMIC_RELEASE);
    if (p->wake) {
        /* a full fence between "store my counter" and "read who sleeps on me", against the
         * sleeper's "store that I sleep" then "read the counter" (shm_wait.py): no lost wake-up */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        for (int j = 0; j < p->world; j++) {
            if (j != p->rank && __atomic_load_n(&p->lines[j][ASLEEP_ON], __ATOMIC_RELAXED) == p->rank + 1) {
                syscall(SYS_futex, &mine[COUNT], FUTEX_WAKE_OP, INT_MAX, NULL, NULL, 0);
                break;
            }
        }
    }
    if (!spin_for_peers(p, seq) && !yield_for_peers(p, seq)) {
        return 1;
    }
    dps_small_sum(p, (int)(seq & 1));
    return 0;
}

#ifdef DPS_PYTHON_MODULE
/* The same two calls as functions of a CPython extension module, the plan passed by its address
 * (an int): a METH_O call costs ~20 ns where a ctypes call costs ~90, at 4 B about a tenth of the
 * whole all-reduce. The GIL stays held, as under ctypes.PyDLL. */
static PyObject *py_all_reduce(PyObject *self, PyObject *address) {
    const struct dps_small_plan *p = PyLong_AsVoidPtr(address);
    if (p == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "null plan");
        }
        return NULL;
    }
    return PyLong_FromLong(dps_small_all_reduce(p));
}

static PyObject *py_sum(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "sum(plan_address, slot)");
        return NULL;
    }
    const struct dps_small_plan *p = PyLong_AsVoidPtr(args[0]);
    long slot = PyLong_AsLong(args[1]);
    if (p == NULL || (slot != 0 && slot != 1)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "sum: a plan and a slot of 0 or 1");
        }
        return NULL;
    }
    dps_small_sum(p, (int)slot);
    Py_RETURN_NONE;
}

static PyObject *py_wait_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "wait_all(plan_address, seq)");
        return NULL;
    }
    const struct dps_small_plan *p = PyLong_AsVoidPtr(args[0]);
    long long seq = PyLong_AsLongLong(args[1]);
    if (p == NULL || PyErr_Occurred()) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "wait_all: null plan");
        }
        return NULL;
    }
    return PyLong_FromLong(dps_wait_all(p, (int64_t)seq));
}

static PyMethodDef dps_methods[] = {
    {"all_reduce", py_all_reduce, METH_O, "dps_small_all_reduce(plan): 0 when done, else 1"},
    {"sum", (PyCFunction)(void (*)(void))py_sum, METH_FASTCALL, "dps_small_sum(plan, slot)"},
    {"wait_all", (PyCFunction)(void (*)(void))py_wait_all, METH_FASTCALL, "dps_wait_all(plan, seq): 0 when every peer reached seq, else 1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef dps_module = {PyModuleDef_HEAD_INIT, "_dps_shm_small", NULL, -1, dps_methods};

PyMODINIT_FUNC PyInit__dps_shm_small(void) { return PyModule_Create(&dps_module); }
#endif
