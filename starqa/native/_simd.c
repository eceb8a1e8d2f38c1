/* What the library says about itself (loaded by starqa.native.kernels through ctypes; plain
   C): the SIMD paths its kernels take in this process, and the hash of the sources it was
   built from, which starqa.native.kernels compares with the package's own sources (a
   stale build is refused, with a warning; starqa/native/build.py computes both hashes). */

#include "_kernels.h"
#include "_simd.h"

#ifndef STARQA_SOURCE_HASH
#define STARQA_SOURCE_HASH "unknown" /* built by hand, without build.py's definition */
#endif

int simd_clones_taken;

void starqa_simd_paths(starqa_simd_report *report) {
    report->cap = simd_cap();
#ifdef STARQA_X86
    report->written = has_avx512() ? 2 : has_avx2() ? 1 : 0;
#else
    report->written = 0;
#endif
    report->cloned = SIMD_CLONES_BUILT ? clone_level() : -1;
    report->taken = __atomic_load_n(&simd_clones_taken, __ATOMIC_RELAXED);
}

const char *starqa_source_hash(void) { return STARQA_SOURCE_HASH; }
