// What our AMX kernels share: Linux's per-process grant of the tile registers, and the tile
// configuration. Include only where the build targets AMX (the build is -march=native).
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

// Tile t (of the first `count`) as rows[t] rows of bytes[t] bytes. Per thread, before its
// first tile instruction.
inline void configure(int count, const uint8_t* rows, const uint16_t* bytes) {
  struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
  } config{};
  config.palette = 1;
  for (int t = 0; t < count; ++t) {
    config.rows[t] = rows[t];
    config.bytes_per_row[t] = bytes[t];
  }
  _tile_loadconfig(&config);
}

// Every one of the 8 tiles 16 rows of 64 bytes: a 16 x 16 fp32 accumulator, or 16 x 32 bf16
// operands.
inline void configure() {
  constexpr uint8_t kRows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  constexpr uint16_t kBytes[8] = {64, 64, 64, 64, 64, 64, 64, 64};
  configure(8, kRows, kBytes);
}

}  // namespace nalar_tiles
