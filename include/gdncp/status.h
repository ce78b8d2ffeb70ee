/* gdncp status codes and error messages. Every gdncp function that can fail returns
 * one of these (functions that cannot fail return a value or void, as documented). */
#ifndef GDNCP_STATUS_H
#define GDNCP_STATUS_H

#include <stddef.h>
#include "version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- status codes */

typedef enum {
    GDN_OK = 0,
    GDN_ERR_ARG = 1,       /* a NULL pointer or an option out of range */
    GDN_ERR_SHAPE = 2,     /* sizes that are zero, negative, too large or inconsistent */
    GDN_ERR_NONFINITE = 3, /* NaN or Inf in an input tensor */
    GDN_ERR_NOMEM = 4,     /* allocation failed */
    GDN_ERR_IO = 5,        /* open/read/write/rename failed */
    GDN_ERR_FORMAT = 6,    /* a malformed or truncated file */
    GDN_ERR_MISSING = 7,   /* a required tensor is absent from a file */
    GDN_ERR_DTYPE = 8,     /* a tensor has a dtype this operation cannot use */
    GDN_ERR_MPI = 20       /* an MPI call failed, or the ranks disagree (shapes, options, a
                              failure on another rank) */
} gdn_status;

/* Short fixed text for a status code. */
GDN_API const char *gdn_strerror(int status);
/* Detailed message of the last failure on the calling thread (names the tensor or dimension). */
GDN_API const char *gdn_errmsg(void);
/* GDN_OK, or GDN_ERR_NOMEM naming `what`, the need and the machine's memory when `bytes` exceed
 * this machine's physical memory: a size that clearly cannot fit, refused before allocating
 * (where overcommit would let malloc succeed and the OOM killer end the run later). A double, so
 * that absurd sizes are refused before any size_t product of them can overflow. */
GDN_API int gdn_check_fits(const char *what, double bytes);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_STATUS_H */
