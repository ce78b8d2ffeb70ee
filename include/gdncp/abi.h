/* The layout of the public structs as this library was compiled, for bindings in other languages
 * (python/src/gdncp/_abi.py mirrors every struct in ctypes; python/tests/test_abi.py compares each
 * struct's size and every field's offset with these). The table is generated with the Python
 * bindings from the headers of include/gdncp/ by scripts/gen_bindings.py (src/train/abi.c), so it lists every
 * typedef'd struct of the headers, by its C name ("gdn_config", "gdn_model_config", ...), both
 * libraries'. It is in libgdncp_mpi: the table includes the wing's headers (cp.h, train.h). */
#ifndef GDNCP_ABI_H
#define GDNCP_ABI_H

#include <stddef.h>
#include <stdint.h>
#include "version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* sizeof(type), e.g. gdn_abi_sizeof("gdn_config"); 0 for a name that is not a public struct. */
GDN_API size_t gdn_abi_sizeof(const char *type);
/* offsetof(type, field) in bytes; -1 when type is not a public struct or has no such field. */
GDN_API int64_t gdn_abi_offsetof(const char *type, const char *field);
/* The i-th public struct's name (i from 0), NULL past the last: the list the table holds. */
GDN_API const char *gdn_abi_struct_name(int i);
/* The i-th field's name of type, in declaration order (i from 0); NULL past the last. */
GDN_API const char *gdn_abi_field_name(const char *type, int i);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_ABI_H */
