/* The instruction-set levels (gdncp/isa.h): what the CPU and OS run (CPUID, XGETBV, Linux's AMX
 * permission), what the fp32 kernels were compiled for, and GDNCP_ISA's cap; every run-time
 * dispatch of the library (the BF16 paths) asks gdn_isa_dispatched(). Probed once per process:
 * CPUID traps to the hypervisor in a VM (microseconds), and the small BF16 GEMM asks per call. */
#define _GNU_SOURCE /* syscall */
#include "base.h"

#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

static const char *const level_names[] = {"generic", "avx2", "avx512", "avx512bf16", "amx"};
enum { N_LEVELS = (int)(sizeof level_names / sizeof level_names[0]) };

const char *gdn_isa_name(int level) {
    return level >= 0 && level < N_LEVELS ? level_names[level] : NULL;
}

/* The level the fp32 kernels of this build were compiled for (the compiler's target macros). */
static int compiled_level(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
    return GDN_ISA_AVX512;
#elif defined(__AVX2__) && defined(__FMA__)
    return GDN_ISA_AVX2;
#else
    return GDN_ISA_GENERIC;
#endif
}

#if defined(__x86_64__)
/* The OS saves the state of XCR0's bits `mask` (XGETBV; the CPU must report OSXSAVE first). */
static int os_saves(unsigned mask) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & mask) == mask;
}
#endif

/* The highest level this CPU and OS run. */
static int cpu_level(void) {
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return GDN_ISA_GENERIC;
    const int fma = (c >> 12) & 1;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return GDN_ISA_GENERIC;
    const unsigned ebx7 = b, edx7 = d;
    if (!fma || !((ebx7 >> 5) & 1) || !os_saves(0x6u)) return GDN_ISA_GENERIC; /* AVX2, XMM + YMM state */
    /* AVX-512 F (16), DQ (17), BW (30), VL (31), and the opmask / ZMM state */
    const unsigned avx512 = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);
    if ((ebx7 & avx512) != avx512 || !os_saves(0xe6u)) return GDN_ISA_AVX2;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return GDN_ISA_AVX512; /* AVX512_BF16 */
    /* AMX-BF16 (22) and AMX-TILE (24), XTILECFG and XTILEDATA state, then Linux's per-process
     * permission to use the tile data (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) */
    if (!((edx7 >> 22) & 1) || !((edx7 >> 24) & 1) || !os_saves(3u << 17)) return GDN_ISA_AVX512BF16;
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return GDN_ISA_AVX512BF16;
    return GDN_ISA_AMX;
#else
    return GDN_ISA_GENERIC;
#endif
}

/* The probe's result: the levels, and the refusal's message (empty when GDNCP_ISA is accepted). */
static struct {
    gdn_isa_info info;
    char why[256];
} probe;
static int probed; /* 0 not yet, 1 being probed, 2 done */

static void probe_once(void) {
    int s = __atomic_load_n(&probed, __ATOMIC_ACQUIRE);
    if (s == 2) return;
    int expected = 0;
    if (!__atomic_compare_exchange_n(&probed, &expected, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        while (__atomic_load_n(&probed, __ATOMIC_ACQUIRE) != 2) /* another thread probes */
            ;
        return;
    }
    gdn_isa_info *in = &probe.info;
    in->cpu = cpu_level(), in->compiled = compiled_level(), in->cap = -1;
    const char *env = getenv("GDNCP_ISA");
    if (in->compiled > in->cpu) /* a -march=native build carried to an older CPU (if it got this far) */
        snprintf(probe.why, sizeof probe.why,
                 "this build's fp32 kernels were compiled for %s (-march=native on another machine); this CPU runs "
                 "at most %s: rebuild here, or with -DGDN_PORTABLE=ON",
                 level_names[in->compiled], level_names[in->cpu]);
    else if (env && *env) {
        int cap = -1;
        for (int l = GDN_ISA_AVX2; l < N_LEVELS; l++)
            if (!strcmp(env, level_names[l])) cap = l;
        if (cap < 0)
            snprintf(probe.why, sizeof probe.why, "GDNCP_ISA='%.40s': expected avx2, avx512, avx512bf16 or amx", env);
        else if (cap > in->cpu)
            snprintf(probe.why, sizeof probe.why, "GDNCP_ISA=%s: this CPU (and OS) run at most %s", env,
                     level_names[in->cpu]);
        else if (cap < in->compiled)
            snprintf(probe.why, sizeof probe.why,
                     "GDNCP_ISA=%s: this build's fp32 kernels were compiled for %s (-march=native); a lower cap "
                     "needs a build with -DGDN_PORTABLE=ON",
                     env, level_names[in->compiled]);
        else
            in->cap = cap;
    }
    in->dispatched = probe.why[0] ? in->compiled : in->cap >= 0 ? in->cap : in->cpu;
    __atomic_store_n(&probed, 2, __ATOMIC_RELEASE);
}

int gdn_isa(gdn_isa_info *info) {
    if (!info) return gdn_fail(GDN_ERR_ARG, "gdn_isa: info is NULL");
    probe_once();
    *info = probe.info;
    return probe.why[0] ? gdn_fail(GDN_ERR_ARG, "%s", probe.why) : GDN_OK;
}

int gdn_isa_check(void) {
    gdn_isa_info unused;
    return gdn_isa(&unused);
}

int gdn_isa_dispatched(void) {
    probe_once();
    /* the control of the cap's tests: a path chosen as if GDNCP_ISA were not set */
    if (probe.info.cap >= 0 && gdn_test_mutate("isa: the GDNCP_ISA cap ignored")) return probe.info.cpu;
    return probe.info.dispatched;
}

#if defined(__x86_64__) && !defined(__AVX512F__) && defined(__AVX2__)
/* A portable build (x86-64-v3: AVX2, FMA) loaded on an older CPU: a message and exit code 2
 * before any of its AVX code can run, never an illegal instruction. This function alone is
 * compiled for the baseline x86-64 (nothing it calls uses AVX). */
__attribute__((constructor, target("arch=x86-64"))) static void require_avx2(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return;
    static const char msg[] = "gdncp: this build needs AVX2 and FMA (x86-64-v3: Haswell, Zen 1 or later); "
                              "this CPU lacks them\n";
    if (write(2, msg, sizeof msg - 1) < 0) _exit(2);
    _exit(2);
}
#endif
