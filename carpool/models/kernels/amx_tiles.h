/* AMX's tile registers as interleaved.h uses them: load a tile's configuration, load,
   zero and store tiles, and TDPBSSD (signed bytes times signed bytes, four products a
   32-bit sum added to the destination). Built for a CPU with AMX-TILE and AMX-INT8
   (-march=native on one: __AMX_TILE__, __AMX_INT8__) these are the instructions; built
   with -DCARPOOL_AMX_EMULATED they are the same operations in C over eight arrays a
   thread (Intel's SDM pseudo-code for TILELOADD, TILESTORED, TILEZERO and TDPBSSD), so
   that a CPU without AMX runs, and the tests check, the code around them. Tile numbers
   are constants (the instructions encode them). */

#ifndef CARPOOL_AMX_TILES_H
#define CARPOOL_AMX_TILES_H

#include <stdint.h>
#include <string.h>

/* LDTILECFG's 64-byte operand: palette 1, each tile's rows and bytes a row */
typedef struct __attribute__((aligned(64))) {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxConfig;

#define AMX_TILES 8
#define AMX_MAX_ROWS 16
#define AMX_MAX_COLSB 64

#ifdef CARPOOL_AMX_EMULATED
typedef struct {
    int rows, colsb;
    uint8_t bytes[AMX_MAX_ROWS][AMX_MAX_COLSB];
} EmulatedTile;

/* each thread's tile registers, as each core's are */
static __thread EmulatedTile emulated_tiles[AMX_TILES];

static inline void amx_load_config(const AmxConfig *config) {
    for (int t = 0; t < AMX_TILES; t++) {
        emulated_tiles[t].rows = config->rows[t];
        emulated_tiles[t].colsb = config->colsb[t];
        memset(emulated_tiles[t].bytes, 0, sizeof emulated_tiles[t].bytes);
    }
}

static inline void amx_release(void) { memset(emulated_tiles, 0, sizeof emulated_tiles); }

static inline void amx_emulated_load(int t, const void *base, int64_t stride) {
    EmulatedTile *tile = emulated_tiles + t;
    memset(tile->bytes, 0, sizeof tile->bytes);
    for (int r = 0; r < tile->rows; r++)
        memcpy(tile->bytes[r], (const uint8_t *)base + r * stride, (size_t)tile->colsb);
}

static inline void amx_emulated_store(int t, void *base, int64_t stride) {
    const EmulatedTile *tile = emulated_tiles + t;
    for (int r = 0; r < tile->rows; r++)
        memcpy((uint8_t *)base + r * stride, tile->bytes[r], (size_t)tile->colsb);
}

static inline void amx_emulated_zero(int t) {
    memset(emulated_tiles[t].bytes, 0, sizeof emulated_tiles[t].bytes);
}

/* c's row m, 32-bit lane n += the sum over a's 4-byte groups i of a[m][4i + e] times
   b[i][4n + e], e in 0-3, every byte signed */
static inline void amx_emulated_dpbssd(int c, int a, int b) {
    EmulatedTile *dst = emulated_tiles + c;
    const EmulatedTile *x = emulated_tiles + a, *w = emulated_tiles + b;
    for (int m = 0; m < dst->rows; m++)
        for (int n = 0; n < dst->colsb / 4; n++) {
            int32_t sum;
            memcpy(&sum, dst->bytes[m] + 4 * n, sizeof sum);
            for (int i = 0; i < x->colsb / 4; i++)
                for (int e = 0; e < 4; e++)
                    sum += (int32_t)(int8_t)x->bytes[m][4 * i + e] * (int8_t)w->bytes[i][4 * n + e];
            memcpy(dst->bytes[m] + 4 * n, &sum, sizeof sum);
        }
}

#define AMX_LOAD(t, base, stride) amx_emulated_load(t, base, stride)
#define AMX_STORE(t, base, stride) amx_emulated_store(t, base, stride)
#define AMX_ZERO(t) amx_emulated_zero(t)
#define AMX_DPBSSD(c, a, b) amx_emulated_dpbssd(c, a, b)

static inline int amx_permitted(void) { return 1; }
#else
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline void amx_load_config(const AmxConfig *config) { _tile_loadconfig(config); }
static inline void amx_release(void) { _tile_release(); }

#define AMX_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define AMX_STORE(t, base, stride) _tile_stored(t, base, stride)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)

/* Linux's arch_prctl request for the tile data state (asm/prctl.h's
   ARCH_REQ_XCOMP_PERM, the kernel's XFEATURE_XTILEDATA): without it a tile
   instruction faults (SIGILL) */
#define ARCH_REQ_XCOMP_PERM_CODE 0x1023
#define XFEATURE_XTILEDATA_BIT 18

/* Whether this process may use the tiles: asked of Linux once (the grant is the
   process's, every thread's); 0 where it refuses (an older kernel), and the callers
   keep to AVX-512 */
static inline int amx_permitted(void) {
    static int answer = -1;
    int known = __atomic_load_n(&answer, __ATOMIC_ACQUIRE);
    if (known < 0) {
        known = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM_CODE, XFEATURE_XTILEDATA_BIT) == 0;
        __atomic_store_n(&answer, known, __ATOMIC_RELEASE);
    }
    return known;
}
#endif

/* Tile t of config: rows rows of colsb bytes */
static inline void amx_shape(AmxConfig *config, int t, int64_t rows, int64_t colsb) {
    config->rows[t] = (uint8_t)rows;
    config->colsb[t] = (uint16_t)colsb;
}

#endif
