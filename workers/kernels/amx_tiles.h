// What our AMX kernels share: Linux's per-process grant of the tile registers, and one tile
// configuration. Include only where __AMX_BF16__ is defined (the build is -march=native).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace nalar_tiles {

// Linux hands out the tile register state per process, on request (once is enough; a second
// request is granted again).
inline bool granted() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

// Every one of the 8 tiles 16 rows of 64 bytes: a 16 x 16 fp32 accumulator, or 16 x 32 bf16
// operands. Per thread, before its first tile instruction.
inline void configure() {
  struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
  } config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

}  // namespace nalar_tiles
