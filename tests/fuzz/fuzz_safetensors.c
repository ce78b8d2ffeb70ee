/* libFuzzer harness for the safetensors reader: open the input, and when it opens walk every
 * tensor (gdn_st_at, gdn_st_find, gdn_st_metadata) and read each readable one whole as f32 and
 * f64, into a buffer one element short (must be refused), and by rows along dimension 1. Every
 * buffer is allocated at exactly the size the call is told, so AddressSanitizer sees any write
 * past it. A returned error is fine; a crash, hang, leak or sanitizer report is a bug. */
#include "fuzz_common.h"

#include "gdncp.h"

#define CAP_ELEMS ((uint64_t)1 << 22) /* skip tensors (and row slices) above 16 MiB of f32 */

/* a * b * c, or UINT64_MAX when it overflows. */
static uint64_t mul3(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t ab, abc;
    if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc)) return UINT64_MAX;
    return abc;
}

static void read_rows(gdn_st_file *f, const gdn_st_tensor *t, int64_t begin, int64_t count) {
    uint64_t inner = 1;
    for (int i = 2; i < t->ndim; i++)
        if (__builtin_mul_overflow(inner, (uint64_t)t->shape[i], &inner)) return;
    const uint64_t n = mul3((uint64_t)t->shape[0], (uint64_t)count, inner);
    if (n > CAP_ELEMS) return;
    float *dst = malloc(n ? n * sizeof(float) : 1);
    if (!dst) return;
    if (gdn_st_read(f, t->name, GDN_F32, dst, n, 1, begin, count) == GDN_OK && n)
        (void)dst[n - 1];
    free(dst);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_file(data, size);
    if (!path) return 0;
    gdn_st_file *f = NULL;
    if (gdn_st_open(&f, path) != GDN_OK) {
        (void)gdn_errmsg();
        return 0;
    }
    (void)gdn_st_metadata(f, "producer");
    (void)gdn_st_metadata(f, "__metadata__");
    (void)gdn_st_metadata(f, "Hk");
    int count = 0; /* gdn_st_at is NULL from the last tensor on */
    while (gdn_st_at(f, count)) count++;
    if (gdn_st_at(f, -1) || gdn_st_at(f, count) || gdn_st_at(f, count + 1)) abort();
    for (int i = 0; i < count; i++) {
        const gdn_st_tensor *t = gdn_st_at(f, i);
        if (!t || !t->name || !t->dtype_name || t->ndim < 0 || t->ndim > GDN_ST_MAX_DIMS) abort();
        if (gdn_st_find(f, t->name) == NULL) abort();
        (void)gdn_st_metadata(f, t->name);
        const int64_t numel = (t)->numel;
        if (numel < 0 || (uint64_t)numel > CAP_ELEMS) continue;
        const size_t n = (size_t)numel;
        float *a = malloc(n ? n * sizeof(float) : 1);
        double *b = malloc(n ? n * sizeof(double) : 1);
        if (a && b) {
            (void)gdn_st_read(f, t->name, GDN_F32, a, n, 0, 0, -1);
            (void)gdn_st_read(f, t->name, GDN_F64, b, n, 0, 0, -1);
            /* One element short: must be refused without touching memory past n - 1. */
            if (n && t->dtype != GDN_DTYPE_OTHER && gdn_st_read(f, t->name, GDN_F32, a, n - 1, 0, 0, -1) == GDN_OK)
                abort();
        }
        free(a), free(b);
        if (t->ndim >= 2) {
            const int64_t rows = t->shape[1];
            read_rows(f, t, 0, rows);
            if (rows > 0) {
                read_rows(f, t, rows / 2, rows - rows / 2);
                read_rows(f, t, rows - 1, 1);
                read_rows(f, t, 0, 1);
            }
            read_rows(f, t, rows, 1); /* past the end: must be refused */
        } else {
            read_rows(f, t, 0, 1); /* fewer than 2 dims: must be refused */
        }
    }
    (void)gdn_st_read(f, "no such tensor", GDN_F32, NULL, 0, 0, 0, -1);
    gdn_st_close(f);
    return 0;
}
