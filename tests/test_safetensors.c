/* safetensors round trips (F32, F64, BF16), metadata, atomic replacement. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void test_safetensors(void) {
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
    gdn_st_writer_add_f64(w, "a64", GDN_F64, 3, shape, xd);
    gdn_st_writer_add_f32(w, "scalar", GDN_F32, 0, NULL, x);
    int rc = gdn_st_writer_save(w, path);
    gdn_st_writer_destroy(w);
    check(rc == GDN_OK, "write F32/BF16/F64 tensors and metadata");

    gdn_st_file *f = NULL;
    rc = gdn_st_open(&f, path);
    check(rc == GDN_OK && gdn_st_count(f) == 4, "reopen: 4 tensors");
    if (rc) return;
    const char *meta = gdn_st_metadata(f, "who");
    check(meta && !strcmp(meta, "gdncp test"), "metadata round trip");
    const gdn_st_tensor *t = gdn_st_find(f, "a16");
    check(t && t->dtype == GDN_BF16 && t->ndim == 3 && t->shape[2] == 5 && t->end - t->begin == 60,
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
    /* Negative control: other data compared through the same check must fail it. */
    float z[30];
    gdn_st_read_f32(f, "a64", z, 30);
    for (int i = 0; i < 30; i++) z[i] = z[(i + 1) % 30];
    worst = 0.0;
    for (int i = 0; i < 30; i++) worst = fmax(worst, fabs(z[i] - x[i]) / fabs(x[i]));
    expect_far(worst, 1.0 / 256, "shifted tensor through the BF16 check");
    float s;
    check(gdn_st_read_f32(f, "scalar", &s, 1) == GDN_OK && s == x[0], "0-d tensor holds one element");
    expect_status(gdn_st_read_f32(f, "a32", y, 10), GDN_ERR_SHAPE, "a32", "read into a too-small buffer");
    gdn_st_close(f);

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
}
