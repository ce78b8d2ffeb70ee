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

/* Write the groups' tensors as one F32 safetensors file at path: the project's writer lays out
 * the header and the temporary file; the bytes come straight from the arrays. */
static int write_tensors(const char *path, const gdn_model_tensor_info *table, int n,
                         const tensor_group *groups, int ngroups, int dtype) {
    const size_t esz = dtype == GDN_BF16 ? 2 : 4;
    enum { CHUNK = 1 << 16 };
    uint16_t *half = dtype == GDN_BF16 ? gdn_malloc("checkpoint: half", sizeof(uint16_t) * CHUNK) : NULL;
    if (dtype == GDN_BF16 && !half) return gdn_fail(GDN_ERR_NOMEM, "%s: a conversion buffer", path);
    gdn_st_writer *wr = NULL;
    int rc = gdn_st_writer_create(&wr);
    if (!rc) rc = gdn_st_writer_metadata(wr, "format", "pt");
    char name[sizeof table->name + 32];
    for (int g = 0; g < ngroups && !rc; g++)
        for (int i = 0; i < n && !rc; i++) {
            snprintf(name, sizeof name, "%s%s", groups[g].prefix, table[i].name);
            rc = gdn_st_writer_add_f32(wr, name, (gdn_dtype)dtype, table[i].ndim, table[i].shape, NULL);
        }
    /* The writer stores tensors in the order added, back to back after the header. */
    uint64_t offset = 0;
    if (!rc) {
        snprintf(name, sizeof name, "%s%s", groups[0].prefix, table[0].name);
        rc = gdn_st_writer_offset(wr, name, &offset);
    }
    char tmp[PATH_MAX + 32];
    if (!rc) rc = gdn_st_writer_begin(wr, path, tmp, sizeof tmp);
    gdn_st_writer_destroy(wr);
    if (rc) {
        free(half);
        return rc;
    }
    /* the mistake of a writer that confuses its dtypes: F32 tensors written rounded to bfloat16
     * (a test mutation: the save-and-load checks must see it) */
    float *rounded = !half && gdn_test_mutate("ckpt save: F32 tensors written rounded to bfloat16")
                         ? gdn_malloc("ckpt save: the rounded chunk (a test mutation)", sizeof(float) * CHUNK)
                         : NULL;
    const int chunked = half || rounded;
    const int fd = open(tmp, O_WRONLY | O_CLOEXEC);
    int err = fd < 0 ? errno : 0;
    for (int g = 0; g < ngroups && !err; g++)
        for (int i = 0; i < n && !err; i++) {
            const float *src = groups[g].data + table[i].offset;
            /* F32: the floats as they are; BF16: rounded a chunk at a time */
            for (size_t e0 = 0; e0 < table[i].numel && !err; e0 += chunked ? CHUNK : table[i].numel) {
                const size_t ne = chunked && table[i].numel - e0 > CHUNK ? CHUNK : table[i].numel - e0;
                if (half)
                    for (size_t e = 0; e < ne; e++) half[e] = gdn_st_bf16(src[e0 + e]);
                if (rounded)
                    for (size_t e = 0; e < ne; e++) {
                        const uint32_t u = (uint32_t)gdn_st_bf16(src[e0 + e]) << 16;
                        memcpy(rounded + e, &u, sizeof u);
                    }
                const char *bytes = half ? (const char *)half : rounded ? (const char *)rounded : (const char *)src;
                const size_t len = ne * esz;
                for (size_t done = 0; done < len && !err;) {
                    const ssize_t k = pwrite(fd, bytes + done, len - done, (off_t)(offset + done));
                    if (k < 0 && errno == EINTR) continue;
                    if (k <= 0) err = k < 0 ? errno : EIO;
                    else done += (size_t)k;
                }
                offset += len;
            }
        }
    free(half), free(rounded);
    struct stat st;
    if (!err && fstat(fd, &st) != 0) err = errno;
    if (!err && (uint64_t)st.st_size != offset) err = EFBIG; /* layout assumption broken */
    if (!err && fsync(fd) != 0) err = errno;
    if (fd >= 0 && close(fd) != 0 && !err) err = errno;
    if (err) {
        unlink(tmp);
        return gdn_fail(GDN_ERR_IO, "%s: writing the tensors failed: %s", path, strerror(err));
    }
    return gdn_st_commit(tmp, path);
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

/* Build the checkpoint's files in tmp_dir. */
static int write_files(const char *tmp_dir, const gdn_model_config *cfg,
                       const gdn_model_tensor_info *table, int n, const float *w,
                       const float *adam_m, const float *adam_v, const char *state_json, int weight_dtype) {
    char path[PATH_MAX];
    int rc = gdn_path_join(path, sizeof path, tmp_dir, CONFIG_FILE);
    char *text = NULL;
    if (!rc) rc = gdn_hf_config_text(cfg, weight_dtype, &text);
    if (!rc) rc = write_synced(path, text, strlen(text));
    free(text);
    const tensor_group model[1] = {{"", (float *)w}};
    if (!rc) rc = gdn_path_join(path, sizeof path, tmp_dir, MODEL_FILE);
    if (!rc) rc = write_tensors(path, table, n, model, 1, weight_dtype);
    /* the optimizer file: the moments, and beside BF16 weights the fp32 masters they round */
    const tensor_group moments[3] = {{"exp_avg.", (float *)adam_m}, {"exp_avg_sq.", (float *)adam_v},
                                     {MASTER_PREFIX, (float *)w}};
    if (!rc && adam_m) rc = gdn_path_join(path, sizeof path, tmp_dir, OPTIM_FILE);
    if (!rc && adam_m) rc = write_tensors(path, table, n, moments, weight_dtype == GDN_BF16 ? 3 : 2, GDN_F32);
    if (!rc) rc = gdn_path_join(path, sizeof path, tmp_dir, STATE_FILE);
    if (!rc) rc = write_synced(path, state_json, strlen(state_json));
    if (!rc) {
        const int err = fsync_dir(tmp_dir);
        if (err) rc = gdn_fail(GDN_ERR_IO, "%s: fsync failed: %s", tmp_dir, strerror(err));
    }
    return rc;
}

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

static int by_step_descending(const void *a, const void *b) {
    const found_ckpt *x = a, *y = b;
    return x->step < y->step ? 1 : x->step > y->step ? -1 : 0;
}

/* Remove all but the keep_last newest complete checkpoints: each is renamed out of the readers'
 * sight first, so an interrupted removal never leaves a half checkpoint under a real name. */
static int prune(const char *out_dir, int keep_last) {
    found_ckpt *list = NULL;
    int n = 0;
    int rc = list_checkpoints(out_dir, &list, &n);
    if (rc) return rc;
    qsort(list, (size_t)n, sizeof *list, by_step_descending);
    char from[PATH_MAX], to[PATH_MAX], name[64];
    for (int i = keep_last; i < n && !rc; i++) {
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
    if (weight_dtype != GDN_F32 && weight_dtype != GDN_BF16)
        return gdn_fail(GDN_ERR_ARG, "checkpoint save: weight dtype %d is neither F32 (0) nor BF16 (2)", weight_dtype);
    if (step < 0) return gdn_fail(GDN_ERR_ARG, "checkpoint save: step %lld is negative", (long long)step);
    if (cfg->ep_size > 1)
        return gdn_fail(GDN_ERR_ARG, "checkpoint save: the config holds slice %lld of %lld of the experts; a checkpoint "
                        "holds every expert (gather the slices into the whole layout, ep_size 0)",
                        (long long)cfg->ep_rank, (long long)cfg->ep_size);
    int rc = gdn_model_config_check(cfg);
    if (rc) return rc;
    if (!state_json) state_json = "{}";
    json_error_t jerr;
    json_t *state = json_loads(state_json, JSON_DECODE_ANY, &jerr);
    if (!state)
        return gdn_fail(GDN_ERR_ARG, "checkpoint save: the trainer state is not JSON (line %d column "
                        "%d: %s)", jerr.line, jerr.column, jerr.text);
    json_decref(state);

    gdn_model_tensor_info *table = NULL;
    int n = 0;
    rc = model_table(cfg, &table, &n);
    if (!rc) rc = check_finite(table, n, w, "refusing to save a checkpoint", "");
    if (!rc && adam_m) rc = check_finite(table, n, adam_m, "refusing to save a checkpoint", "exp_avg.");
    if (!rc && adam_m) rc = check_finite(table, n, adam_v, "refusing to save a checkpoint", "exp_avg_sq.");
    if (rc) {
        free(table);
        return rc;
    }

    /* One level only: a missing parent is more likely a typo than a wish. */
    struct stat st;
    const int made = mkdir(out_dir, 0755) == 0 ? 0 : errno;
    if (made && made != EEXIST) {
        rc = gdn_fail(GDN_ERR_IO, "%s: cannot create the output directory: %s%s", out_dir,
                      strerror(made), made == ENOENT ? " (its parent directory does not exist)" : "");
    } else if (stat(out_dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        rc = gdn_fail(GDN_ERR_IO, "%s: the output path exists and is not a directory", out_dir);
    }
    char tmp_dir[PATH_MAX], final[PATH_MAX], name[64];
    if (!rc) {
        clean_leftovers(out_dir);
        hidden_name(name, sizeof name, step, "tmp", (long)getpid());
        rc = gdn_path_join(tmp_dir, sizeof tmp_dir, out_dir, name);
    }
    if (!rc) {
        primary_name(name, sizeof name, step);
        rc = gdn_path_join(final, sizeof final, out_dir, name);
    }
    if (!rc) {
        remove_tree(tmp_dir);
        if (mkdir(tmp_dir, 0755) != 0)
            rc = gdn_fail(GDN_ERR_IO, "%s: cannot create the temporary directory: %s", tmp_dir,
                          strerror(errno));
        else
            rc = write_files(tmp_dir, cfg, table, n, w, adam_m, adam_v, state_json, weight_dtype);
        if (!rc) {
            test_hook(1);
            rc = install(out_dir, tmp_dir, final, step);
        }
        if (rc) remove_tree(tmp_dir); /* the previous checkpoints are untouched */
    }
    free(table);
    if (!rc && keep_last > 0) rc = prune(out_dir, keep_last);
    return rc;
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

int gdn_ckpt_resolve(const char *path, char *dir, size_t n) {
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

