// A 16 x 16 transpose of 32-bit lanes in AVX-512, shared by the attention kernels that turn
// bf16 key rows into dim pairs. Include only where CPU_CAPABILITY_AVX512 is defined (the build
// is -march=native).
#pragma once

#include <immintrin.h>

namespace nalar_avx512 {

// Sixteen vectors of 16 32-bit lanes transposed in place, so that afterwards r[c] holds lane c
// of every input: unpacks within 128-bit lanes, then a 4 x 4 transpose of the lanes.
inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int j = 0; j < 16; j += 4) {
    u[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
    u[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
    u[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
    u[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
  }
  // u[4j + m], 128-bit lane L: lane 4L + m of inputs 4j .. 4j + 3.
  for (int m = 0; m < 4; ++m) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + m] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

}  // namespace nalar_avx512
