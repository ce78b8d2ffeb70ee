/* Shared by the libFuzzer harnesses: put the input bytes in a file the library can open by path.
 * A memfd (reopened through /proc/self/fd/N: a regular file, no disk traffic) when the kernel has
 * them, else one temporary file per process and slot under $TMPDIR; either is rewritten for every
 * input. A harness that needs two files (config.json and weights) uses two slots. */
#ifndef GDN_FUZZ_COMMON_H
#define GDN_FUZZ_COMMON_H

#define _GNU_SOURCE 1
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

enum { FUZZ_SLOTS = 2 };
static int fuzz_fd[FUZZ_SLOTS] = {-1, -1};
static char fuzz_path[FUZZ_SLOTS][4096];

static void fuzz_cleanup(void) {
    for (int s = 0; s < FUZZ_SLOTS; s++)
        if (fuzz_fd[s] >= 0 && strncmp(fuzz_path[s], "/proc/", 6) != 0) unlink(fuzz_path[s]);
}

/* Write data to the per-process file of `slot` and return its path (NULL on failure: skip the
 * input). */
static const char *fuzz_file_at(int slot, const uint8_t *data, size_t size) {
    static int registered;
    int *fd = &fuzz_fd[slot];
    char *path = fuzz_path[slot];
    if (*fd < 0) {
#ifdef MFD_CLOEXEC
        *fd = memfd_create("gdn_fuzz", MFD_CLOEXEC);
        if (*fd >= 0) {
            snprintf(path, sizeof fuzz_path[0], "/proc/self/fd/%d", *fd);
            if (access(path, R_OK) != 0) close(*fd), *fd = -1; /* no /proc */
        }
#endif
        if (*fd < 0) {
            const char *tmp = getenv("TMPDIR");
            snprintf(path, sizeof fuzz_path[0], "%s/gdn_fuzz_XXXXXX.safetensors", tmp && *tmp ? tmp : "/tmp");
            *fd = mkstemps(path, 12);
            if (*fd < 0) return NULL;
            if (!registered) atexit(fuzz_cleanup), registered = 1;
        }
    }
    if (ftruncate(*fd, 0) != 0) return NULL;
    for (size_t done = 0; done < size;) {
        ssize_t w = pwrite(*fd, data + done, size - done, (off_t)done);
        if (w <= 0) return NULL;
        done += (size_t)w;
    }
    return path;
}

static const char *fuzz_file(const uint8_t *data, size_t size) { return fuzz_file_at(0, data, size); }

#endif
