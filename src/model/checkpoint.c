/* Checkpoints in Hugging Face's Qwen3.5 layout: the directory and its crash-safety protocol (train.h),
 * the tensor files; config.json is hf_config.c's. The tensors go through the project's safetensors writer, with their
 * bytes written straight from the caller's flat arrays (no copy of the model), and are read back
 * with its validating reader. */
#include "gdncp/checkpoint.h"

#include "base.h"
#include "gdncp/io.h"
#include "hf_config.h"
#include "hf_weights.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CONFIG_FILE GDN_HF_CONFIG_FILE
#define MODEL_FILE "model.safetensors"
#define OPTIM_FILE "optimizer.safetensors"
#define MASTER_PREFIX "master." /* beside BF16 weights: the fp32 masters (optimizer file) */
#define STATE_FILE "trainer_state.json"
#define PRIMARY_PREFIX "checkpoint-"
#define HIDDEN_PREFIX ".checkpoint-"
#define MAX_STATE_BYTES ((off_t)64 << 20)

/* The test point (gdn_test_point, base.h) of gdn_ckpt_save's stages: 1 (temporary directory
 * complete, not yet renamed), 2 (an existing checkpoint of the same step moved aside, the new one
 * not yet in place) and 3 (the new one in place, the old one not yet removed). */
static void test_hook(int stage) {
    static const char *const site[4] = {"", "ckpt save: stage 1", "ckpt save: stage 2", "ckpt save: stage 3"};
    gdn_test_point(site[stage]);
}

/* ------------------------------------------------------------------ paths and directories */

/* buf = dir + "/" + name; GDN_ERR_ARG when it does not fit. */
/* fsync a directory so that the renames and creations inside it are durable; 0 or errno. */
static int fsync_dir(const char *dir) {
    const int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno;
    const int err = fsync(fd) == 0 ? 0 : errno;
    close(fd);
    /* A file system that cannot fsync directories says so with EINVAL: nothing to report. */
    return err == EINVAL ? 0 : err;
}

static int exists(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0;
}

/* Does dir hold what a reader needs: config.json and the weights (model.safetensors, or the
 * shards of a transformers checkpoint's index)? */
static int is_complete(const char *dir) {
    char p[PATH_MAX];
    return snprintf(p, sizeof p, "%s/%s", dir, CONFIG_FILE) < (int)sizeof p && gdn_is_regular_file(p) && gdn_hf_has_weights(dir);
}

/* Remove path and, if it is a directory, everything below it (symbolic links are removed, never
 * followed). 0 or the first errno. */
static int remove_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? 0 : errno;
    if (!S_ISDIR(st.st_mode)) return unlink(path) == 0 ? 0 : errno;
    DIR *d = opendir(path);
    if (!d) return errno;
    int err = 0;
    char child[PATH_MAX];
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if ((size_t)snprintf(child, sizeof child, "%s/%s", path, e->d_name) >= sizeof child) {
            err = err ? err : ENAMETOOLONG;
            continue;
        }
        const int e2 = remove_tree(child);
        err = err ? err : e2;
    }
    closedir(d);
    if (!err && rmdir(path) != 0) err = errno;
    return err;
}

/* Write text to path (created, truncated) and fsync it. */
static int write_synced(const char *path, const char *text, size_t len) {
    const int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return gdn_fail(GDN_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    for (size_t done = 0; done < len;) {
        const ssize_t k = write(fd, text + done, len - done);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            const int err = k < 0 ? errno : EIO;
            close(fd);
            return gdn_fail(GDN_ERR_IO, "%s: write failed: %s", path, strerror(err));
        }
        done += (size_t)k;
    }
    if (fsync(fd) != 0) {
        const int err = errno;
        close(fd);
        return gdn_fail(GDN_ERR_IO, "%s: fsync failed: %s", path, strerror(err));
    }
    if (close(fd) != 0) return gdn_fail(GDN_ERR_IO, "%s: close failed: %s", path, strerror(errno));
    return GDN_OK;
}

/* ------------------------------------------------------------------ names in an output directory */

typedef enum { ENTRY_OTHER, ENTRY_PRIMARY, ENTRY_TMP, ENTRY_OLD, ENTRY_DEL } entry_kind;

/* A run of decimal digits at *s (at most 18: no overflow); -1 if none. Advances *s. */
static int64_t parse_digits(const char **s) {
    int64_t v = 0;
    int n = 0;
    for (; **s >= '0' && **s <= '9'; (*s)++, n++) {
        if (n == 18) return -1;
        v = 10 * v + (**s - '0');
    }
    return n ? v : -1;
}

/* "checkpoint-N", or ".checkpoint-N.{tmp,old,del}-PID" (what saves leave behind when killed). */
static entry_kind classify(const char *name, int64_t *step, long *pid) {
    const char *s = name;
    *pid = 0;
    if (!strncmp(s, PRIMARY_PREFIX, strlen(PRIMARY_PREFIX))) {
        s += strlen(PRIMARY_PREFIX);
        *step = parse_digits(&s);
        return *step >= 0 && !*s ? ENTRY_PRIMARY : ENTRY_OTHER;
    }
    if (strncmp(s, HIDDEN_PREFIX, strlen(HIDDEN_PREFIX))) return ENTRY_OTHER;
    s += strlen(HIDDEN_PREFIX);
    *step = parse_digits(&s);
    if (*step < 0) return ENTRY_OTHER;
    static const struct { const char *tag; entry_kind kind; } tags[] = {
        {".tmp-", ENTRY_TMP}, {".old-", ENTRY_OLD}, {".del-", ENTRY_DEL}};
    for (size_t i = 0; i < sizeof tags / sizeof tags[0]; i++) {
        if (strncmp(s, tags[i].tag, 5)) continue;
        s += 5;
        const int64_t p = parse_digits(&s);
        if (p <= 0 || *s || p > LONG_MAX) return ENTRY_OTHER;
        *pid = (long)p;
        return tags[i].kind;
    }
    return ENTRY_OTHER;
}

static void primary_name(char *buf, size_t cap, int64_t step) {
    snprintf(buf, cap, PRIMARY_PREFIX "%08lld", (long long)step);
}

static void hidden_name(char *buf, size_t cap, int64_t step, const char *tag, long pid) {
    snprintf(buf, cap, HIDDEN_PREFIX "%08lld.%s-%ld", (long long)step, tag, pid);
}

/* A leftover belongs to a save that is over: ours (an earlier failed save in this process) or
 * one of a process that no longer exists. Another live process may be saving right now. */
static int owner_gone(long pid) {
    if (pid == (long)getpid()) return 1;
    return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

/* Undo what killed saves left: temporary and half-removed directories go; a checkpoint moved
 * aside by a save that died before putting the new one in place goes back (or goes, if its step
 * is in place after all). Best effort: what cannot be removed now is ignored by readers and tried
 * again by the next save. */
static void clean_leftovers(const char *out_dir) {
    DIR *d = opendir(out_dir);
    if (!d) return;
    char path[PATH_MAX], primary[PATH_MAX], name[64];
    for (struct dirent *e; (e = readdir(d));) {
        int64_t step;
        long pid;
        const entry_kind kind = classify(e->d_name, &step, &pid);
        if (kind == ENTRY_OTHER || kind == ENTRY_PRIMARY || !owner_gone(pid)) continue;
        if (gdn_path_join(path, sizeof path, out_dir, e->d_name)) continue;
        if (kind == ENTRY_OLD) {
            primary_name(name, sizeof name, step);
            if (gdn_path_join(primary, sizeof primary, out_dir, name)) continue;
            if (!exists(primary) && is_complete(path)) {
                if (rename(path, primary) == 0) fsync_dir(out_dir);
                continue;
            }
        }
        remove_tree(path);
    }
    closedir(d);
}

/* The complete checkpoint-N directories of out_dir, and the complete moved-aside copies whose
 * step has no complete checkpoint-N (a save killed between its two renames); *out is malloc'd. */
typedef struct {
    int64_t step;
    int aside;
    char name[64];
} found_ckpt;

static int list_checkpoints(const char *out_dir, found_ckpt **out, int *count) {
    *out = NULL, *count = 0;
    DIR *d = opendir(out_dir);
    if (!d) return gdn_fail(GDN_ERR_IO, "%s: cannot list the directory: %s", out_dir, strerror(errno));
    found_ckpt *list = NULL;
    int n = 0, cap = 0, rc = GDN_OK;
    char path[PATH_MAX];
    for (struct dirent *e; !rc && (e = readdir(d));) {
        int64_t step;
        long pid;
        const entry_kind kind = classify(e->d_name, &step, &pid);
        if ((kind != ENTRY_PRIMARY && kind != ENTRY_OLD) || strlen(e->d_name) >= sizeof list->name)
            continue;
        if (gdn_path_join(path, sizeof path, out_dir, e->d_name) || !is_complete(path)) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            found_ckpt *grown = gdn_realloc("checkpoint: grown", list, sizeof *list * (size_t)cap);
            if (!grown) {
                rc = gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate the list of checkpoints", out_dir);
                break;
            }
            list = grown;
        }
        list[n].step = step, list[n].aside = kind == ENTRY_OLD;
        snprintf(list[n].name, sizeof list[n].name, "%s", e->d_name);
        n++;
    }
    closedir(d);
    if (rc) {
        free(list);
        return rc;
    }
    /* A moved-aside copy counts only where its step has no checkpoint-N in place. */
    int kept = 0;
    for (int i = 0; i < n; i++) {
        int shadowed = 0;
        for (int j = 0; j < n && list[i].aside; j++)
            shadowed |= !list[j].aside && list[j].step == list[i].step;
        for (int j = 0; j < kept && list[i].aside && !shadowed; j++)
            shadowed |= list[j].step == list[i].step; /* two asides of one step: keep one */
        if (!shadowed) list[kept++] = list[i];
    }
    *out = list, *count = kept;
    return GDN_OK;
}

/* ------------------------------------------------------------------ the tensor files */

/* The table of gdn_model_tensor(), fetched once. */
static int model_table(const gdn_model_config *cfg, gdn_model_tensor_info **out, int *count) {
    const int n = gdn_model_tensor_count(cfg);
    if (n <= 0) return gdn_fail(GDN_ERR_ARG, "the model configuration has no tensors");
    gdn_model_tensor_info *t = gdn_calloc("checkpoint: t", (size_t)n, sizeof *t);
    if (!t) return gdn_fail(GDN_ERR_NOMEM, "cannot allocate the table of %d tensors", n);
    for (int i = 0; i < n; i++) {
        const int rc = gdn_model_tensor(cfg, i, &t[i]);
        if (rc) {
            free(t);
            return rc;
        }
    }
    *out = t, *count = n;
    return GDN_OK;
}

/* A set of flat arrays stored in one file, each tensor as prefix + its name. */
typedef struct {
    const char *prefix;
    float *data;
} tensor_group;

/* The first non-finite value of any tensor, so that a diverged run never replaces (or prunes)
 * the good checkpoints with one that cannot be loaded. */
static int check_finite(const gdn_model_tensor_info *table, int n, const float *data,
                        const char *what, const char *prefix) {
    for (int i = 0; i < n; i++) {
        const int64_t bad = gdn_find_nonfinite_f32(data + table[i].offset, (int64_t)table[i].numel, 1);
        if (bad >= 0)
            return gdn_fail(GDN_ERR_NONFINITE, "%s: tensor '%s%s' holds %g at element %lld", what,
                            prefix, table[i].name, (double)data[table[i].offset + (size_t)bad],
                            (long long)bad);
    }
    return GDN_OK;
}

/* The optimizer file's tensor groups, in file order: the moments, and beside BF16 weights the
 * fp32 masters they round. */
static const char *const optim_prefix[3] = {"exp_avg.", "exp_avg_sq.", MASTER_PREFIX};

/* Reserve every tensor of the groups (prefixes) in a safetensors file at path, laid out back to
 * back in table order after the header: the temporary file is created at its full size, its name
 * into tmp, the first tensor's byte offset into *base; the bytes come from gdn_ckpt_parts_write. */
static int reserve_tensors(const char *path, const gdn_model_tensor_info *table, int n, const char *const *prefixes,
                           int ngroups, int dtype, char *tmp, size_t cap, uint64_t *base) {
    gdn_st_writer *wr = NULL;
    int rc = gdn_st_writer_create(&wr);
    if (!rc) rc = gdn_st_writer_metadata(wr, "format", "pt");
    char name[sizeof table->name + 32];
    for (int g = 0; g < ngroups && !rc; g++)
        for (int i = 0; i < n && !rc; i++) {
            snprintf(name, sizeof name, "%s%s", prefixes[g], table[i].name);
            rc = gdn_st_writer_add_f32(wr, name, (gdn_dtype)dtype, table[i].ndim, table[i].shape, NULL);
        }
    if (!rc) {
        snprintf(name, sizeof name, "%s%s", prefixes[0], table[0].name);
        rc = gdn_st_writer_offset(wr, name, base);
    }
    if (!rc) rc = gdn_st_writer_begin(wr, path, tmp, cap);
    gdn_st_writer_destroy(wr);
    return rc;
}

/* n floats of src at byte offset `at` of fd, as dtype (F32, or BF16 rounded a chunk at a time);
 * 0 or errno. */
static int write_span(int fd, uint64_t at, const float *src, size_t n, int dtype) {
    enum { CHUNK = 1 << 14 };
    uint16_t half[CHUNK];
    float rounded[CHUNK];
    /* the mistake of a writer that confuses its dtypes: F32 tensors written rounded to bfloat16
     * (a test mutation: the save-and-load checks must see it) */
    const int round_f32 = dtype != GDN_BF16 && gdn_test_mutate("ckpt save: F32 tensors written rounded to bfloat16");
    const size_t esz = dtype == GDN_BF16 ? 2 : 4;
    for (size_t e0 = 0; e0 < n;) {
        const size_t ne = dtype == GDN_BF16 || round_f32 ? (n - e0 < CHUNK ? n - e0 : CHUNK) : n - e0;
        const char *bytes = (const char *)(src + e0);
        if (dtype == GDN_BF16) {
            for (size_t e = 0; e < ne; e++) half[e] = gdn_st_bf16(src[e0 + e]);
            bytes = (const char *)half;
        } else if (round_f32) {
            for (size_t e = 0; e < ne; e++) {
                const uint32_t u = (uint32_t)gdn_st_bf16(src[e0 + e]) << 16;
                memcpy(rounded + e, &u, sizeof u);
            }
            bytes = (const char *)rounded;
        }
        const size_t len = ne * esz;
        for (size_t done = 0; done < len;) {
            const ssize_t k = pwrite(fd, bytes + done, len - done, (off_t)(at + done));
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) return k < 0 ? errno : EIO;
            done += (size_t)k;
        }
        at += len, e0 += ne;
    }
    return 0;
}

/* The whole model's tensor table (every expert: a checkpoint's layout) beside cfg's, and each
 * tensor's first element in a file of the whole tensors back to back (prefix[n]: the total). */
typedef struct {
    gdn_model_config whole;
    gdn_model_tensor_info *local, *table; /* cfg's, the whole model's */
    uint64_t *prefix;
    int n;
} ckpt_layout;

static void layout_free(ckpt_layout *l) { free(l->local), free(l->table), free(l->prefix); }

static int layout_make(const gdn_model_config *cfg, ckpt_layout *l) {
    memset(l, 0, sizeof *l);
    l->whole = *cfg;
    l->whole.ep_size = 0, l->whole.ep_rank = 0;
    int n2 = 0;
    int rc = model_table(cfg, &l->local, &l->n);
    if (!rc) rc = model_table(&l->whole, &l->table, &n2);
    if (!rc && !(l->prefix = gdn_malloc("checkpoint: prefix", sizeof *l->prefix * (size_t)(l->n + 1))))
        rc = gdn_fail(GDN_ERR_NOMEM, "checkpoint: the tensor layout");
    for (int i = 0; !rc && i <= l->n; i++) l->prefix[i] = i ? l->prefix[i - 1] + l->table[i - 1].numel : 0;
    if (rc) layout_free(l);
    return rc;
}

/* Element k of cfg's tensor i is element shift + k of the whole tensor (experts split over ranks:
 * this rank's first expert's rows come first). */
static uint64_t expert_shift(const ckpt_layout *l, int i) {
    const gdn_model_tensor_info *t = &l->local[i];
    return t->experts_whole && t->shape[0] ? (uint64_t)t->expert_first * (t->numel / (uint64_t)t->shape[0]) : 0;
}

/* The part [k0, k1) of cfg's tensor i inside the flat range [lo, hi) (k0 >= k1: none). */
static void part_of(const gdn_model_tensor_info *t, size_t lo, size_t hi, size_t *k0, size_t *k1) {
    *k0 = lo > t->offset ? lo - t->offset : 0;
    *k1 = hi < t->offset + t->numel ? (hi > t->offset ? hi - t->offset : 0) : t->numel;
}

/* ------------------------------------------------------------------ save, in parts */

static int install(const char *out_dir, const char *tmp_dir, const char *final, int64_t step);
static int prune(const char *out_dir, int keep_last, const char *run_id);
static void run_in_state(const char *state_json, char *id, size_t n);

int gdn_ckpt_parts_begin(gdn_ckpt_parts *p, const char *out_dir, int64_t step, const gdn_model_config *cfg,
                         int moments, int weight_dtype) {
    if (!p || !out_dir || !cfg) return gdn_fail(GDN_ERR_ARG, "checkpoint save: NULL argument");
    memset(p, 0, sizeof *p);
    if (weight_dtype != GDN_F32 && weight_dtype != GDN_BF16)
        return gdn_fail(GDN_ERR_ARG, "checkpoint save: weight dtype %d is neither F32 (0) nor BF16 (2)", weight_dtype);
    if (step < 0) return gdn_fail(GDN_ERR_ARG, "checkpoint save: step %lld is negative", (long long)step);
    if (strlen(out_dir) >= sizeof p->out_dir) return gdn_fail(GDN_ERR_ARG, "checkpoint save: the path %s is too long", out_dir);
    ckpt_layout l;
    int rc = gdn_model_config_check(cfg);
    if (!rc) rc = layout_make(cfg, &l);
    if (rc) return rc;
    snprintf(p->out_dir, sizeof p->out_dir, "%s", out_dir);
    p->step = step, p->weight_dtype = weight_dtype, p->moments = moments != 0;
    /* One level only: a missing parent is more likely a typo than a wish. */
    struct stat st;
    const int made = mkdir(out_dir, 0755) == 0 ? 0 : errno;
    if (made && made != EEXIST) {
        rc = gdn_fail(GDN_ERR_IO, "%s: cannot create the output directory: %s%s", out_dir,
                      strerror(made), made == ENOENT ? " (its parent directory does not exist)" : "");
    } else if (stat(out_dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        rc = gdn_fail(GDN_ERR_IO, "%s: the output path exists and is not a directory", out_dir);
    }
    char name[64], path[PATH_MAX];
    if (!rc) {
        clean_leftovers(out_dir);
        hidden_name(name, sizeof name, step, "tmp", (long)getpid());
        rc = gdn_path_join(p->tmp_dir, sizeof p->tmp_dir, out_dir, name);
    }
    if (!rc) {
        primary_name(name, sizeof name, step);
        rc = gdn_path_join(p->final_dir, sizeof p->final_dir, out_dir, name);
    }
    if (rc) {
        layout_free(&l);
        return rc;
    }
    remove_tree(p->tmp_dir);
    if (mkdir(p->tmp_dir, 0755) != 0) {
        rc = gdn_fail(GDN_ERR_IO, "%s: cannot create the temporary directory: %s", p->tmp_dir, strerror(errno));
        layout_free(&l);
        return rc;
    }
    char *text = NULL;
    rc = gdn_path_join(path, sizeof path, p->tmp_dir, CONFIG_FILE);
    if (!rc) rc = gdn_hf_config_text(&l.whole, weight_dtype, &text);
    if (!rc) rc = write_synced(path, text, strlen(text));
    free(text);
    static const char *const bare[1] = {""};
    if (!rc) rc = gdn_path_join(path, sizeof path, p->tmp_dir, MODEL_FILE);
    if (!rc) rc = reserve_tensors(path, l.table, l.n, bare, 1, weight_dtype, p->model_tmp, sizeof p->model_tmp,
                                  &p->model_base);
    if (!rc && moments) rc = gdn_path_join(path, sizeof path, p->tmp_dir, OPTIM_FILE);
    if (!rc && moments)
        rc = reserve_tensors(path, l.table, l.n, optim_prefix, weight_dtype == GDN_BF16 ? 3 : 2, GDN_F32,
                             p->optim_tmp, sizeof p->optim_tmp, &p->optim_base);
    layout_free(&l);
    if (rc) gdn_ckpt_parts_abort(p);
    return rc;
}

/* Open a temporary file that gdn_ckpt_parts_begin made (in this process or another). */
static int open_part(const char *tmp, const gdn_ckpt_parts *p, int *fd) {
    *fd = open(tmp, O_WRONLY | O_CLOEXEC);
    if (*fd >= 0) return GDN_OK;
    return gdn_fail(GDN_ERR_IO, "%s: cannot open the checkpoint's temporary file (%s): every process writing a part "
                    "must see the directory the first one made (one file system for %s)", tmp, strerror(errno),
                    p->out_dir);
}

int gdn_ckpt_parts_write(const gdn_ckpt_parts *p, const gdn_model_config *cfg, size_t lo, size_t hi, const float *w,
                         const float *adam_m, const float *adam_v) {
    if (!p || !cfg || (hi > lo && (!w || (p->moments && (!adam_m || !adam_v)))))
        return gdn_fail(GDN_ERR_ARG, "checkpoint part: NULL argument (a save with moments needs both)");
    if (lo > hi || hi > gdn_model_param_floats(cfg))
        return gdn_fail(GDN_ERR_ARG, "checkpoint part: the range [%zu, %zu) is not inside the %zu floats of the model",
                        lo, hi, gdn_model_param_floats(cfg));
    if (lo == hi) return GDN_OK;
    ckpt_layout l;
    int rc = layout_make(cfg, &l);
    if (rc) return rc;
    /* a diverged run never replaces (or prunes) the good checkpoints with one that cannot be loaded */
    const float *const src[4] = {w, adam_m, adam_v, w};
    const char *const what[4] = {"", optim_prefix[0], optim_prefix[1], optim_prefix[2]};
    const int groups = p->moments ? (p->weight_dtype == GDN_BF16 ? 3 : 2) : 0;
    for (int i = 0; i < l.n && !rc; i++) {
        size_t k0, k1;
        part_of(&l.local[i], lo, hi, &k0, &k1);
        for (int g = 0; g <= groups && g < 3 && k0 < k1 && !rc; g++) {
            const float *x = src[g] + (l.local[i].offset + k0 - lo); /* every array from lo */
            const int64_t bad = gdn_find_nonfinite_f32(x, (int64_t)(k1 - k0), 1);
            if (bad >= 0)
                rc = gdn_fail(GDN_ERR_NONFINITE, "refusing to save a checkpoint: tensor '%s%s' holds %g at element %llu",
                              what[g], l.local[i].name, (double)x[bad],
                              (unsigned long long)(expert_shift(&l, i) + k0 + (uint64_t)bad));
        }
    }
    int fm = -1, fo = -1, err = 0;
    if (!rc) rc = open_part(p->model_tmp, p, &fm);
    if (!rc && groups) rc = open_part(p->optim_tmp, p, &fo);
    const size_t esz = p->weight_dtype == GDN_BF16 ? 2 : 4;
    for (int i = 0; i < l.n && !rc && !err; i++) {
        size_t k0, k1;
        part_of(&l.local[i], lo, hi, &k0, &k1);
        if (k0 >= k1) continue;
        const uint64_t at = l.prefix[i] + expert_shift(&l, i) + k0; /* the element in the file's order */
        const size_t from = l.local[i].offset + k0 - lo;
        err = write_span(fm, p->model_base + at * esz, w + from, k1 - k0, p->weight_dtype);
        for (int g = 0; g < groups && !err; g++) {
            const float *x = (g == 2 ? w : g ? adam_v : adam_m) + from;
            err = write_span(fo, p->optim_base + ((uint64_t)g * l.prefix[l.n] + at) * 4, x, k1 - k0, GDN_F32);
        }
    }
    /* a rank whose disk is full (a test mutation: its peers and the previous checkpoints must survive it) */
    if (!rc && !err && gdn_test_mutate("ckpt part: this process's write fails (as on a full disk)")) err = ENOSPC;
    if (!rc && !err && fsync(fm) != 0) err = errno;
    if (!rc && !err && fo >= 0 && fsync(fo) != 0) err = errno;
    if (fm >= 0) close(fm);
    if (fo >= 0) close(fo);
    if (!rc && err) rc = gdn_fail(GDN_ERR_IO, "%s: writing the tensors failed: %s", p->tmp_dir, strerror(err));
    layout_free(&l);
    return rc;
}

int gdn_ckpt_parts_finish(const gdn_ckpt_parts *p, const char *state_json, int keep_last) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "checkpoint finish: NULL argument");
    if (!state_json) state_json = "{}";
    json_error_t jerr;
    json_t *state = json_loads(state_json, JSON_DECODE_ANY, &jerr);
    int rc = state ? GDN_OK
                   : gdn_fail(GDN_ERR_ARG, "checkpoint save: the trainer state is not JSON (line %d column %d: %s)",
                              jerr.line, jerr.column, jerr.text);
    json_decref(state);
    char path[PATH_MAX];
    if (!rc) rc = gdn_path_join(path, sizeof path, p->tmp_dir, MODEL_FILE);
    if (!rc) rc = gdn_st_commit(p->model_tmp, path);
    if (!rc && p->moments) rc = gdn_path_join(path, sizeof path, p->tmp_dir, OPTIM_FILE);
    if (!rc && p->moments) rc = gdn_st_commit(p->optim_tmp, path);
    if (!rc) rc = gdn_path_join(path, sizeof path, p->tmp_dir, STATE_FILE);
    if (!rc) rc = write_synced(path, state_json, strlen(state_json));
    if (!rc) {
        const int err = fsync_dir(p->tmp_dir);
        if (err) rc = gdn_fail(GDN_ERR_IO, "%s: fsync failed: %s", p->tmp_dir, strerror(err));
    }
    if (!rc) {
        test_hook(1);
        rc = install(p->out_dir, p->tmp_dir, p->final_dir, p->step);
    }
    if (rc) {
        gdn_ckpt_parts_abort(p); /* the previous checkpoints are untouched */
        return rc;
    }
    char run_id[128];
    run_in_state(state_json, run_id, sizeof run_id);
    return keep_last > 0 ? prune(p->out_dir, keep_last, run_id) : GDN_OK;
}

void gdn_ckpt_parts_abort(const gdn_ckpt_parts *p) {
    if (!p || !p->tmp_dir[0]) return;
    remove_tree(p->tmp_dir);
}

/* Check a file of gdncp's own (the optimizer's moments) against the groups' tensors (names,
 * dtypes, exact shapes, nothing else), then read it into the arrays and check the values are
 * finite. The model's weights, which may come from transformers, go through gdn_hf_read_model. */
static int read_tensors(const char *path, const gdn_model_tensor_info *table, int n,
                        const tensor_group *groups, int ngroups) {
    gdn_st_file *f = NULL;
    int rc = gdn_st_open(&f, path);
    if (rc) return rc;
    char name[sizeof table->name + 32];
    for (int g = 0; g < ngroups && !rc; g++)
        for (int i = 0; i < n && !rc; i++) {
            snprintf(name, sizeof name, "%s%s", groups[g].prefix, table[i].name);
            const gdn_st_tensor *t = gdn_st_find(f, name);
            if (!t) {
                rc = gdn_fail(GDN_ERR_MISSING, "%s: tensor '%s' is missing", path, name);
                break;
            }
            rc = gdn_hf_check_tensor(path, t, &table[i]);
        }
    /* Every expected name was found once, so any further tensor is foreign. */
    if (!rc && gdn_st_count(f) != n * ngroups) {
        for (int k = 0; k < gdn_st_count(f) && !rc; k++) {
            const char *fname = gdn_st_at(f, k)->name;
            int known = 0;
            for (int g = 0; g < ngroups && !known; g++) {
                const size_t pl = strlen(groups[g].prefix);
                if (strncmp(fname, groups[g].prefix, pl)) continue;
                for (int i = 0; i < n && !known; i++) known = !strcmp(fname + pl, table[i].name);
            }
            if (!known)
                rc = gdn_fail(GDN_ERR_FORMAT, "%s: unexpected tensor '%s' (not a parameter of this "
                              "configuration)", path, fname);
        }
    }
    for (int g = 0; g < ngroups && !rc; g++)
        for (int i = 0; i < n && !rc; i++) {
            snprintf(name, sizeof name, "%s%s", groups[g].prefix, table[i].name);
            rc = gdn_hf_read_tensor(f, gdn_st_find(f, name), &table[i], groups[g].data + table[i].offset);
        }
    for (int g = 0; g < ngroups && !rc; g++) rc = check_finite(table, n, groups[g].data, path, groups[g].prefix);
    gdn_st_close(f);
    return rc;
}

/* ------------------------------------------------------------------ save */

/* Put the complete tmp_dir in place as final; an existing final is moved aside first and
 * removed only once the new one is in place. */
static int install(const char *out_dir, const char *tmp_dir, const char *final, int64_t step) {
    char aside[PATH_MAX], name[64];
    hidden_name(name, sizeof name, step, "old", (long)getpid());
    int rc = gdn_path_join(aside, sizeof aside, out_dir, name);
    if (rc) return rc;
    const int replacing = exists(final);
    if (replacing) {
        remove_tree(aside); /* an earlier failed save of this process */
        if (rename(final, aside) != 0)
            return gdn_fail(GDN_ERR_IO, "%s: cannot move the existing checkpoint aside to %s: %s",
                            final, aside, strerror(errno));
        fsync_dir(out_dir);
        test_hook(2);
    }
    if (rename(tmp_dir, final) != 0) {
        const int err = errno;
        if (replacing && rename(aside, final) == 0) fsync_dir(out_dir);
        return gdn_fail(GDN_ERR_IO, "%s: cannot rename %s into place: %s", final, tmp_dir,
                        strerror(err));
    }
    const int err = fsync_dir(out_dir);
    if (err) return gdn_fail(GDN_ERR_IO, "%s: renamed into place, but fsync of %s failed: %s", final,
                             out_dir, strerror(err));
    if (replacing) {
        test_hook(3);
        const int gone = remove_tree(aside);
        if (gone)
            return gdn_fail(GDN_ERR_IO, "%s written, but the replaced copy %s could not be removed: %s",
                            final, aside, strerror(gone));
    }
    return GDN_OK;
}

/* The run a checkpoint belongs to: trainer_state.json's "run_id" into id (capacity n); "" for a
 * checkpoint from before run ids (or without a trainer state: transformers' own). */
static void run_of(const char *ckpt_dir, char *id, size_t n) {
    char path[PATH_MAX];
    id[0] = 0;
    if (gdn_path_join(path, sizeof path, ckpt_dir, STATE_FILE)) return;
    json_t *j = json_load_file(path, 0, NULL);
    const char *v = json_string_value(json_object_get(j, "run_id"));
    if (v) snprintf(id, n, "%s", v);
    json_decref(j);
}

/* The run id a trainer state (JSON text) names ("" none). */
static void run_in_state(const char *state_json, char *id, size_t n) {
    json_t *j = json_loads(state_json, JSON_DECODE_ANY, NULL);
    const char *v = json_string_value(json_object_get(j, "run_id"));
    snprintf(id, n, "%s", v ? v : "");
    json_decref(j);
}

int gdn_ckpt_other_run(const char *out_dir, const char *run_id, char *found, size_t n) {
    if (!out_dir || !run_id || !found || !n) return gdn_fail(GDN_ERR_ARG, "checkpoint other run: NULL argument");
    found[0] = 0;
    struct stat st;
    if (stat(out_dir, &st) != 0) return GDN_OK; /* nothing there yet */
    found_ckpt *list = NULL;
    int count = 0;
    int rc = list_checkpoints(out_dir, &list, &count);
    char path[PATH_MAX], id[128];
    for (int i = 0; !rc && i < count && !found[0]; i++) {
        if ((rc = gdn_path_join(path, sizeof path, out_dir, list[i].name))) break;
        run_of(path, id, sizeof id);
        if (strcmp(id, run_id)) snprintf(found, n, "%s (run %s)", list[i].name, id[0] ? id : "without a run_id");
    }
    free(list);
    return rc;
}

static int by_step_descending(const void *a, const void *b) {
    const found_ckpt *x = a, *y = b;
    return x->step < y->step ? 1 : x->step > y->step ? -1 : 0;
}

/* Remove all but the keep_last newest complete checkpoints of run run_id (never another run's):
 * each is renamed out of the readers' sight first, so an interrupted removal never leaves a half
 * checkpoint under a real name. */
static int prune(const char *out_dir, int keep_last, const char *run_id) {
    found_ckpt *list = NULL;
    int n = 0;
    int rc = list_checkpoints(out_dir, &list, &n);
    if (rc) return rc;
    qsort(list, (size_t)n, sizeof *list, by_step_descending);
    char from[PATH_MAX], to[PATH_MAX], name[64], id[128];
    int mine = 0;
    for (int i = 0; i < n && !rc; i++) {
        if ((rc = gdn_path_join(from, sizeof from, out_dir, list[i].name))) break;
        run_of(from, id, sizeof id);
        if (strcmp(id, run_id) || ++mine <= keep_last) continue;
        if (list[i].aside) continue; /* only possible for a step we did not just write */
        hidden_name(name, sizeof name, list[i].step, "del", (long)getpid());
        rc = gdn_path_join(from, sizeof from, out_dir, list[i].name);
        if (!rc) rc = gdn_path_join(to, sizeof to, out_dir, name);
        if (rc) break;
        if (rename(from, to) != 0) {
            rc = gdn_fail(GDN_ERR_IO, "%s: cannot remove this old checkpoint (keeping the newest %d): "
                          "%s", from, keep_last, strerror(errno));
            break;
        }
        const int err = remove_tree(to);
        if (err)
            rc = gdn_fail(GDN_ERR_IO, "%s: cannot remove this old checkpoint (keeping the newest %d): "
                          "%s", to, keep_last, strerror(err));
    }
    free(list);
    if (!rc) fsync_dir(out_dir);
    return rc;
}

int gdn_ckpt_save(const char *out_dir, int64_t step, const gdn_model_config *cfg, const float *w,
                  const float *adam_m, const float *adam_v, const char *state_json, int keep_last,
                  int weight_dtype) {
    if (!out_dir || !cfg || !w || (adam_m && !adam_v) || (!adam_m && adam_v))
        return gdn_fail(GDN_ERR_ARG, "checkpoint save: NULL argument (the moments: both or neither)");
    if (cfg->ep_size > 1)
        return gdn_fail(GDN_ERR_ARG, "checkpoint save: the config holds slice %lld of %lld of the experts; a checkpoint "
                        "holds every expert (gather the slices into the whole layout, ep_size 0, or write each "
                        "slice with gdn_ckpt_parts_write)", (long long)cfg->ep_rank, (long long)cfg->ep_size);
    gdn_ckpt_parts p;
    int rc = gdn_ckpt_parts_begin(&p, out_dir, step, cfg, adam_m != NULL, weight_dtype);
    if (rc) return rc;
    rc = gdn_ckpt_parts_write(&p, cfg, 0, gdn_model_param_floats(cfg), w, adam_m, adam_v);
    if (rc) {
        gdn_ckpt_parts_abort(&p);
        return rc;
    }
    return gdn_ckpt_parts_finish(&p, state_json, keep_last);
}

/* ------------------------------------------------------------------ resolve and load */

/* What a directory with no complete checkpoint lacks: one of its two files present and the other
 * missing or not a regular file (a directory, a FIFO, a device) is named; neither, the layout is. */
static int why_incomplete(const char *dir) {
    /* the weights: model.safetensors, or a sharded checkpoint's index in its place */
    const char *names[2] = {CONFIG_FILE, MODEL_FILE};
    char p[PATH_MAX];
    struct stat st[2];
    int found[2], regular[2];
    for (int i = 0; i < 2; i++) {
        found[i] = !gdn_path_join(p, sizeof p, dir, names[i]) && stat(p, &st[i]) == 0;
        regular[i] = found[i] && S_ISREG(st[i].st_mode);
    }
    if (!found[1] && !gdn_path_join(p, sizeof p, dir, MODEL_FILE ".index.json") && stat(p, &st[1]) == 0)
        names[1] = MODEL_FILE ".index.json", found[1] = 1, regular[1] = S_ISREG(st[1].st_mode);
    if (!found[0] && !found[1])
        return gdn_fail(GDN_ERR_MISSING, "%s: no complete checkpoint (neither %s nor %s here, nor a "
                        "checkpoint-N directory holding them)", dir, CONFIG_FILE, MODEL_FILE);
    /* the file at fault: one that is there but not a regular file, else the one missing */
    const int bad = found[0] && !regular[0] ? 0 : found[1] && !regular[1] ? 1 : !found[0] ? 0 : 1;
    if (!found[bad])
        return gdn_fail(GDN_ERR_MISSING, "%s: no complete checkpoint: %s is here but %s is missing (a checkpoint "
                        "holds both)", dir, names[!bad], names[bad]);
    return gdn_fail(GDN_ERR_IO, "%s: no complete checkpoint: %s is %s, not a regular file", dir, names[bad],
                    gdn_file_kind(st[bad].st_mode));
}

/* A training directory whose newest checkpoint-N is incomplete (a file lost or damaged after it was
 * written: an interrupted save never shows under that name): said in the note, beside the one used. */
static void note_skipped(const char *path, int64_t used_step, const char *used) {
    DIR *d = opendir(path);
    if (!d) return;
    int64_t newest = -1;
    char name[256] = "", full[PATH_MAX];
    for (struct dirent *e; (e = readdir(d));) {
        int64_t step;
        long pid;
        if (classify(e->d_name, &step, &pid) != ENTRY_PRIMARY || step <= used_step || step <= newest) continue;
        if (gdn_path_join(full, sizeof full, path, e->d_name) || is_complete(full)) continue;
        newest = step;
        snprintf(name, sizeof name, "%s", e->d_name);
    }
    closedir(d);
    if (newest < 0) return;
    char note[2 * PATH_MAX + 256];
    if (gdn_path_join(full, sizeof full, path, name)) return;
    why_incomplete(full); /* (its message, not a failure of this call) */
    snprintf(note, sizeof note, "%s; using %s, the newest complete checkpoint in %s", gdn_errmsg(), used, path);
    gdn_ckpt_resolve_note(note);
}

int gdn_ckpt_resolve(const char *path, char *dir, size_t n) {
    gdn_ckpt_resolve_note(NULL);
    if (!path || !dir || !n) return gdn_fail(GDN_ERR_ARG, "checkpoint resolve: NULL argument");
    struct stat st;
    if (stat(path, &st) != 0)
        return gdn_fail(GDN_ERR_IO, "%s: no such checkpoint or output directory: %s", path,
                        strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return gdn_fail(GDN_ERR_IO, "%s: not a directory (%s); give a checkpoint directory or a "
                        "training output directory", path,
                        S_ISREG(st.st_mode) ? "a regular file" : gdn_file_kind(st.st_mode));
    if (is_complete(path)) {
        if ((size_t)snprintf(dir, n, "%s", path) >= n)
            return gdn_fail(GDN_ERR_ARG, "%s: path too long", path);
        return GDN_OK;
    }
    found_ckpt *list = NULL;
    int count = 0;
    int rc = list_checkpoints(path, &list, &count);
    if (rc) return rc;
    int best = -1;
    for (int i = 0; i < count; i++)
        if (best < 0 || list[i].step > list[best].step ||
            (list[i].step == list[best].step && !list[i].aside))
            best = i;
    if (best < 0) rc = why_incomplete(path);
    else if ((size_t)snprintf(dir, n, "%s/%s", path, list[best].name) >= n)
        rc = gdn_fail(GDN_ERR_ARG, "%s/%s: path too long", path, list[best].name);
    if (!rc) note_skipped(path, list[best].step, list[best].name);
    free(list);
    return rc;
}

/* A whole small text file, malloc'd and NUL-terminated. */
static int read_text(const char *path, char **out) {
    struct stat st;
    if (stat(path, &st) != 0) return gdn_fail(GDN_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return gdn_fail(GDN_ERR_IO, "%s: not a regular file (%s)", path, gdn_file_kind(st.st_mode));
    if (st.st_size > MAX_STATE_BYTES)
        return gdn_fail(GDN_ERR_FORMAT, "%s: %lld bytes, more than a trainer state can be (%lld)", path,
                        (long long)st.st_size, (long long)MAX_STATE_BYTES);
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return gdn_fail(GDN_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    char *text = gdn_malloc("checkpoint: text", (size_t)st.st_size + 1);
    if (!text) {
        close(fd);
        return gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate %lld bytes", path, (long long)st.st_size);
    }
    size_t done = 0;
    int err = 0;
    while (done < (size_t)st.st_size) {
        const ssize_t k = read(fd, text + done, (size_t)st.st_size - done);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            err = k < 0 ? errno : EIO;
            break;
        }
        done += (size_t)k;
    }
    close(fd);
    text[done] = 0;
    if (err) {
        free(text);
        return gdn_fail(GDN_ERR_IO, "%s: read failed: %s", path, strerror(err));
    }
    const size_t nul = strlen(text);
    if (nul != done) {
        free(text);
        return gdn_fail(GDN_ERR_FORMAT, "%s: holds a NUL byte at offset %zu; not JSON text", path, nul);
    }
    *out = text;
    return GDN_OK;
}

/* The optimizer file `path` into the moments; when it also holds the fp32 master weights (a BF16
 * save), they replace w, which must be their rounding bit for bit (else the two files come from
 * different saves, and neither is trusted). */
static int read_moments(const char *dir, const char *path, const gdn_model_config *cfg,
                        const gdn_model_tensor_info *table, int n, float *w, float *adam_m, float *adam_v) {
    gdn_st_file *f = NULL;
    int rc = gdn_st_open(&f, path);
    if (rc) return rc;
    char name[sizeof table->name + 32];
    snprintf(name, sizeof name, MASTER_PREFIX "%s", table[0].name);
    const int masters = gdn_st_find(f, name) != NULL;
    gdn_st_close(f);
    const size_t nw = gdn_model_param_floats(cfg);
    float *master = masters ? gdn_malloc("checkpoint: master", sizeof(float) * nw) : NULL;
    if (masters && !master) return gdn_fail(GDN_ERR_NOMEM, "%s: the master weights (%zu floats)", path, nw);
    if (master) memcpy(master, w, sizeof(float) * nw); /* (padding between tensors kept) */
    const tensor_group groups[3] = {{"exp_avg.", adam_m}, {"exp_avg_sq.", adam_v}, {MASTER_PREFIX, master}};
    rc = read_tensors(path, table, n, groups, masters ? 3 : 2);
    for (int i = 0; masters && !rc && i < n; i++)
        for (size_t e = 0; e < table[i].numel && !rc; e++) {
            const size_t at = table[i].offset + e;
            const uint32_t u = (uint32_t)gdn_st_bf16(master[at]) << 16;
            float r;
            memcpy(&r, &u, sizeof r);
            if (memcmp(&r, &w[at], sizeof r))
                rc = gdn_fail(GDN_ERR_FORMAT, "%s/%s: %s[%zu] = %.9g is not the bf16 rounding of its master weight "
                              "%.9g in %s: the two files come from different saves", dir, MODEL_FILE, table[i].name,
                              e, (double)w[at], (double)master[at], path);
        }
    if (master && !rc) memcpy(w, master, sizeof(float) * nw);
    free(master);
    return rc;
}

int gdn_ckpt_load(const char *dir, const gdn_model_config *cfg, float *w, float *adam_m,
                  float *adam_v, char **state_json) {
    if (!dir || !cfg || !w || (adam_m && !adam_v) || (!adam_m && adam_v))
        return gdn_fail(GDN_ERR_ARG, "checkpoint load: NULL argument (the moments: both or neither)");
    if (state_json) *state_json = NULL;
    int rc = gdn_model_config_check(cfg);
    if (!rc) rc = gdn_hf_config_same(dir, cfg);
    if (rc) return rc;
    gdn_model_tensor_info *table = NULL;
    int n = 0;
    rc = model_table(cfg, &table, &n);
    if (rc) return rc;
    char path[PATH_MAX];
    rc = gdn_hf_read_model(dir, cfg, table, n, w);
    if (!rc) rc = gdn_path_join(path, sizeof path, dir, MODEL_FILE);
    if (!rc) rc = check_finite(table, n, w, path, "");
    if (!rc && adam_m) rc = gdn_path_join(path, sizeof path, dir, OPTIM_FILE);
    if (!rc && adam_m) {
        struct stat st;
        if (stat(path, &st) != 0)
            rc = gdn_fail(GDN_ERR_IO, "%s: the optimizer state is missing (%s): this checkpoint can "
                          "start a run (--init) but not resume one", path, strerror(errno));
        else
            rc = read_moments(dir, path, cfg, table, n, w, adam_m, adam_v);
    }
    free(table);
    if (!rc && state_json) rc = gdn_path_join(path, sizeof path, dir, STATE_FILE);
    if (!rc && state_json) rc = read_text(path, state_json);
    return rc;
}

int gdn_ckpt_load_part(const char *dir, const gdn_model_config *cfg, size_t lo, size_t hi, float *w, float *adam_m,
                       float *adam_v) {
    if (!dir || !cfg || (hi > lo && (!w || !adam_m || !adam_v)))
        return gdn_fail(GDN_ERR_ARG, "checkpoint part load: NULL argument");
    if (lo > hi || hi > gdn_model_param_floats(cfg))
        return gdn_fail(GDN_ERR_ARG, "checkpoint part load: the range [%zu, %zu) is not inside the %zu floats of the "
                        "model", lo, hi, gdn_model_param_floats(cfg));
    char path[PATH_MAX];
    int rc = gdn_path_join(path, sizeof path, dir, OPTIM_FILE);
    struct stat st;
    if (!rc && stat(path, &st) != 0)
        return gdn_fail(GDN_ERR_IO, "%s: the optimizer state is missing (%s): this checkpoint can start a run (--init) "
                        "but not resume one", path, strerror(errno));
    ckpt_layout l;
    if (!rc) rc = layout_make(cfg, &l);
    if (rc) return rc;
    gdn_st_file *f = NULL;
    rc = gdn_st_open(&f, path);
    char name[sizeof l.table->name + 32];
    snprintf(name, sizeof name, MASTER_PREFIX "%s", l.table[0].name);
    const int groups = !rc && gdn_st_find(f, name) ? 3 : 2;
    /* every tensor there with its whole shape, and nothing else: a file of this model's saves */
    for (int g = 0; g < groups && !rc; g++)
        for (int i = 0; i < l.n && !rc; i++) {
            snprintf(name, sizeof name, "%s%s", optim_prefix[g], l.table[i].name);
            const gdn_st_tensor *t = gdn_st_find(f, name);
            rc = t ? gdn_hf_check_tensor(path, t, &l.table[i])
                   : gdn_fail(GDN_ERR_MISSING, "%s: tensor '%s' is missing", path, name);
        }
    if (!rc && gdn_st_count(f) != groups * l.n)
        rc = gdn_fail(GDN_ERR_FORMAT, "%s: %d tensors where this model's optimizer state has %d: not a checkpoint of "
                      "this configuration", path, gdn_st_count(f), groups * l.n);
    enum { CHUNK = 1 << 14 };
    float master[CHUNK];
    for (int i = 0; i < l.n && !rc; i++) {
        size_t k0, k1;
        part_of(&l.local[i], lo, hi, &k0, &k1);
        const uint64_t shift = expert_shift(&l, i);
        float *const dst[2] = {adam_m + (l.local[i].offset + k0 - lo), adam_v + (l.local[i].offset + k0 - lo)};
        for (int g = 0; g < 2 && k0 < k1 && !rc; g++) {
            snprintf(name, sizeof name, "%s%s", optim_prefix[g], l.table[i].name);
            rc = gdn_st_read_span(f, name, dst[g], (int64_t)(shift + k0), (int64_t)(k1 - k0));
            const int64_t bad = rc ? -1 : gdn_find_nonfinite_f32(dst[g], (int64_t)(k1 - k0), 1);
            if (bad >= 0)
                rc = gdn_fail(GDN_ERR_NONFINITE, "%s: tensor '%s' holds %g at element %llu", path, name,
                              (double)dst[g][bad], (unsigned long long)(shift + k0 + (uint64_t)bad));
        }
        snprintf(name, sizeof name, MASTER_PREFIX "%s", l.table[i].name);
        for (size_t c = k0; groups == 3 && c < k1 && !rc; c += CHUNK) {
            const size_t ne = k1 - c < CHUNK ? k1 - c : CHUNK;
            float *wi = w + (l.local[i].offset + c - lo);
            rc = gdn_st_read_span(f, name, master, (int64_t)(shift + c), (int64_t)ne);
            for (size_t e = 0; e < ne && !rc; e++) {
                const uint32_t u = (uint32_t)gdn_st_bf16(master[e]) << 16;
                float r;
                memcpy(&r, &u, sizeof r);
                if (!isfinite(master[e]))
                    rc = gdn_fail(GDN_ERR_NONFINITE, "%s: tensor '%s' holds %g at element %llu", path, name,
                                  (double)master[e], (unsigned long long)(shift + c + e));
                else if (memcmp(&r, &wi[e], sizeof r))
                    rc = gdn_fail(GDN_ERR_FORMAT, "%s/%s: %s[%llu] = %.9g is not the bf16 rounding of its master weight "
                                  "%.9g in %s: the two files come from different saves", dir, MODEL_FILE, l.table[i].name,
                                  (unsigned long long)(shift + c + e), (double)wi[e], (double)master[e], path);
            }
            if (!rc) memcpy(wi, master, sizeof(float) * ne);
        }
    }
    gdn_st_close(f);
    layout_free(&l);
    return rc;
}

/* dir/trainer_state.json parsed into *j (path: its name), or *j NULL when the directory has none
 * (not a gdncp training checkpoint, e.g. transformers'). */
static int read_state(const char *dir, char path[4096], json_t **j) {
    *j = NULL;
    int rc = gdn_path_join(path, 4096, dir, STATE_FILE);
    struct stat st;
    if (rc || stat(path, &st) != 0) return rc;
    char *text = NULL;
    if ((rc = read_text(path, &text))) return rc;
    json_error_t err;
    *j = json_loads(text, 0, &err);
    free(text);
    return *j ? GDN_OK : gdn_fail(GDN_ERR_FORMAT, "%s: %s (line %d)", path, err.text, err.line);
}

int gdn_ckpt_pack_separator(const char *dir, uint8_t *sep, int cap, int *len, int64_t *id) {
    if (!dir || !sep || !len || cap < 1) return gdn_fail(GDN_ERR_ARG, "checkpoint separator: NULL argument");
    *len = 0;
    if (id) *id = -1;
    char path[4096];
    json_t *j;
    int rc = read_state(dir, path, &j);
    if (rc || !j) return rc; /* not a gdncp training checkpoint: not packed */
    json_t *v = json_object_get(j, "pack_separator_id");
    if (id && v && !(json_is_integer(v) && json_integer_value(v) >= -1 && json_integer_value(v) < GDN_MODEL_MAX_VOCAB))
        rc = gdn_fail(GDN_ERR_FORMAT, "%s: pack_separator_id is not an integer in [-1, %lld)", path,
                      (long long)GDN_MODEL_MAX_VOCAB);
    else if (id && v)
        *id = (int64_t)json_integer_value(v);
    const char *hex = json_string_value(json_object_get(j, "pack_separator_hex"));
    const size_t n = hex ? strlen(hex) : 0;
    if (!rc && (n % 2 || n / 2 > (size_t)cap))
        rc = gdn_fail(GDN_ERR_FORMAT, "%s: pack_separator_hex '%s' is not 1 to %d bytes of hex", path, hex, cap);
    for (size_t i = 0; !rc && i < n / 2; i++) {
        unsigned byte;
        if (!isxdigit((unsigned char)hex[2 * i]) || !isxdigit((unsigned char)hex[2 * i + 1]) ||
            sscanf(hex + 2 * i, "%2x", &byte) != 1)
            rc = gdn_fail(GDN_ERR_FORMAT, "%s: pack_separator_hex '%s' is not hex", path, hex);
        else
            sep[i] = (uint8_t)byte;
    }
    if (!rc) *len = (int)(n / 2);
    json_decref(j);
    return rc;
}

