/* safetensors round trips (F32, F64, BF16), metadata, atomic replacement, signals during a save. */
#include "harness.h"

#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* The CLI's handler (tools/main.c), for the children below: the library's temporaries go, then
 * the signal does what it did before (SA_RESETHAND). */
static void cli_like_handler(int sig) {
    gdn_st_remove_temporaries();
    raise(sig);
}
static int point_signal;      /* raised at the library's test point (gdn_test_point) */
static const char *point_site; /* ... of this name */
static struct sigaction during; /* SIGTERM's disposition seen at the point */
static void at_point(const char *site) {
    if (point_site && strcmp(site, point_site)) return;
    sigaction(SIGTERM, NULL, &during);
    if (point_signal) raise(point_signal);
}

/* Whole contents of a file (NULL when unreadable); *n its size. */
static unsigned char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(len > 0 ? (size_t)len : 1);
    *n = b ? fread(b, 1, (size_t)len, f) : 0;
    fclose(f);
    return b;
}

/* Number of entries in dir other than . and the file `keep`. */
static int other_entries(const char *dir, const char *keep) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, keep);
    if (d) closedir(d);
    return n;
}

/* The library installs no signal handlers: SIGTERM's disposition is the same before, during
 * (seen at the library's test point, with the temporary file in place) and after a save. A
 * program that handles SIGINT/SIGTERM the way the CLI does (gdn_st_remove_temporaries, then the
 * default action) and is signalled mid-write, in gdn_st_writer_save or between
 * gdn_st_writer_begin and gdn_st_commit (the parallel writer), dies of the signal leaving the old
 * output's bytes and no temporary file. Control: without a signal the save replaces the file. */
static void signal_during_save(void) {
    char dir[] = "/tmp/gdncp_sig_XXXXXX", path[64];
    if (!mkdtemp(dir)) {
        check(0, "mkdtemp for the signal test");
        return;
    }
    snprintf(path, sizeof path, "%s/out.safetensors", dir);
    enum { N = 1 << 18 };
    float *x = malloc(sizeof(float) * N);
    for (int i = 0; i < N; i++) x[i] = (float)i;
    const int64_t shape_old[1] = {1000}, shape_new[1] = {N};
    gdn_st_writer *w;
    gdn_st_writer_create(&w);
    gdn_st_writer_add_f32(w, "old", GDN_F32, 1, shape_old, x);
    int rc = gdn_st_writer_save(w, path);
    gdn_st_writer_destroy(w);
    check(rc == GDN_OK, "signal test: the previous output written");
    size_t n_old = 0, n_now = 0;
    unsigned char *old = slurp(path, &n_old);
    gdn_st_writer_create(&w);
    gdn_st_writer_add_f32(w, "new", GDN_F32, 1, shape_new, x);
    /* dispositions: a save in this process, observed before, at the test point, after */
    struct sigaction before, after;
    sigaction(SIGTERM, NULL, &before);
    memset(&during, 0, sizeof during);
    point_site = "st save: data", point_signal = 0, test_point_action = at_point;
    rc = gdn_st_writer_save(w, path);
    test_point_action = NULL;
    sigaction(SIGTERM, NULL, &after);
    check(rc == GDN_OK && during.sa_handler == before.sa_handler && after.sa_handler == before.sa_handler &&
              during.sa_flags == before.sa_flags,
          "gdn_st_writer_save leaves SIGTERM's disposition alone (before %p, during the write %p, after %p)",
          (void *)before.sa_handler, (void *)during.sa_handler, (void *)after.sa_handler);
    /* put the old file back for the signalled writes */
    FILE *fo = fopen(path, "wb");
    if (fo) fwrite(old, 1, n_old, fo), fclose(fo);
    for (int which = 0; which < 3; which++) {
        const int sig = which == 1 ? SIGINT : SIGTERM;
        const char *how = which == 0 ? "SIGTERM during gdn_st_writer_save" : which == 1 ? "SIGINT during gdn_st_writer_save"
                                                                                   : "SIGTERM between gdn_st_writer_begin and gdn_st_commit";
        fflush(stdout), fflush(stderr);
        pid_t pid = fork();
        if (pid == 0) {
            struct sigaction sa;
            memset(&sa, 0, sizeof sa);
            sa.sa_handler = cli_like_handler;
            sigemptyset(&sa.sa_mask);
            sa.sa_flags = SA_RESETHAND;
            sigaction(sig, &sa, NULL);
            point_signal = sig, test_point_action = at_point;
            if (which < 2) {
                point_site = "st save: data";
                gdn_st_writer_save(w, path);
            } else {
                char tmp[256];
                point_site = "st begin: created";
                if (!gdn_st_writer_begin(w, path, tmp, sizeof tmp)) gdn_st_commit(tmp, path);
            }
            _exit(0); /* not reached: the signal kills the child */
        }
        int st = 0;
        waitpid(pid, &st, 0);
        check(WIFSIGNALED(st) && WTERMSIG(st) == sig, "%s kills the process as before (status 0x%x)", how, st);
        check(other_entries(dir, "out.safetensors") == 0, "%s: no temporary file left in %s", how, dir);
        unsigned char *now = slurp(path, &n_now);
        check(old && now && n_now == n_old && !memcmp(old, now, n_old), "%s: the old file's %zu bytes unchanged", how,
              n_old);
        free(now);
    }
    /* Negative control: no handler (the default action), so nothing removes the temporary file,
     * and the check above sees it. */
    fflush(stdout), fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGTERM, SIG_DFL);
        point_site = "st save: data", point_signal = SIGTERM, test_point_action = at_point;
        gdn_st_writer_save(w, path);
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    const int left = other_entries(dir, "out.safetensors");
    check(WIFSIGNALED(st) && left == 1, "negative control: SIGTERM mid-write without the handler leaves %d temporary "
          "file(s), want 1", left);
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d));)
        if (strstr(e->d_name, ".tmp.")) {
            char p2[512];
            snprintf(p2, sizeof p2, "%s/%s", dir, e->d_name);
            unlink(p2);
        }
    if (d) closedir(d);
    /* Control: without a signal the same save replaces the file. */
    rc = gdn_st_writer_save(w, path);
    unsigned char *now = slurp(path, &n_now);
    check(rc == GDN_OK && now && n_now > (size_t)4 * N && other_entries(dir, "out.safetensors") == 0,
          "control: a save without a signal replaces the file (%zu bytes), no temporary file left", n_now);
    free(now), free(old);
    gdn_st_writer_destroy(w);
    free(x);
    unlink(path);
    rmdir(dir);
}

/* Row slices whose begin + count would wrap past INT64_MAX are refused as out of range (the
 * check used to add them first); the controls, slices inside the tensor (and an empty one at
 * its end), read the right values. */
static void rows_overflow(void) {
    char path[] = "/tmp/gdncp_rows_XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) {
        check(0, "mkstemp for the row-slice test");
        return;
    }
    close(fd);
    float x[24], got[24];
    for (int i = 0; i < 24; i++) x[i] = (float)i;
    const int64_t shape[3] = {2, 4, 3};
    gdn_st_writer *w;
    gdn_st_writer_create(&w);
    gdn_st_writer_add_f32(w, "x", GDN_F32, 3, shape, x);
    int rc = gdn_st_writer_save(w, path);
    gdn_st_writer_destroy(w);
    gdn_st_file *f = NULL;
    if (!rc) rc = gdn_st_open(&f, path);
    check(rc == GDN_OK, "row-slice test file written and opened");
    if (rc) return;
    const struct { int64_t begin, count; } bad[] = {{INT64_MAX - 1, 4}, {1, INT64_MAX}, {INT64_MAX, INT64_MAX},
                                                    {3, INT64_MAX - 2}, {4, 1}, {-1, 2}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_status(gdn_st_read_f32_rows(f, "x", got, 24, bad[i].begin, bad[i].count), GDN_ERR_SHAPE, "has no rows",
                      "rows [%lld, %lld + %lld) of a [2, 4, 3] tensor", (long long)bad[i].begin, (long long)bad[i].begin,
                      (long long)bad[i].count);
    rc = gdn_st_read_f32_rows(f, "x", got, 24, 1, 2);
    check(rc == GDN_OK && got[0] == 3 && got[5] == 8 && got[6] == 15 && got[11] == 20,
          "control: rows [1, 3) of a [2, 4, 3] tensor read (%s)", rc ? gdn_errmsg() : "ok");
    expect_status(gdn_st_read_f32_rows(f, "x", got, 24, 4, 0), GDN_OK, NULL, "control: the empty slice [4, 4)");
    gdn_st_close(f);
    unlink(path);
}

void test_safetensors(void) {
    rows_overflow();
    char path[] = "/tmp/gdncp_st_XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    const int64_t shape[3] = {2, 3, 5};
    float x[30];
    double xd[30];
    for (int i = 0; i < 30; i++) x[i] = (float)(sin(i * 1.7) * pow(10.0, i % 7 - 3)), xd[i] = x[i] * (1.0 + 1e-12);
    gdn_st_writer *w;
    gdn_st_writer_create(&w);
    gdn_st_writer_metadata(w, "who", "gdncp test");
    gdn_st_writer_add_f32(w, "a32", GDN_F32, 3, shape, x);
    gdn_st_writer_add_f32(w, "a16", GDN_BF16, 3, shape, x);
    /* the negative control's tensor: the same BF16 write given a source one element off */
    float xs[30];
    for (int i = 0; i < 30; i++) xs[i] = x[(i + 1) % 30];
    gdn_st_writer_add_f32(w, "a16s", GDN_BF16, 3, shape, xs);
    gdn_st_writer_add_f64(w, "a64", GDN_F64, 3, shape, xd);
    gdn_st_writer_add_f32(w, "scalar", GDN_F32, 0, NULL, x);
    int rc = gdn_st_writer_save(w, path);
    gdn_st_writer_destroy(w);
    check(rc == GDN_OK, "write F32/BF16/F64 tensors and metadata");

    gdn_st_file *f = NULL;
    rc = gdn_st_open(&f, path);
    check(rc == GDN_OK && gdn_st_count(f) == 5, "reopen: 5 tensors");
    if (rc == GDN_OK) { /* gdn_st_at ends the walk with NULL where gdn_st_count (now internal) says */
        int walked = 0;
        while (gdn_st_at(f, walked)) walked++;
        check(walked == 5 && walked == gdn_st_count(f) && !gdn_st_at(f, 5) && !gdn_st_at(f, 6) && !gdn_st_at(f, -1) &&
                  gdn_st_at(f, 4) && gdn_st_find(f, gdn_st_at(f, 4)->name) == gdn_st_at(f, 4),
              "gdn_st_at: tensors 0..4 then NULL (past the end, and for -1), as gdn_st_count");
        check(!gdn_st_at(NULL, 0) && gdn_st_count(NULL) == 0, "gdn_st_at: a NULL file has no tensor");
    }
    if (rc) return;
    const char *meta = gdn_st_metadata(f, "who");
    check(meta && !strcmp(meta, "gdncp test"), "metadata round trip");
    const gdn_st_tensor *t = gdn_st_find(f, "a16");
    /* the public general calls: gdn_st_read (whole, rows along any axis, either destination dtype)
     * gives what the shorthands give; other destination dtypes are refused */
    {
        float a[30], b[30];
        double ad[30], bd[30];
        check(!gdn_st_read_f32(f, "a32", a, 30) && !gdn_st_read(f, "a32", GDN_F32, b, 30, 0, 0, -1) &&
                  !memcmp(a, b, sizeof a),
              "gdn_st_read F32 whole = gdn_st_read_f32");
        check(!gdn_st_read_f64(f, "a64", ad, 30) && !gdn_st_read(f, "a64", GDN_F64, bd, 30, 0, 0, -1) &&
                  !memcmp(ad, bd, sizeof ad),
              "gdn_st_read F64 whole = gdn_st_read_f64");
        check(!gdn_st_read_f32_rows(f, "a32", a, 30, 1, 2) && !gdn_st_read(f, "a32", GDN_F32, b, 30, 1, 1, 2) &&
                  !memcmp(a, b, sizeof(float) * 20),
              "gdn_st_read rows along axis 1 = gdn_st_read_f32_rows");
        check(!gdn_st_read(f, "a32", GDN_F32, b, 30, 2, 4, 1) && b[0] == x[4] && b[5] == x[29],
              "gdn_st_read: column 4 of the last axis");
        expect_status(gdn_st_read(f, "a32", GDN_BF16, b, 30, 0, 0, -1), GDN_ERR_DTYPE, "neither F32",
                      "gdn_st_read into BF16 refused");
        expect_status(gdn_st_read(f, "a32", GDN_F32, b, 29, 0, 0, -1), GDN_ERR_SHAPE, "buffer holds",
                      "gdn_st_read into a short buffer refused");
        gdn_st_writer *w2 = NULL;
        gdn_st_writer_create(&w2);
        expect_status(gdn_st_writer_add(w2, "x", GDN_F32, 3, shape, x, GDN_BF16), GDN_ERR_DTYPE, "neither F32",
                      "gdn_st_writer_add of BF16 data refused");
        gdn_st_writer_destroy(w2);
    }
    check(t && t->dtype == GDN_BF16 && t->ndim == 3 && t->shape[2] == 5 && t->end - t->begin == 60 && t->numel == 30,
          "BF16 tensor header: dtype, shape, 2 bytes per element");
    float y[30];
    double yd[30];
    gdn_st_read_f32(f, "a32", y, 30);
    check(memcmp(x, y, sizeof x) == 0, "F32 round trip is bit exact");
    gdn_st_read_f64(f, "a64", yd, 30);
    check(memcmp(xd, yd, sizeof xd) == 0, "F64 round trip is bit exact");
    gdn_st_read_f32(f, "a16", y, 30);
    double worst = 0.0;
    for (int i = 0; i < 30; i++) worst = fmax(worst, fabs(y[i] - x[i]) / fabs(x[i]));
    /* BF16 keeps 8 significant bits: round to nearest gives relative error <= 2^-8. */
    expect_close(worst, 1.0 / 256, "BF16 round trip relative error per element");
    /* Negative control: the BF16 write and read of a misaligned source through the same check. */
    float z[30];
    gdn_st_read_f32(f, "a16s", z, 30);
    worst = 0.0;
    for (int i = 0; i < 30; i++) worst = fmax(worst, fabs(z[i] - x[i]) / fabs(x[i]));
    expect_far(worst, 1.0 / 256, "a BF16 tensor written from a source one element off, through the same check");
    float s;
    check(gdn_st_read_f32(f, "scalar", &s, 1) == GDN_OK && s == x[0], "0-d tensor holds one element");
    expect_status(gdn_st_read_f32(f, "a32", y, 10), GDN_ERR_SHAPE, "a32", "read into a too-small buffer");
    gdn_st_close(f);

    /* Integer tensors (packed documents' cu_seqlens): I64 written and read back exactly, I32 widened
     * (a hand-made file: the writer stores I64 only); other dtypes and ranks refused by name. */
    {
        char ipath[] = "/tmp/gdncp_st_int_XXXXXX"; /* its own file: `path` is reopened below */
        close(mkstemp(ipath));
        const int64_t offs[4] = {0, 5, (int64_t)1 << 40, -7}, n4 = 4, sq[2] = {2, 2};
        const int64_t offs5[5] = {0, 0, 5, (int64_t)1 << 40, -7}; /* offs, one element further on */
        gdn_st_writer_create(&w);
        gdn_st_writer_add_i64(w, "cu", 1, &n4, offs);
        gdn_st_writer_add_i64(w, "cu_misaligned", 1, &n4, offs5); /* the control: a source one element off */
        gdn_st_writer_add_i64(w, "square", 2, sq, offs);
        gdn_st_writer_add_f32(w, "real", GDN_F32, 1, &n4, x);
        rc = gdn_st_writer_save(w, ipath);
        gdn_st_writer_destroy(w);
        int64_t got[4] = {0}, count = 0;
        rc = rc ? rc : gdn_st_open(&f, ipath);
        check(rc == GDN_OK && !strcmp(gdn_st_find(f, "cu")->dtype_name, "I64"), "I64 tensor written with dtype I64");
        if (rc == GDN_OK) { /* (f is open only here) */
            rc = gdn_st_read_i64(f, "cu", got, 4, &count);
            check(rc == GDN_OK && count == 4 && !memcmp(got, offs, sizeof offs), "I64 round trip is exact (2^40, negative)");
            int64_t mis[4] = {0}, mcount = 0;
            const int mrc = gdn_st_read_i64(f, "cu_misaligned", mis, 4, &mcount);
            check(mrc == GDN_OK && mcount == 4 && memcmp(mis, offs, sizeof offs) != 0,
                  "negative control: offsets written from a source one element off fail the same comparison");
            expect_status(gdn_st_read_i64(f, "real", got, 4, &count), GDN_ERR_DTYPE, "I64 or I32", "F32 tensor read as integers");
            expect_status(gdn_st_read_i64(f, "square", got, 4, &count), GDN_ERR_SHAPE, "1-D", "2-D integer tensor");
            expect_status(gdn_st_read_i64(f, "cu", got, 3, &count), GDN_ERR_SHAPE, "buffer holds 3", "4 integers into 3");
            expect_status(gdn_st_read_i64(f, "none", got, 4, &count), GDN_ERR_MISSING, "none", "absent integer tensor");
            expect_status(gdn_st_read_f32(f, "cu", y, 30), GDN_ERR_DTYPE, "I64", "I64 tensor read as floats");
            gdn_st_close(f);
        }
        /* I32: header {"c":{"dtype":"I32","shape":[3],"data_offsets":[0,12]}} padded to 8 bytes */
        const char hdr[] = "{\"c\":{\"dtype\":\"I32\",\"shape\":[3],\"data_offsets\":[0,12]}}         ";
        const uint64_t hlen = sizeof hdr - 1;
        const int32_t vals[3] = {0, 17, 2147483647};
        FILE *fp = fopen(ipath, "wb");
        int ok = fp && fwrite(&hlen, 8, 1, fp) == 1 && fwrite(hdr, 1, hlen, fp) == hlen && fwrite(vals, 4, 3, fp) == 3;
        if (fp) ok = !fclose(fp) && ok;
        rc = ok ? gdn_st_open(&f, ipath) : GDN_ERR_IO;
        rc = rc ? rc : gdn_st_read_i64(f, "c", got, 4, &count);
        check(rc == GDN_OK && count == 3 && got[0] == 0 && got[1] == 17 && got[2] == 2147483647,
              "I32 tensor read as int64 (0, 17, INT32_MAX)");
        if (!rc) gdn_st_close(f);
        unlink(ipath);
    }

    /* Atomic replace: a failed save leaves the old file intact and no temp file behind. */
    gdn_st_writer_create(&w);
    gdn_st_writer_add_f32(w, "b", GDN_F32, 1, shape, x);
    expect_status(gdn_st_writer_add_f32(w, "b", GDN_F32, 1, shape, x), GDN_ERR_ARG, "twice", "same tensor added twice");
    expect_status(gdn_st_writer_save(w, "/nonexistent-dir/x.safetensors"), GDN_ERR_IO, "nonexistent", "save into a missing directory");
    gdn_st_writer_destroy(w);
    rc = gdn_st_open(&f, path);
    check(rc == GDN_OK && gdn_st_find(f, "a32") != NULL, "earlier file still intact after a failed save elsewhere");
    gdn_st_close(f);
    gdn_st_writer_create(&w);
    gdn_st_writer_add_f32(w, "c", GDN_F32, 1, shape, x);
    rc = gdn_st_writer_save(w, path);
    gdn_st_writer_destroy(w);
    rc = rc ? rc : gdn_st_open(&f, path);
    check(rc == GDN_OK && gdn_st_count(f) == 1 && gdn_st_find(f, "c"), "save replaces the file whole");
    gdn_st_close(f);
    unlink(path);
    signal_during_save();
}
