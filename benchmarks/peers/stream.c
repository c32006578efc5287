/* STREAM-style memory bandwidth: copy (c = a) and add (c = a + b) over float32 arrays far larger
 * than the caches, with the OpenMP threads given by OMP_NUM_THREADS.
 *
 *     gcc -O2 -fopenmp -o stream stream.c && OMP_NUM_THREADS=2 ./stream [MiB per array] [reps]
 *
 * Prints one JSON line. Bytes are counted as STREAM counts them (copy: 8 per element, one read and
 * one write; add: 12), so the write-allocate read a cache fills before a store is in the time but
 * not in the bytes. Each kernel's figure is its best repetition (STREAM's convention). Written for
 * dpscale's benchmarks/peers (allreduce_peers.py builds and runs it). */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 512;
    int reps = argc > 2 ? atoi(argv[2]) : 10;
    size_t n = mib * (1u << 20) / sizeof(float);
    float *a = aligned_alloc(64, n * sizeof(float));
    float *b = aligned_alloc(64, n * sizeof(float));
    float *c = aligned_alloc(64, n * sizeof(float));
    if (!a || !b || !c || reps < 1) {
        fprintf(stderr, "stream: cannot allocate 3 x %zu MiB (or reps < 1)\n", mib);
        return 2;
    }
    /* first touch by the same threads that run the kernels (pages land where they are used) */
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        a[i] = 1.0f;
        b[i] = 2.0f;
        c[i] = 0.0f;
    }
    double best_copy = 1e30, best_add = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) c[i] = a[i];
        double t1 = now_s();
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) c[i] = a[i] + b[i];
        double t2 = now_s();
        if (t1 - t0 < best_copy) best_copy = t1 - t0;
        if (t2 - t1 < best_add) best_add = t2 - t1;
    }
    double check = c[n / 2] + c[n - 1]; /* keeps the stores live: 3 + 3 */
    printf("{\"threads\": %d, \"mib_per_array\": %zu, \"reps\": %d, \"copy_GBps\": %.3f, "
           "\"add_GBps\": %.3f, \"check\": %.1f}\n",
           omp_get_max_threads(), mib, reps, 8.0 * n / best_copy / 1e9, 12.0 * n / best_add / 1e9, check);
    free(a);
    free(b);
    free(c);
    return check == 6.0 ? 0 : 1;
}
