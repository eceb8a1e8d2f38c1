/* How fast this machine reads memory in scattered pieces, as the top-k kernel's scan reads
   ivf lists (~5 KB each at 32K: 39 keys of 64 bf16 dimensions), against one long stream, as
   exact attention reads a shard. Two threads each read their share of 200 MB of pieces at
   random places in a 512 MB buffer, the next piece prefetched ahead (0: none):

       gcc -O2 -mavx2 -fopenmp benchmarks/scattered_read.c -o /tmp/scattered_read
       /tmp/scattered_read 5120 1      # pieces of 5 KB, one prefetched ahead
       /tmp/scattered_read 1048576 0   # 1 MB pieces: a stream on each thread

   Prints GB/s for three trials. */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s PIECE_BYTES PIECES_AHEAD (e.g. 5120 1)\n", argv[0]);
        return 2;
    }
    const size_t total = (size_t)1 << 29, piece = strtoull(argv[1], NULL, 10);
    const size_t ahead = strtoull(argv[2], NULL, 10);
    if (piece < 32 || piece % 32 || piece > total) {
        fprintf(stderr, "PIECE_BYTES must be a multiple of 32 between 32 and %zu\n", total);
        return 2;
    }
    char *buffer = aligned_alloc(4096, total);
    if (!buffer) return 1;
    for (size_t i = 0; i < total; i += 64) buffer[i] = (char)i; /* every page touched */
    const size_t pieces = total / piece, count = ((size_t)200 << 20) / piece;
    uint64_t *order = malloc(count * sizeof(uint64_t));
    srand(1);
    for (size_t i = 0; i < count; i++) order[i] = ((uint64_t)rand() * 7919u) % pieces;
    for (int trial = 0; trial < 3; trial++) {
        float sums[2][8];
        const double started = now();
#pragma omp parallel num_threads(2)
        {
            __m256 acc = _mm256_setzero_ps();
#pragma omp for schedule(static)
            for (size_t i = 0; i < count; i++) {
                if (ahead && i + ahead < count)
                    for (size_t y = 0; y < piece; y += 64)
                        __builtin_prefetch(buffer + order[i + ahead] * piece + y, 0, 3);
                const char *at = buffer + order[i] * piece;
                for (size_t y = 0; y < piece; y += 32)
                    acc = _mm256_add_ps(acc, _mm256_castsi256_ps(
                                                 _mm256_load_si256((const __m256i *)(at + y))));
            }
            _mm256_storeu_ps(sums[omp_get_thread_num()], acc);
        }
        const double seconds = now() - started;
        printf("pieces of %zu bytes, %zu ahead: %.2f GB/s (%g)\n", piece, ahead,
               count * piece / seconds / 1e9, (double)sums[0][0]);
    }
    free(order);
    free(buffer);
    return 0;
}
