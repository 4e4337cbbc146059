/*
 * AMX tile setup shared by the AMX copies (paged_decode_amx.h, paged_prefill_amx.h):
 * the tile configuration (palette 1, every tile 16 rows x 64 bytes) and a tile load that
 * stores before it cannot pass. Included inside a target region with amx-tile, once per
 * translation unit.
 */
#ifndef ATTNKIT_AMX_TILES_H
#define ATTNKIT_AMX_TILES_H

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* tileloadd's asm names no memory: stores to what it reads must not sink below it */
#define AMX_TILE_LOAD(t, p, s)                                                           \
    do {                                                                                 \
        __asm__ volatile("" ::: "memory");                                               \
        _tile_loadd(t, p, s);                                                            \
    } while (0)

/* Every tile 16 rows x 64 bytes (what each copy's products take). */
static void amx_tiles_configure(void) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(&cfg);
}

#endif /* ATTNKIT_AMX_TILES_H */
