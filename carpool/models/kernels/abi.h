/* The contract between the kernels and their ctypes declarations in carpool/models:
   every library exports the version of that contract, which the Python side checks
   when it loads the library, before any call. Bump it whenever an exported
   function's arguments or a struct passed by pointer change. */

#ifndef CARPOOL_ABI_H
#define CARPOOL_ABI_H

#include <stdint.h>

#define CARPOOL_ABI_VERSION 13

int64_t carpool_abi_version(void) { return CARPOOL_ABI_VERSION; }

#endif
