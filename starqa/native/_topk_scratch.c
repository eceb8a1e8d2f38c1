/* The top-k kernel's scratch memory, kept by each thread between calls (_topk.h says why). */

#include <stdlib.h>

#include "_topk.h"

static __thread struct { void *p; size_t size; } scratch[SLOTS];

void *scratch_get(int slot, size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    if (scratch[slot].size < bytes) {
        free(scratch[slot].p);
        scratch[slot].p = aligned_alloc(64, bytes);
        scratch[slot].size = scratch[slot].p ? bytes : 0;
    }
    return scratch[slot].p;
}

void scratch_drop(int slot) {
    free(scratch[slot].p);
    scratch[slot].p = NULL;
    scratch[slot].size = 0;
}
