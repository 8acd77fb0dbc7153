// Block-quantized weights times int8-quantized activations: llama.cpp's way of multiplying its
// Q4_0, Q4_1 and Q8_0 weights (ggml's vec_dot_q4_0_q8_0 and kin). Each row of x is quantized
// per 32-input block to int8 with a float scale sx = max|x| / 127; a block's dot product is
// then an integer dot product of 32 byte pairs (maddubs, or one VNNI dpbusd), scaled once by
// d * sx, and for Q4_1 (and Q4_0, whose -8 offset is a minimum of -8 d) a minimum m times the
// block's sum of x. That reads the 4-bit weights as bytes, never widening them to floats: about
// a quarter of the instructions of dequantizing to float32 (measured: benchmarks/step_profile.py).
// Rounding x to int8 costs accuracy that dequantize-then-multiply does not: |x - sx q| <= sx / 2
// per input, so a dot product is off by at most sum |w| sx / 2 (tests hold the kernel to that).
#pragma once

#include <immintrin.h>

#include "stored_blocks.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace int8_dot {

using stored::block_bytes;
using stored::half_to_float;
using stored::kBlock;

// x [rows, k] float32 quantized per block: q [rows, k] int8, scale and sum [rows, k / 32]
// (sum is sx times the block's sum of q: the block's sum of x as the kernel sees it).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
  int64_t rows = 0, k = 0;

  void quantize(const float* x, int64_t n_rows, int64_t n_inputs) {
    rows = n_rows;
    k = n_inputs;
    const int64_t blocks = k / kBlock;
    q.resize(rows * k);
    scale.resize(rows * blocks);
    sum.resize(rows * blocks);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* in = x + r * k + b * kBlock;
        float amax = 0.f;
        for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(in[j]));
        const float sx = amax / 127.f;
        const float inverse = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* out = q.data() + r * k + b * kBlock;
        int total = 0;
        for (int j = 0; j < kBlock; ++j) {
          out[j] = static_cast<int8_t>(std::nearbyint(in[j] * inverse));
          total += out[j];
        }
        scale[r * blocks + b] = sx;
        sum[r * blocks + b] = sx * static_cast<float>(total);
      }
    }
  }
};

// One block's scale d and minimum m (m = -8 d for Q4_0, 0 for Q8_0).
template <int64_t F>
inline void scale_and_min(const uint8_t* b, float& d, float& m) {
  d = half_to_float(b);
  m = F == stored::kQ4_1 ? half_to_float(b + 2) : F == stored::kQ4_0 ? -8.f * d : 0.f;
}

// sums[r * stride + c] += row r of x times column c's weights, for R rows from r0 and C
// columns whose stored rows are w[0..C).
template <int64_t F, int R, int C>
void tile_scalar(const QuantizedRows& x, int64_t r0, const uint8_t* const* w, float* sums,
                 int64_t stride) {
  const int64_t blocks = x.k / kBlock;
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = w[c] + b * block_bytes(F);
        const int8_t* xq = x.q.data() + (r0 + r) * x.k + b * kBlock;
        float d, m;
        scale_and_min<F>(blk, d, m);
        int32_t dot = 0;
        for (int j = 0; j < kBlock; ++j) {
          int32_t wq;
          if constexpr (F == stored::kQ8_0) {
            wq = reinterpret_cast<const int8_t*>(blk + 2)[j];
          } else {
            const uint8_t byte = blk[(F == stored::kQ4_1 ? 4 : 2) + (j & 15)];
            wq = j < 16 ? (byte & 0x0F) : (byte >> 4);
          }
          dot += wq * static_cast<int32_t>(xq[j]);
        }
        const int64_t i = (r0 + r) * blocks + b;
        acc += static_cast<float>(dot) * (d * x.scale[i]) + m * x.sum[i];
      }
      sums[r * stride + c] += acc;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 int32 sums of 4 products each of unsigned bytes u and signed bytes s.
template <bool kVnni>
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (kVnni) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#endif
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// The block's 32 weights as bytes in x's order (4-bit: the low nibbles are inputs 0-15, the
// high nibbles 16-31; unsigned 0-15), or Q8_0's signed bytes.
template <int64_t F>
inline __m256i weight_bytes(const uint8_t* blk) {
  if (F == stored::kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (F == stored::kQ4_1 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask),
                          _mm_and_si128(packed, mask));
}

// scale_and_min with F16C's one-instruction conversions (c10::Half converts in software).
template <int64_t F>
inline void scale_and_min_f16c(const uint8_t* b, float& d, float& m) {
  uint16_t bits[2];
  std::memcpy(bits, b, 4);
  d = _cvtsh_ss(bits[0]);
  m = F == stored::kQ4_1 ? _cvtsh_ss(bits[1]) : F == stored::kQ4_0 ? -8.f * d : 0.f;
}

template <int64_t F, int R, int C, bool kVnni>
void tile_avx2(const QuantizedRows& x, int64_t r0, const uint8_t* const* w, float* sums,
               int64_t stride) {
  const int64_t blocks = x.k / kBlock;
  __m256 acc[R][C];
  float minimum_terms[R][C] = {};
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i xq[R];
    __m256 sx[R];
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * blocks + b;
      xq[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          x.q.data() + (r0 + r) * x.k + b * kBlock));
      sx[r] = _mm256_set1_ps(x.scale[i]);
    }
    for (int c = 0; c < C; ++c) {
      const uint8_t* blk = w[c] + b * block_bytes(F);
      float d, m;
      scale_and_min_f16c<F>(blk, d, m);
      const __m256i wb = weight_bytes<F>(blk);
      // maddubs multiplies unsigned by signed bytes: Q8_0 moves its sign onto x.
      const __m256i u = F == stored::kQ8_0 ? _mm256_sign_epi8(wb, wb) : wb;
      const __m256 dv = _mm256_set1_ps(d);
      for (int r = 0; r < R; ++r) {
        const __m256i s = F == stored::kQ8_0 ? _mm256_sign_epi8(xq[r], wb) : xq[r];
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8<kVnni>(u, s));
        acc[r][c] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, sx[r]), acc[r][c]);
        if (F != 0) minimum_terms[r][c] += m * x.sum[(r0 + r) * blocks + b];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r * stride + c] += stored::reduce_add(acc[r][c]) + minimum_terms[r][c];
}
#endif

}  // namespace int8_dot
