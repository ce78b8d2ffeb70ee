/* safetensors reading and writing. Format: 8-byte little-endian header length N, N bytes of
 * JSON {name: {dtype, shape, data_offsets:[begin,end]}, "__metadata__": {str: str}}, then the
 * data section. Every header field is validated before any tensor is read: a truncated or
 * hostile file yields GDN_ERR_FORMAT with a message, never a crash. JSON parsing: jansson. */
#include "base.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gdncp's safetensors I/O assumes a little-endian host"
#endif

#define MAX_HEADER_BYTES (100u << 20)

struct gdn_st_file {
    FILE *fp;
    char *path;
    uint64_t data_start, data_size;
    int count;
    gdn_st_tensor *tensors;
    json_t *root; /* owns the name and metadata strings */
};

static const struct { const char *name; int size; gdn_dtype dt; } dtype_table[] = {
    {"F32", 4, GDN_F32}, {"F64", 8, GDN_F64}, {"BF16", 2, GDN_BF16},
    {"F16", 2, GDN_DTYPE_OTHER}, {"I8", 1, GDN_DTYPE_OTHER}, {"U8", 1, GDN_DTYPE_OTHER},
    {"BOOL", 1, GDN_DTYPE_OTHER}, {"I16", 2, GDN_DTYPE_OTHER}, {"U16", 2, GDN_DTYPE_OTHER},
    {"I32", 4, GDN_DTYPE_OTHER}, {"U32", 4, GDN_DTYPE_OTHER}, {"I64", 8, GDN_DTYPE_OTHER},
    {"U64", 8, GDN_DTYPE_OTHER}, {"F8_E4M3", 1, GDN_DTYPE_OTHER}, {"F8_E5M2", 1, GDN_DTYPE_OTHER}};

static int dtype_size(gdn_dtype dt) { return dt == GDN_F32 ? 4 : dt == GDN_F64 ? 8 : 2; }


static int parse_tensor(gdn_st_file *f, const char *name, json_t *val, gdn_st_tensor *t) {
    const char *path = f->path;
    if (!json_is_object(val))
        return gdn_fail(GDN_ERR_FORMAT, "%s: header entry '%s' is not an object", path, name);
    json_t *dt = json_object_get(val, "dtype"), *shape = json_object_get(val, "shape"),
           *off = json_object_get(val, "data_offsets");
    if (!json_is_string(dt))
        return gdn_fail(GDN_ERR_FORMAT, "%s: tensor '%s' has no string 'dtype'", path, name);
    int esize = 0;
    t->name = name;
    t->dtype_name = json_string_value(dt);
    for (size_t i = 0; i < sizeof dtype_table / sizeof dtype_table[0]; i++)
        if (!strcmp(dtype_table[i].name, t->dtype_name))
            esize = dtype_table[i].size, t->dtype = dtype_table[i].dt;
    if (!esize)
        return gdn_fail(GDN_ERR_FORMAT, "%s: tensor '%s' has unknown dtype '%s'", path, name,
                        t->dtype_name);
    if (!json_is_array(shape))
        return gdn_fail(GDN_ERR_FORMAT, "%s: tensor '%s' has no 'shape' array", path, name);
    if (json_array_size(shape) > GDN_ST_MAX_DIMS)
        return gdn_fail(GDN_ERR_FORMAT, "%s: tensor '%s' has %zu dims (max %d)", path, name,
                        json_array_size(shape), GDN_ST_MAX_DIMS);
    t->ndim = (int)json_array_size(shape);
    uint64_t numel = 1;
    for (int i = 0; i < t->ndim; i++) {
        json_t *d = json_array_get(shape, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0)
            return gdn_fail(GDN_ERR_FORMAT, "%s: tensor '%s' shape[%d] is not a non-negative integer",
                            path, name, i);
        t->shape[i] = json_integer_value(d);
        if (t->shape[i] != 0 && numel > (UINT64_MAX / 16) / (uint64_t)t->shape[i])
            return gdn_fail(GDN_ERR_FORMAT, "%s: tensor '%s' shape overflows", path, name);
        numel *= (uint64_t)t->shape[i];
    }
    t->numel = (int64_t)numel;
    if (!json_is_array(off) || json_array_size(off) != 2 ||
        !json_is_integer(json_array_get(off, 0)) || !json_is_integer(json_array_get(off, 1)))
        return gdn_fail(GDN_ERR_FORMAT, "%s: tensor '%s' needs 'data_offsets' [begin, end]", path,
                        name);
    json_int_t b = json_integer_value(json_array_get(off, 0)),
               e = json_integer_value(json_array_get(off, 1));
    if (b < 0 || e < b)
        return gdn_fail(GDN_ERR_FORMAT, "%s: tensor '%s' has invalid data_offsets [%lld, %lld]",
                        path, name, (long long)b, (long long)e);
    t->begin = (uint64_t)b, t->end = (uint64_t)e;
    if (t->end - t->begin != numel * (uint64_t)esize)
        return gdn_fail(GDN_ERR_FORMAT,
                        "%s: tensor '%s' data_offsets span %llu bytes but shape x dtype needs %llu",
                        path, name, (unsigned long long)(t->end - t->begin),
                        (unsigned long long)(numel * esize));
    if (t->end > f->data_size)
        return gdn_fail(GDN_ERR_FORMAT,
                        "%s: tensor '%s' ends at byte %llu past the data section (%llu bytes): "
                        "truncated file?",
                        path, name, (unsigned long long)t->end, (unsigned long long)f->data_size);
    return GDN_OK;
}

/* Order by begin, then end: at the same offset an empty tensor comes before a non-empty one. */
static int by_begin(const void *a, const void *b) {
    const gdn_st_tensor *x = *(gdn_st_tensor *const *)a, *y = *(gdn_st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static int parse_header(gdn_st_file *f, const char *text, size_t n) {
    json_error_t err;
    f->root = json_loadb(text, n, JSON_REJECT_DUPLICATES, &err);
    if (!f->root)
        return gdn_fail(GDN_ERR_FORMAT, "%s: header JSON is invalid at line %d column %d: %s",
                        f->path, err.line, err.column, err.text);
    if (!json_is_object(f->root))
        return gdn_fail(GDN_ERR_FORMAT, "%s: header JSON is not an object", f->path);
    size_t cap = json_object_size(f->root);
    f->tensors = gdn_calloc("safetensors: f->tensors", cap ? cap : 1, sizeof *f->tensors);
    if (!f->tensors)
        return gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate the table of %zu tensors", f->path, cap);
    const char *key;
    json_t *val;
    json_object_foreach(f->root, key, val) {
        if (!strcmp(key, "__metadata__")) {
            if (!json_is_object(val))
                return gdn_fail(GDN_ERR_FORMAT, "%s: __metadata__ is not an object", f->path);
            const char *mk;
            json_t *mv;
            json_object_foreach(val, mk, mv) if (!json_is_string(mv)) return gdn_fail(
                GDN_ERR_FORMAT, "%s: __metadata__ value '%s' is not a string", f->path, mk);
            continue;
        }
        int rc = parse_tensor(f, key, val, &f->tensors[f->count]);
        if (rc) return rc;
        f->count++;
    }
    /* No two tensors may share bytes, and an empty tensor may not sit strictly inside another
     * (the reference implementation requires the ranges to tile the data section). Every tensor,
     * empty or not, is compared with the furthest end seen so far, not only with its sorted
     * neighbour: otherwise an empty tensor between two overlapping ones would hide the overlap. */
    gdn_st_tensor **order = gdn_malloc("safetensors: order", sizeof(*order) * (f->count ? f->count : 1));
    if (!order)
        return gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate the overlap check of %d tensors",
                        f->path, f->count);
    for (int i = 0; i < f->count; i++) order[i] = &f->tensors[i];
    qsort(order, f->count, sizeof *order, by_begin);
    int rc = GDN_OK;
    const gdn_st_tensor *reach = NULL; /* the tensor with the largest end so far */
    for (int i = 0; i < f->count && !rc; i++) {
        const gdn_st_tensor *b = order[i];
        if (reach && b->begin < reach->end)
            rc = gdn_fail(GDN_ERR_FORMAT,
                          "%s: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap in the data "
                          "section",
                          f->path, reach->name, (unsigned long long)reach->begin,
                          (unsigned long long)reach->end, b->name, (unsigned long long)b->begin,
                          (unsigned long long)b->end);
        if (!reach || b->end > reach->end) reach = b;
    }
    free(order);
    return rc;
}

int gdn_path_join(char *buf, size_t cap, const char *dir, const char *name) {
    if ((size_t)snprintf(buf, cap, "%s/%s", dir, name) >= cap)
        return gdn_fail(GDN_ERR_ARG, "%s/%s: path too long", dir, name);
    return GDN_OK;
}

int gdn_is_regular_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

const char *gdn_file_kind(mode_t m) {
    return S_ISDIR(m) ? "a directory" : S_ISFIFO(m) ? "a FIFO" : S_ISCHR(m) ? "a character device"
         : S_ISBLK(m) ? "a block device" : S_ISSOCK(m) ? "a socket" : "not a plain file";
}

int gdn_st_open(gdn_st_file **out, const char *path) {
    if (!out || !path) return gdn_fail(GDN_ERR_ARG, "safetensors open: NULL argument");
    *out = NULL;
    /* Only regular files: stat() before open(), since opening a FIFO for reading blocks until a
     * writer appears, and a device or a directory is never a safetensors file. */
    struct stat st;
    if (stat(path, &st) != 0)
        return gdn_fail(GDN_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return gdn_fail(GDN_ERR_IO, "%s: not a regular file (%s); gdncp reads only regular files",
                        path, gdn_file_kind(st.st_mode));
    gdn_st_file *f = gdn_calloc("safetensors: f", 1, sizeof *f);
    if (!f) return gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate the file handle", path);
    f->path = gdn_strdup("safetensors: f->path", path);
    /* The path may have been replaced since stat(): open without blocking, check again. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    int open_errno = errno;
    if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
                    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)) {
        close(fd);
        fd = -2;
    }
    if (fd >= 0 && !(f->fp = fdopen(fd, "rb"))) {
        open_errno = errno;
        close(fd);
    }
    int rc = GDN_OK;
    char *text = NULL;
    unsigned char len8[8];
    if (!f->path) {
        rc = gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate a copy of the path", path);
    } else if (fd == -2) {
        rc = gdn_fail(GDN_ERR_IO, "%s: not a regular file (replaced while opening)", path);
    } else if (!f->fp) {
        rc = gdn_fail(GDN_ERR_IO, "%s: cannot open: %s", path, strerror(open_errno));
    } else if (st.st_size < 8 || fread(len8, 1, 8, f->fp) != 8) {
        rc = gdn_fail(GDN_ERR_FORMAT, "%s: file is %lld bytes, too short for a safetensors header",
                      path, (long long)st.st_size);
    } else {
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--) n = (n << 8) | len8[i];
        if (n > MAX_HEADER_BYTES || n > (uint64_t)st.st_size - 8) {
            rc = gdn_fail(GDN_ERR_FORMAT,
                          "%s: header length %llu exceeds the file (%lld bytes) or the %u-byte limit",
                          path, (unsigned long long)n, (long long)st.st_size, MAX_HEADER_BYTES);
        } else if (!(text = gdn_malloc("safetensors: text", n + 1))) {
            rc = gdn_fail(GDN_ERR_NOMEM, "%s: header of %llu bytes", path, (unsigned long long)n);
        } else if (fread(text, 1, n, f->fp) != n) {
            rc = gdn_fail(GDN_ERR_FORMAT, "%s: header truncated", path);
        } else {
            f->data_start = 8 + n;
            f->data_size = (uint64_t)st.st_size - 8 - n;
            rc = parse_header(f, text, n);
        }
    }
    free(text);
    if (rc) {
        gdn_st_close(f);
        return rc;
    }
    *out = f;
    return GDN_OK;
}

void gdn_st_close(gdn_st_file *f) {
    if (!f) return;
    if (f->fp) fclose(f->fp);
    json_decref(f->root);
    free(f->tensors);
    free(f->path);
    free(f);
}

int gdn_st_count(const gdn_st_file *f) { return f ? f->count : 0; }

const gdn_st_tensor *gdn_st_at(const gdn_st_file *f, int i) {
    return f && i >= 0 && i < f->count ? &f->tensors[i] : NULL;
}

const gdn_st_tensor *gdn_st_find(const gdn_st_file *f, const char *name) {
    for (int i = 0; f && name && i < f->count; i++)
        if (!strcmp(f->tensors[i].name, name)) return &f->tensors[i];
    return NULL;
}

const char *gdn_st_path(const gdn_st_file *f) { return f ? f->path : NULL; }

const char *gdn_st_metadata(const gdn_st_file *f, const char *key) {
    if (!f || !key) return NULL;
    return json_string_value(json_object_get(json_object_get(f->root, "__metadata__"), key));
}

static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

uint16_t gdn_st_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if (isnan(x)) return (uint16_t)((u >> 16) | 0x40); /* keep it a NaN */
    u += 0x7fff + ((u >> 16) & 1);                     /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Read tensor bytes and convert element by element; dst_is_f64 chooses the output type. */
/* Read elements [first, first + n) of a tensor's flat data, converting, into dst. */
static int read_span(gdn_st_file *f, const gdn_st_tensor *t, uint64_t first, uint64_t n, void *dst,
                     int dst_is_f64) {
    const int es = dtype_size(t->dtype);
    enum { BLOCK = 1 << 16 };
    static _Thread_local unsigned char buf[BLOCK];
    if (fseeko(f->fp, (off_t)(f->data_start + t->begin + first * es), SEEK_SET) != 0)
        return gdn_fail(GDN_ERR_IO, "%s: seek failed for '%s'", f->path, t->name);
    for (uint64_t done = 0; done < n;) {
        uint64_t m = n - done < sizeof buf / es ? n - done : sizeof buf / es;
        if (fread(buf, es, m, f->fp) != m)
            return gdn_fail(GDN_ERR_FORMAT, "%s: tensor '%s' truncated", f->path, t->name);
        for (uint64_t i = 0; i < m; i++) {
            double x;
            if (t->dtype == GDN_F32) {
                float v;
                memcpy(&v, buf + i * 4, 4);
                x = v;
            } else if (t->dtype == GDN_F64) {
                memcpy(&x, buf + i * 8, 8);
            } else {
                uint16_t h;
                memcpy(&h, buf + i * 2, 2);
                x = bf16_to_f32(h);
            }
            if (dst_is_f64) ((double *)dst)[done + i] = x;
            else ((float *)dst)[done + i] = (float)x;
        }
        done += m;
    }
    return GDN_OK;
}

/* Rows [begin, begin + count) of dimension `axis` of a tensor, for every index of the dimensions
 * before it (all of it when count < 0). */
static int read_convert(gdn_st_file *f, const char *name, void *dst, size_t cap, int dst_is_f64, int axis,
                        int64_t begin, int64_t count) {
    if (!f || !name || !dst) return gdn_fail(GDN_ERR_ARG, "safetensors read: NULL argument");
    const gdn_st_tensor *t = gdn_st_find(f, name);
    if (!t) return gdn_fail(GDN_ERR_MISSING, "%s: no tensor named '%s'", f->path, name);
    if (t->dtype == GDN_DTYPE_OTHER)
        return gdn_fail(GDN_ERR_DTYPE, "%s: tensor '%s' is %s; only F32, F64 and BF16 are read",
                        f->path, name, t->dtype_name);
    if (count < 0) {
        const uint64_t n = (uint64_t)(t)->numel;
        if (n > cap)
            return gdn_fail(GDN_ERR_SHAPE, "%s: tensor '%s' has %llu elements, buffer holds %zu",
                            f->path, name, (unsigned long long)n, cap);
        return read_span(f, t, 0, n, dst, dst_is_f64);
    }
    /* overflow-safe: begin + count is never formed before it is known to fit (count >= 0 here) */
    if (axis < 0 || axis >= GDN_ST_MAX_DIMS)
        return gdn_fail(GDN_ERR_ARG, "%s: tensor '%s': no dimension %d to slice", f->path, name, axis);
    if (t->ndim <= axis || begin < 0 || begin > t->shape[axis] || count > t->shape[axis] - begin)
        return gdn_fail(GDN_ERR_SHAPE, "%s: tensor '%s' has no rows [%lld, %lld + %lld) along dimension %d (%lld rows)",
                        f->path, name, (long long)begin, (long long)begin, (long long)count, axis,
                        (long long)(t->ndim <= axis ? 0 : t->shape[axis]));
    uint64_t inner = 1, outer = 1;
    for (int i = axis + 1; i < t->ndim; i++) inner *= (uint64_t)t->shape[i];
    for (int i = 0; i < axis; i++) outer *= (uint64_t)t->shape[i];
    const uint64_t rows = (uint64_t)t->shape[axis];
    /* (the tensor's element count fits: parse_tensor; so does outer * count * inner <= it) */
    if (outer * (uint64_t)count * inner > cap)
        return gdn_fail(GDN_ERR_SHAPE, "%s: slice of '%s' does not fit the buffer", f->path, name);
    const size_t es = dst_is_f64 ? 8 : 4;
    for (uint64_t o = 0; o < outer; o++) {
        int rc = read_span(f, t, (o * rows + begin) * inner, count * inner,
                           (char *)dst + o * count * inner * es, dst_is_f64);
        if (rc) return rc;
    }
    return GDN_OK;
}

int gdn_st_read(gdn_st_file *f, const char *name, gdn_dtype dst_dtype, void *dst, size_t n, int axis, int64_t begin,
                int64_t count) {
    if (dst_dtype != GDN_F32 && dst_dtype != GDN_F64)
        return gdn_fail(GDN_ERR_DTYPE, "safetensors read '%s': destination dtype %d is neither F32 (0) nor F64 (1)",
                        name ? name : "(null)", (int)dst_dtype);
    return read_convert(f, name, dst, n, dst_dtype == GDN_F64, axis, begin, count);
}

int gdn_st_read_span(gdn_st_file *f, const char *name, float *dst, int64_t first, int64_t count) {
    if (!f || !name || (!dst && count)) return gdn_fail(GDN_ERR_ARG, "safetensors read span: NULL argument");
    const gdn_st_tensor *t = gdn_st_find(f, name);
    if (!t) return gdn_fail(GDN_ERR_MISSING, "%s: no tensor named '%s'", f->path, name);
    if (t->dtype == GDN_DTYPE_OTHER)
        return gdn_fail(GDN_ERR_DTYPE, "%s: tensor '%s' is %s; only F32, F64 and BF16 are read", f->path, name,
                        t->dtype_name);
    /* overflow-safe: first + count is never formed before it is known to fit */
    if (first < 0 || count < 0 || first > t->numel || count > t->numel - first)
        return gdn_fail(GDN_ERR_SHAPE, "%s: tensor '%s' has no elements [%lld, %lld + %lld) (it has %lld)", f->path,
                        name, (long long)first, (long long)first, (long long)count, (long long)t->numel);
    return read_span(f, t, (uint64_t)first, (uint64_t)count, dst, 0);
}

/* The library's shorthands (base.h). */
int gdn_st_read_f32(gdn_st_file *f, const char *name, float *dst, size_t n) {
    return gdn_st_read(f, name, GDN_F32, dst, n, 0, 0, -1);
}

int gdn_st_read_f64(gdn_st_file *f, const char *name, double *dst, size_t n) {
    return gdn_st_read(f, name, GDN_F64, dst, n, 0, 0, -1);
}

int gdn_st_read_f32_rows(gdn_st_file *f, const char *name, float *dst, size_t n, int64_t begin,
                         int64_t count) {
    return gdn_st_read(f, name, GDN_F32, dst, n, 1, begin, count);
}

int gdn_st_read_f32_slice(gdn_st_file *f, const char *name, float *dst, size_t n, int axis, int64_t begin,
                          int64_t count) {
    if (count < 0) return gdn_fail(GDN_ERR_ARG, "safetensors read_f32_slice: count %lld < 0", (long long)count);
    return gdn_st_read(f, name, GDN_F32, dst, n, axis, begin, count);
}

int gdn_st_read_ints(gdn_st_file *f, const char *name, int64_t *dst, size_t n, int64_t *count, int ndim) {
    if (!f || !name || !dst || !count) return gdn_fail(GDN_ERR_ARG, "safetensors read_i64: NULL argument");
    const gdn_st_tensor *t = gdn_st_find(f, name);
    if (!t) return gdn_fail(GDN_ERR_MISSING, "%s: no tensor named '%s'", f->path, name);
    const int wide = !strcmp(t->dtype_name, "I64");
    if (!wide && strcmp(t->dtype_name, "I32"))
        return gdn_fail(GDN_ERR_DTYPE, "%s: tensor '%s' is %s; an integer tensor must be I64 or I32", f->path, name,
                        t->dtype_name);
    if (ndim < 0) return gdn_fail(GDN_ERR_ARG, "safetensors read_ints '%s': ndim %d < 0", name, ndim);
    if (ndim && t->ndim != ndim)
        return gdn_fail(GDN_ERR_SHAPE, "%s: tensor '%s' has %d dims; it must be %d-D", f->path, name, t->ndim, ndim);
    const uint64_t m = (uint64_t)t->numel;
    if (m > n)
        return gdn_fail(GDN_ERR_SHAPE, "%s: tensor '%s' has %llu elements, buffer holds %zu", f->path, name,
                        (unsigned long long)m, n);
    const int es = wide ? 8 : 4;
    if (fseeko(f->fp, (off_t)(f->data_start + t->begin), SEEK_SET) != 0)
        return gdn_fail(GDN_ERR_IO, "%s: seek failed for '%s'", f->path, name);
    for (uint64_t i = 0; i < m; i++) {
        unsigned char b[8];
        if (fread(b, es, 1, f->fp) != 1)
            return gdn_fail(GDN_ERR_FORMAT, "%s: tensor '%s' truncated", f->path, name);
        if (wide) memcpy(&dst[i], b, 8);
        else {
            int32_t x;
            memcpy(&x, b, 4);
            dst[i] = x;
        }
    }
    *count = (int64_t)m;
    return GDN_OK;
}

int gdn_st_read_i64(gdn_st_file *f, const char *name, int64_t *dst, size_t n, int64_t *count) {
    return gdn_st_read_ints(f, name, dst, n, count, 1);
}

int gdn_st_read_i64_all(gdn_st_file *f, const char *name, int64_t *dst, size_t n, int64_t *count) {
    return gdn_st_read_ints(f, name, dst, n, count, 0);
}

/* ------------------------------------------------------------------------ writer */

typedef struct {
    char *name;
    gdn_dtype dtype;
    const char *dtype_name; /* as written in the header: F32, F64, BF16, or I64 (integer tensors) */
    int ndim;
    int64_t shape[GDN_ST_MAX_DIMS];
    unsigned char *bytes;
    size_t nbytes;
} st_entry;

struct gdn_st_writer {
    st_entry *entries;
    int count, cap;
    json_t *metadata;
};

int gdn_st_writer_create(gdn_st_writer **w) {
    if (!w) return gdn_fail(GDN_ERR_ARG, "writer output pointer is NULL");
    *w = gdn_calloc("safetensors: w", 1, sizeof **w);
    if (!*w || !((*w)->metadata = json_object())) {
        free(*w);
        *w = NULL;
        return gdn_fail(GDN_ERR_NOMEM, "cannot allocate a safetensors writer");
    }
    return GDN_OK;
}

void gdn_st_writer_destroy(gdn_st_writer *w) {
    if (!w) return;
    for (int i = 0; i < w->count; i++) free(w->entries[i].name), free(w->entries[i].bytes);
    free(w->entries);
    json_decref(w->metadata);
    free(w);
}

enum { SRC_F32 = 0, SRC_F64 = 1, SRC_I64 = 2 }; /* SRC_I64: int64 data stored as I64, unconverted */

static int writer_add(gdn_st_writer *w, const char *name, gdn_dtype dtype, int ndim,
                      const int64_t *shape, const void *data, int src) {
    if (!w || !name || (ndim > 0 && !shape)) return gdn_fail(GDN_ERR_ARG, "writer add: NULL argument");
    if (src != SRC_I64 && dtype != GDN_F32 && dtype != GDN_F64 && dtype != GDN_BF16)
        return gdn_fail(GDN_ERR_DTYPE, "writer add '%s': dtype must be F32, F64 or BF16", name);
    if (ndim < 0 || ndim > GDN_ST_MAX_DIMS)
        return gdn_fail(GDN_ERR_SHAPE, "writer add '%s': %d dims (max %d)", name, ndim,
                        GDN_ST_MAX_DIMS);
    if (!strcmp(name, "__metadata__") || !*name)
        return gdn_fail(GDN_ERR_ARG, "writer add: invalid tensor name '%s'", name);
    for (int i = 0; i < w->count; i++)
        if (!strcmp(w->entries[i].name, name))
            return gdn_fail(GDN_ERR_ARG, "writer add: tensor '%s' added twice", name);
    size_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return gdn_fail(GDN_ERR_SHAPE, "writer add '%s': negative dim", name);
        if (shape[i] && n > (SIZE_MAX / 16) / (size_t)shape[i])
            return gdn_fail(GDN_ERR_SHAPE, "writer add '%s': shape overflows", name);
        n *= (size_t)shape[i];
    }
    if (w->count == w->cap) {
        int cap = w->cap ? 2 * w->cap : 8;
        st_entry *e = gdn_realloc("safetensors: e", w->entries, sizeof *e * cap);
        if (!e)
            return gdn_fail(GDN_ERR_NOMEM, "writer add '%s': cannot grow the tensor list to %d", name, cap);
        w->entries = e, w->cap = cap;
    }
    st_entry *e = &w->entries[w->count];
    memset(e, 0, sizeof *e);
    e->nbytes = n * (src == SRC_I64 ? 8 : dtype_size(dtype));
    e->name = gdn_strdup("safetensors: e->name", name);
    e->bytes = data ? gdn_malloc("safetensors: e->bytes", e->nbytes ? e->nbytes : 1) : NULL; /* NULL data: reserved, written at its offset later */
    if (!e->name || (data && !e->bytes)) {
        free(e->name), free(e->bytes);
        return gdn_fail(GDN_ERR_NOMEM, "writer add: cannot allocate tensor '%s' (%zu bytes)", name,
                        e->nbytes);
    }
    static const char *const float_names[] = {"F32", "F64", "BF16"};
    e->dtype = dtype, e->ndim = ndim;
    e->dtype_name = src == SRC_I64 ? "I64" : float_names[dtype];
    for (int i = 0; i < ndim; i++) e->shape[i] = shape[i];
    if (src == SRC_I64 && data) memcpy(e->bytes, data, e->nbytes);
    for (size_t i = 0; src != SRC_I64 && data && i < n; i++) {
        double x = src == SRC_F64 ? ((const double *)data)[i] : ((const float *)data)[i];
        if (dtype == GDN_F32) {
            float v = (float)x;
            memcpy(e->bytes + 4 * i, &v, 4);
        } else if (dtype == GDN_F64) {
            memcpy(e->bytes + 8 * i, &x, 8);
        } else {
            uint16_t h = gdn_st_bf16((float)x);
            memcpy(e->bytes + 2 * i, &h, 2);
        }
    }
    w->count++;
    return GDN_OK;
}

int gdn_st_writer_add(gdn_st_writer *w, const char *name, gdn_dtype dtype, int ndim, const int64_t *shape,
                      const void *data, gdn_dtype data_dtype) {
    if (data_dtype != GDN_F32 && data_dtype != GDN_F64)
        return gdn_fail(GDN_ERR_DTYPE, "writer add '%s': data dtype %d is neither F32 (0) nor F64 (1)",
                        name ? name : "(null)", (int)data_dtype);
    return writer_add(w, name, dtype, ndim, shape, data, data_dtype == GDN_F64 ? SRC_F64 : SRC_F32);
}

/* The library's shorthands (base.h). */
int gdn_st_writer_add_f32(gdn_st_writer *w, const char *name, gdn_dtype dtype, int ndim,
                          const int64_t *shape, const float *data) {
    return gdn_st_writer_add(w, name, dtype, ndim, shape, data, GDN_F32);
}

int gdn_st_writer_add_f64(gdn_st_writer *w, const char *name, gdn_dtype dtype, int ndim,
                          const int64_t *shape, const double *data) {
    return gdn_st_writer_add(w, name, dtype, ndim, shape, data, GDN_F64);
}

int gdn_st_writer_add_i64(gdn_st_writer *w, const char *name, int ndim, const int64_t *shape,
                          const int64_t *data) {
    return writer_add(w, name, GDN_DTYPE_OTHER, ndim, shape, data, SRC_I64);
}

int gdn_st_writer_metadata(gdn_st_writer *w, const char *key, const char *value) {
    if (!w || !key || !value) return gdn_fail(GDN_ERR_ARG, "writer metadata: NULL argument");
    if (json_object_set_new(w->metadata, key, json_string(value)))
        return gdn_fail(GDN_ERR_ARG, "writer metadata: key or value is not valid UTF-8");
    return GDN_OK;
}

static char *build_header(gdn_st_writer *w, size_t *len) {
    json_t *root = json_object();
    if (!root) return NULL;
    if (json_object_size(w->metadata)) json_object_set(root, "__metadata__", w->metadata);
    uint64_t off = 0;
    for (int i = 0; i < w->count; i++) {
        const st_entry *e = &w->entries[i];
        json_t *shape = json_array();
        for (int d = 0; d < e->ndim; d++) json_array_append_new(shape, json_integer(e->shape[d]));
        json_t *t = json_pack("{s:s, s:o, s:[I,I]}", "dtype", e->dtype_name, "shape", shape,
                              "data_offsets", (json_int_t)off, (json_int_t)(off + e->nbytes));
        if (!t || json_object_set_new(root, e->name, t)) {
            json_decref(root);
            return NULL;
        }
        off += e->nbytes;
    }
    char *text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (!text) return NULL;
    /* Pad with spaces to a multiple of 8 so the data section stays aligned. */
    size_t n = strlen(text), padded = (n + 7) & ~(size_t)7;
    char *out = gdn_realloc("safetensors: out", text, padded + 1);
    if (!out) {
        free(text);
        return NULL;
    }
    memset(out + n, ' ', padded - n);
    out[padded] = 0;
    *len = padded;
    return out;
}

/* The temporary files of the writes in progress, for gdn_st_remove_temporaries (an
 * application's signal handler: the library installs none). Lock-free slots: 0 free, 1 being
 * filled by its owner, 2 live (the name complete), 3 being removed by the handler. A slot whose
 * file is gone (a caller that removed an abandoned gdn_st_writer_begin file itself) is taken
 * back when the slots run out; with none to take, the write goes on unregistered. */
enum { TMP_FREE = 0, TMP_FILLING = 1, TMP_LIVE = 2, TMP_REMOVING = 3, TMP_SLOTS = 32 };
static struct {
    atomic_int state;
    char path[PATH_MAX + 32];
} tmp_slots[TMP_SLOTS];

static int tmp_register(const char *tmp) {
    if (strlen(tmp) >= sizeof tmp_slots[0].path) return -1;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < TMP_SLOTS; i++) {
            int want = pass ? TMP_LIVE : TMP_FREE;
            if (pass && (atomic_load(&tmp_slots[i].state) != TMP_LIVE || access(tmp_slots[i].path, F_OK) == 0)) continue;
            if (!atomic_compare_exchange_strong(&tmp_slots[i].state, &want, TMP_FILLING)) continue;
            memcpy(tmp_slots[i].path, tmp, strlen(tmp) + 1);
            atomic_store(&tmp_slots[i].state, TMP_LIVE);
            return i;
        }
    return -1;
}

static void tmp_unregister(int slot) {
    if (slot >= 0) atomic_store(&tmp_slots[slot].state, TMP_FREE);
}

static void tmp_unregister_path(const char *tmp) {
    for (int i = 0; i < TMP_SLOTS; i++) {
        int live = TMP_LIVE;
        if (atomic_load(&tmp_slots[i].state) == TMP_LIVE && !strcmp(tmp_slots[i].path, tmp) &&
            atomic_compare_exchange_strong(&tmp_slots[i].state, &live, TMP_FILLING))
            atomic_store(&tmp_slots[i].state, TMP_FREE);
    }
}

void gdn_st_remove_temporaries(void) {
    const int saved_errno = errno;
    for (int i = 0; i < TMP_SLOTS; i++) {
        int live = TMP_LIVE;
        if (atomic_compare_exchange_strong(&tmp_slots[i].state, &live, TMP_REMOVING)) {
            unlink(tmp_slots[i].path); /* async-signal-safe */
            atomic_store(&tmp_slots[i].state, TMP_FREE);
        }
    }
    errno = saved_errno;
}

/* mkstemp and register the name with SIGINT/SIGTERM blocked in this thread (its mask only; no
 * disposition changes), so a handler never misses a file that exists. *slot: -1 if unregistered. */
static int make_temporary(char *tmp, int *slot) {
    sigset_t block, prev;
    sigemptyset(&block);
    sigaddset(&block, SIGINT), sigaddset(&block, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &block, &prev);
    const int fd = mkstemp(tmp);
    const int err = errno;
    *slot = fd >= 0 ? tmp_register(tmp) : -1;
    pthread_sigmask(SIG_SETMASK, &prev, NULL);
    errno = err;
    return fd;
}

/* fsync the directory holding path, so that the rename itself is durable. */
static int fsync_parent(const char *path) {
    char dir[PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == path) snprintf(dir, sizeof dir, "/");
    else if ((size_t)(slash - path) >= sizeof dir) return ENAMETOOLONG;
    else memcpy(dir, path, slash - path), dir[slash - path] = 0;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno;
    int err = fsync(fd) == 0 ? 0 : errno;
    close(fd);
    /* A file system that cannot fsync directories says so with EINVAL: nothing to report. */
    return err == EINVAL ? 0 : err;
}

int gdn_st_writer_save(gdn_st_writer *w, const char *path) {
    if (!w || !path) return gdn_fail(GDN_ERR_ARG, "writer save: NULL argument");
    size_t hlen = 0;
    char *header = build_header(w, &hlen);
    if (!header)
        return gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate the safetensors header (%d tensors)",
                        path, w->count);
    /* Atomic: write a temporary file in the same directory, fsync, then rename over path. On
     * every failure the temporary file is removed; while it exists it is registered for
     * gdn_st_remove_temporaries (the application's signal handler). */
    size_t plen = strlen(path);
    char *tmp = gdn_malloc("safetensors: tmp", plen + 16);
    if (!tmp) {
        free(header);
        return gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate the temporary file name", path);
    }
    snprintf(tmp, plen + 16, "%s.tmp.XXXXXX", path);
    int slot;
    const int fd = make_temporary(tmp, &slot);
    if (fd < 0) {
        int rc = gdn_fail(GDN_ERR_IO, "%s: cannot create temporary file: %s", path, strerror(errno));
        free(header), free(tmp);
        return rc;
    }
    int ok = fchmod(fd, 0644) == 0;
    int saved_errno = errno;
    FILE *fp = ok ? fdopen(fd, "wb") : NULL;
    ok = ok && fp != NULL;
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    ok = ok && fwrite(len8, 1, 8, fp) == 8 && fwrite(header, 1, hlen, fp) == hlen;
    gdn_test_point("st save: data");
    for (int i = 0; ok && i < w->count; i++) {
        if (!w->entries[i].bytes) { /* reserved tensors belong to gdn_st_writer_begin */
            errno = EINVAL;
            ok = 0;
            break;
        }
        ok = fwrite(w->entries[i].bytes, 1, w->entries[i].nbytes, fp) == w->entries[i].nbytes;
    }
    ok = ok && fflush(fp) == 0 && fsync(fd) == 0;
    if (!ok && errno) saved_errno = errno;
    if (fp) ok = (fclose(fp) == 0) && ok;
    else close(fd);
    ok = ok && rename(tmp, path) == 0;
    if (!ok && errno) saved_errno = errno;
    int rc = GDN_OK;
    if (!ok) {
        unlink(tmp);
        rc = gdn_fail(GDN_ERR_IO, "%s: write failed: %s (previous file, if any, left intact)", path,
                      strerror(saved_errno));
    } else {
        int err = fsync_parent(path);
        if (err)
            rc = gdn_fail(GDN_ERR_IO, "%s: written and renamed, but fsync of its directory failed: %s",
                          path, strerror(err));
    }
    tmp_unregister(slot); /* after the rename or the unlink: the name is gone either way */
    free(header), free(tmp);
    return rc;
}

/* ---------------------------------------------------------------- one file, several writers */

int gdn_st_writer_offset(gdn_st_writer *w, const char *name, uint64_t *offset) {
    if (!w || !name || !offset) return gdn_fail(GDN_ERR_ARG, "writer offset: NULL argument");
    size_t hlen = 0;
    char *header = build_header(w, &hlen);
    if (!header) return gdn_fail(GDN_ERR_NOMEM, "cannot allocate the safetensors header (%d tensors)", w->count);
    free(header);
    uint64_t off = 8 + hlen;
    for (int i = 0; i < w->count; i++) {
        if (!strcmp(w->entries[i].name, name)) {
            *offset = off;
            return GDN_OK;
        }
        off += w->entries[i].nbytes;
    }
    return gdn_fail(GDN_ERR_MISSING, "writer offset: no tensor '%s'", name);
}

int gdn_st_writer_begin(gdn_st_writer *w, const char *path, char *tmp, size_t cap) {
    if (!w || !path || !tmp) return gdn_fail(GDN_ERR_ARG, "writer begin: NULL argument");
    size_t hlen = 0;
    char *header = build_header(w, &hlen);
    if (!header) return gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate the safetensors header", path);
    if (strlen(path) + 16 > cap) {
        free(header);
        return gdn_fail(GDN_ERR_ARG, "%s: path too long for the temporary name", path);
    }
    snprintf(tmp, cap, "%s.tmp.XXXXXX", path);
    int slot; /* registered until gdn_st_commit (or its removal here on failure) */
    const int fd = make_temporary(tmp, &slot);
    if (fd < 0) {
        free(header);
        return gdn_fail(GDN_ERR_IO, "%s: cannot create temporary file: %s", path, strerror(errno));
    }
    gdn_test_point("st begin: created");
    uint64_t total = 8 + hlen;
    for (int i = 0; i < w->count; i++) total += w->entries[i].nbytes;
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    /* the whole size first (reserved tensors read as zeros until written: a sparse file) */
    int ok = fchmod(fd, 0644) == 0 && ftruncate(fd, (off_t)total) == 0 && pwrite(fd, len8, 8, 0) == 8 &&
             pwrite(fd, header, hlen, 8) == (ssize_t)hlen;
    uint64_t off = 8 + hlen;
    for (int i = 0; ok && i < w->count; i++) {
        const st_entry *e = &w->entries[i];
        for (size_t done = 0; ok && e->bytes && done < e->nbytes;) {
            const ssize_t k = pwrite(fd, e->bytes + done, e->nbytes - done, (off_t)(off + done));
            ok = k > 0, done += k > 0 ? (size_t)k : 0;
        }
        off += e->nbytes;
    }
    ok = ok && fsync(fd) == 0;
    const int err = errno;
    close(fd);
    free(header);
    if (!ok) {
        unlink(tmp);
        tmp_unregister(slot);
        return gdn_fail(GDN_ERR_IO, "%s: cannot write the temporary file: %s", path, strerror(err));
    }
    return GDN_OK;
}

int gdn_st_write_at(const char *tmp, uint64_t offset, const float *data, size_t n) {
    if (!tmp || (n && !data)) return gdn_fail(GDN_ERR_ARG, "write at: NULL argument");
    const int fd = open(tmp, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return gdn_fail(GDN_ERR_IO, "%s: cannot open for writing: %s", tmp, strerror(errno));
    const unsigned char *p = (const unsigned char *)data;
    const size_t bytes = n * sizeof(float);
    int ok = 1;
    for (size_t done = 0; ok && done < bytes;) {
        const ssize_t k = pwrite(fd, p + done, bytes - done, (off_t)(offset + done));
        ok = k > 0, done += k > 0 ? (size_t)k : 0;
    }
    ok = ok && fsync(fd) == 0;
    const int err = errno;
    close(fd);
    return ok ? GDN_OK : gdn_fail(GDN_ERR_IO, "%s: positioned write of %zu bytes at %llu failed: %s", tmp, bytes,
                                  (unsigned long long)offset, strerror(err));
}

int gdn_st_commit(const char *tmp, const char *path) {
    if (!tmp || !path) return gdn_fail(GDN_ERR_ARG, "commit: NULL argument");
    if (rename(tmp, path) != 0) {
        const int err = errno;
        unlink(tmp);
        tmp_unregister_path(tmp);
        return gdn_fail(GDN_ERR_IO, "%s: rename failed: %s (previous file, if any, left intact)", path, strerror(err));
    }
    tmp_unregister_path(tmp);
    const int err = fsync_parent(path);
    return err ? gdn_fail(GDN_ERR_IO, "%s: renamed, but fsync of its directory failed: %s", path, strerror(err))
               : GDN_OK;
}
