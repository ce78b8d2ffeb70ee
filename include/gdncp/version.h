/* gdncp's version and the export macro of its public API. */
#ifndef GDNCP_VERSION_H
#define GDNCP_VERSION_H

#define GDN_VERSION_MAJOR 0
#define GDN_VERSION_MINOR 3
#define GDN_VERSION_PATCH 0
#define GDN_VERSION_STRING "0.3.0"
/* One number that grows with every release: major * 10000 + minor * 100 + patch. */
#define GDN_VERSION (GDN_VERSION_MAJOR * 10000 + GDN_VERSION_MINOR * 100 + GDN_VERSION_PATCH)

/* The library is built with -fvisibility=hidden: only declarations marked GDN_API are exported
 * from libgdncp.so. */
#if defined(__GNUC__) || defined(__clang__)
#define GDN_API __attribute__((visibility("default")))
#else
#define GDN_API
#endif

#ifdef __cplusplus
extern "C" {
#endif
/* The version the library was built as ("0.3.0"); compare with GDN_VERSION_STRING to detect a
 * header / library mismatch. */
GDN_API const char *gdn_version(void);
#ifdef __cplusplus
}
#endif
#endif /* GDNCP_VERSION_H */
