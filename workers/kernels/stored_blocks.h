// What the weight-streaming kernels (weight_linear.cpp, int8_dot.h) share about stored weights:
// the formats, numbered as workers/models/weight_formats.py numbers them, and their block sizes.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace stored {

enum Format : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kInt8Channel = 3, kBF16 = 4, kF32 = 5 };

constexpr int64_t kBlock = 32;  // weights per quantization block (GGUF's QK)

// Bytes of one block of kBlock weights (GGUF layouts: Q8_0 an f16 scale and 32 int8; Q4_0 an
// f16 scale and 16 bytes of nibbles; Q4_1 f16 scale and minimum and 16 bytes of nibbles).
constexpr int64_t block_bytes(int64_t format) {
  return format == kQ8_0 ? 34 : format == kQ4_0 ? 18 : format == kQ4_1 ? 20
       : format == kInt8Channel ? kBlock : format == kBF16 ? 2 * kBlock : 4 * kBlock;
}

// Bytes in front of a row's blocks: the per-channel int8 row's float32 scale.
constexpr int64_t row_header_bytes(int64_t format) { return format == kInt8Channel ? 4 : 0; }

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

#if defined(__AVX2__)
inline float reduce_add(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

}  // namespace stored
