/* The instruction sets gdncp runs on, and the one setting that caps them (GDNCP_ISA).
 *
 * Levels, each including the ones below: GDN_ISA_GENERIC (SSE2 vectors, or no x86), GDN_ISA_AVX2
 * (AVX2 + FMA: Haswell, Zen 1 and later), GDN_ISA_AVX512 (AVX-512 F/BW/VL/DQ), GDN_ISA_AVX512BF16
 * (+ VDPBF16PS), GDN_ISA_AMX (+ AMX-BF16 tiles, with Linux's permission). The fp32 micro-kernels
 * are compiled for one level (the build's: -march=native, or x86-64-v3 = AVX2 with
 * -DGDN_PORTABLE=ON); the BF16 paths (AVX512-BF16, AMX) are chosen at run time from what the CPU
 * and the OS have, up to the cap.
 *
 * The environment variable GDNCP_ISA (read once, at the first call: avx2, avx512, avx512bf16 or
 * amx) caps the dispatched level, so that a machine with more checks the paths of one with less
 * (CI runs a portable build at GDNCP_ISA=avx2 on whatever CPU it has). It is refused, never
 * silently ignored, when it is not one of those names, when it names a level this CPU lacks, and
 * when it is below the level the build's fp32 kernels were compiled for (a -march=native build
 * on an AVX-512 CPU cannot run AVX2 code: build with -DGDN_PORTABLE=ON). A build whose fp32
 * kernels need more than the CPU has (-march=native carried to an older machine) is refused the
 * same way. Every plan creation and the command line check it first; so does the Python package
 * on import. */
#ifndef GDNCP_ISA_H
#define GDNCP_ISA_H

#include "version.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    GDN_ISA_GENERIC = 0,
    GDN_ISA_AVX2 = 1,
    GDN_ISA_AVX512 = 2,
    GDN_ISA_AVX512BF16 = 3,
    GDN_ISA_AMX = 4
} gdn_isa_level;

typedef struct {
    int cpu;        /* the highest level this CPU and OS run */
    int compiled;   /* the level the fp32 kernels were compiled for (the build's floor) */
    int cap;        /* GDNCP_ISA's level; -1 when unset (or refused) */
    int dispatched; /* what runs: the CPU's level, capped (the cap refused: the compiled level) */
} gdn_isa_info;

/* This process's levels into *info (always filled, also on failure); GDN_OK, or GDN_ERR_ARG with
 * a message naming GDNCP_ISA's value and what is wrong with it (unknown name, a level this CPU
 * lacks, below the build's), or the build's level the CPU lacks. GDN_ERR_ARG for a NULL info. */
GDN_API int gdn_isa(gdn_isa_info *info);
/* "generic", "avx2", "avx512", "avx512bf16", "amx" (GDNCP_ISA's names); NULL for another value. */
GDN_API const char *gdn_isa_name(int level);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_ISA_H */
