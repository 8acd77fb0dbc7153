// Block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1) times int8-quantized activations: llama.cpp's
// way of multiplying them (ggml's vec_dot_q4_1_q8_1 and kin), over a layout packed for it.
//
// Activations: each row of x is quantized per 32-input block to int8 with a float scale
// sx = max|x| / 127. A block's dot product is an integer dot product of 32 byte pairs, scaled
// once by d * sx; Q4_1 adds its minimum m times the block's sum of x. Rounding x to int8 costs
// accuracy that dequantize-then-multiply does not: |x - sx q| <= sx / 2 per input, so a dot
// product is off by at most sum |w| sx / 2 (tests hold the kernel to that). Each row is
// computed the same way whatever else is in the batch, so a row's result does not depend on
// the step's row count.
//
// Packed layout (made once at load by pack(), exact and reversible by unpack()): output
// features in groups of kGroup = 8, one per 32-bit lane of a 256-bit register. A group holds,
// for each block of 32 inputs in order, the 8 features' fp16 scales d, then (Q4_1) their fp16
// minimums m, then their quants, interleaved so that one 32-byte load is 4 consecutive inputs
// of all 8 features: quant vector j holds in lane c the inputs 4j..4j+3 of feature c. Q8_0 has
// 8 such vectors (its int8 q stored as the unsigned q + 128); Q4_0 and Q4_1 have 4, whose low
// nibbles are inputs 4j..4j+3 and high nibbles inputs 16+4j..16+4j+3 (GGUF's nibble order).
// A lane's 4 bytes then take one dot-product instruction (VNNI dpbusd, or maddubs)
// against 4 inputs of x broadcast to every lane: about a fifth of the instructions per weight
// of a feature-at-a-time dot product, which made the kernel compute-bound at 6-10 GB/s
// (SmolLM2 on one core of an AMD EPYC; see benchmarks/step_profile.py). The group is the
// block-major order of ggml's repacked q4_0_8x8 and of other weight-only GEMV kernels; the
// sizes are the GGUF file's (a group block is 8 GGUF blocks' bytes). Features past the last
// whole group are padded with zero bytes.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
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
using stored::kQ4_0;
using stored::kQ4_1;
using stored::kQ8_0;

constexpr int64_t kGroup = 8;  // output features per packed group

constexpr bool is_gguf(int64_t format) { return format >= kQ8_0 && format <= kQ4_1; }

// Bytes of one block of a group (8 GGUF blocks), of its scales (and minimums) in front of the
// quants, and of a whole group of k inputs.
constexpr int64_t group_block_bytes(int64_t format) { return kGroup * block_bytes(format); }
constexpr int64_t scale_bytes(int64_t format) { return format == kQ4_1 ? 32 : 16; }
inline int64_t group_bytes(int64_t format, int64_t k) {
  return k / kBlock * group_block_bytes(format);
}
inline int64_t groups(int64_t n) { return (n + kGroup - 1) / kGroup; }

// Where input i of a block of feature c lives among a group block's quants, and in which
// nibble (4-bit formats: false is the low one).
inline int64_t quant_offset(int64_t format, int64_t c, int64_t i, bool& high) {
  high = format != kQ8_0 && i >= 16;
  const int64_t j = (high ? i - 16 : i) / 4;
  return j * 32 + c * 4 + i % 4;
}

// Feature c's input i of this group block as its unsigned quant (Q8_0: q + 128).
inline int unsigned_quant(int64_t format, const uint8_t* group_block, int64_t c, int64_t i) {
  bool high;
  const uint8_t byte = group_block[scale_bytes(format) + quant_offset(format, c, i, high)];
  if (format == kQ8_0) return byte;
  return high ? byte >> 4 : byte & 0x0F;
}

// One GGUF row's block b (b bytes at `gguf`) into feature c of a group block, and back.
inline void pack_block(int64_t format, const uint8_t* gguf, int64_t c, uint8_t* group_block) {
  std::memcpy(group_block + 2 * c, gguf, 2);  // d
  if (format == kQ4_1) std::memcpy(group_block + 16 + 2 * c, gguf + 2, 2);  // m
  uint8_t* quants = group_block + scale_bytes(format);
  const uint8_t* q = gguf + (format == kQ4_1 ? 4 : 2);
  bool high;
  for (int64_t i = 0; i < kBlock; ++i) {
    const int64_t at = quant_offset(format, c, i, high);
    if (format == kQ8_0) {
      quants[at] = static_cast<uint8_t>(q[i] ^ 0x80);
    } else if (i < 16) {
      quants[at] = static_cast<uint8_t>((quants[at] & 0xF0) | (q[i] & 0x0F));
    } else {
      quants[at] = static_cast<uint8_t>((quants[at] & 0x0F) | (q[i - 16] & 0xF0));
    }
  }
}

inline void unpack_block(int64_t format, const uint8_t* group_block, int64_t c, uint8_t* gguf) {
  std::memcpy(gguf, group_block + 2 * c, 2);
  if (format == kQ4_1) std::memcpy(gguf + 2, group_block + 16 + 2 * c, 2);
  uint8_t* q = gguf + (format == kQ4_1 ? 4 : 2);
  for (int64_t i = 0; i < 16; ++i) {
    if (format == kQ8_0) {
      q[i] = static_cast<uint8_t>(unsigned_quant(format, group_block, c, i) ^ 0x80);
      q[i + 16] = static_cast<uint8_t>(unsigned_quant(format, group_block, c, i + 16) ^ 0x80);
    } else {
      q[i] = static_cast<uint8_t>(unsigned_quant(format, group_block, c, i)
                                  | unsigned_quant(format, group_block, c, i + 16) << 4);
    }
  }
}

// Feature c's block of this group block as floats, rounded as the GGUF reference rounds
// (d * q for Q8_0; one fused d * q + m for the 4-bit formats, m = -8 d for Q4_0).
inline void dequantize_block(int64_t format, const uint8_t* group_block, int64_t c, float* out) {
  const float d = half_to_float(group_block + 2 * c);
  if (format == kQ8_0) {
    for (int64_t i = 0; i < kBlock; ++i) {
      out[i] = d * static_cast<float>(unsigned_quant(format, group_block, c, i) - 128);
    }
    return;
  }
  const float m = format == kQ4_1 ? half_to_float(group_block + 16 + 2 * c) : -8.f * d;
  for (int64_t i = 0; i < kBlock; ++i) {
    out[i] = std::fma(static_cast<float>(unsigned_quant(format, group_block, c, i)), d, m);
  }
}

// x [rows, k] float32 quantized per block: q [rows, k] int8; per row and block its scale sx,
// the integer sum of its q and that sum times sx (the block's sum of x as the kernel sees it).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
  std::vector<int32_t> qsum;
  int64_t rows = 0, k = 0;

  // T: float or c10::BFloat16 (widened exactly as it is read: no float copy of x is made)
  template <typename T>
  void quantize(const T* x, int64_t n_rows, int64_t n_inputs) {
    rows = n_rows;
    k = n_inputs;
    const int64_t blocks = k / kBlock;
    q.resize(rows * k);
    scale.resize(rows * blocks);
    sum.resize(rows * blocks);
    qsum.resize(rows * blocks);
    // a prefill chunk's rows are many: quantized in parallel (bit-identical: rows independent)
    at::parallel_for(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) quantize_block(x + i * kBlock, i);
    });
  }

 private:
  template <typename T>
  void quantize_block(const T* x, int64_t i) {
    float in[kBlock];
    for (int j = 0; j < kBlock; ++j) in[j] = static_cast<float>(x[j]);
    float amax = 0.f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(in[j]));
    const float sx = amax / 127.f;
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    int8_t* out = q.data() + i * kBlock;
    int total = 0;
    for (int j = 0; j < kBlock; ++j) {
      out[j] = static_cast<int8_t>(std::nearbyint(in[j] * inverse));
      total += out[j];
    }
    scale[i] = sx;
    qsum[i] = total;
    sum[i] = sx * static_cast<float>(total);
  }
};

// The integer dot product of a block's unsigned quants u with x's q, less the offset that
// makes u signed (Q8_0: 128, Q4_0: 8; Q4_1's minimum is a float term instead).
constexpr int32_t unsigned_offset(int64_t format) {
  return format == kQ8_0 ? 128 : format == kQ4_0 ? 8 : 0;
}

// sums[r * kGroup + c] = row r0 + r of x times feature c of the group, for R rows.
template <int64_t F, int R>
void group_scalar(const QuantizedRows& x, int64_t r0, const uint8_t* group, float* sums) {
  const int64_t blocks = x.k / kBlock;
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < kGroup; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* gb = group + b * group_block_bytes(F);
        const int8_t* xq = x.q.data() + (r0 + r) * x.k + b * kBlock;
        const int64_t i = (r0 + r) * blocks + b;
        int32_t dot = 0;
        for (int64_t j = 0; j < kBlock; ++j) dot += unsigned_quant(F, gb, c, j) * xq[j];
        dot -= unsigned_offset(F) * x.qsum[i];
        // fused as the SIMD paths fuse, so that every path rounds alike
        acc = std::fma(static_cast<float>(dot), half_to_float(gb + 2 * c) * x.scale[i], acc);
        if (F == kQ4_1) acc = std::fma(half_to_float(gb + 16 + 2 * c), x.sum[i], acc);
      }
      sums[r * kGroup + c] = acc;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// A group block's 8 quant vectors, vector j holding inputs 4j..4j+3 of every feature: the
// 4-bit formats' nibbles as bytes 0-15; Q8_0's bytes as stored (q + 128), or as its signed q.
template <int64_t F, bool kSignedQ8>
inline void load_quants(const uint8_t* gb, __m256i* v) {
  const uint8_t* quants = gb + scale_bytes(F);
  if constexpr (F == kQ8_0) {
    for (int j = 0; j < 8; ++j) {
      v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * j));
      if constexpr (kSignedQ8) v[j] = _mm256_xor_si256(v[j], _mm256_set1_epi8(-128));
    }
    return;
  }
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * j));
    v[j] = _mm256_and_si256(q, nibble);
    v[4 + j] = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);
  }
}

// The 8 features of a group block as floats: out[c * ld + i] for input i, rounded as
// dequantize_block. Quant vector j holds inputs 4j..4j+3 of every feature (4-bit formats: the
// low nibbles are j = 0-3, the high ones j = 4-7), so an 8 x 8 transpose of 32-bit lanes puts
// each feature's 32 inputs in order.
template <int64_t F>
void dequantize_group_block_avx2(const uint8_t* gb, float* out, int64_t ld) {
  __m256i v[8];
  load_quants<F, true>(gb, v);
  __m256i t[8], u[8];
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_epi32(v[j], v[j + 1]);
    t[j + 1] = _mm256_unpackhi_epi32(v[j], v[j + 1]);
  }
  for (int j = 0; j < 8; j += 4) {
    u[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]);
    u[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);
    u[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]);
    u[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]);
  }
  // u[0..3] hold features 0, 1, 2, 3 (low 128 bits) and 4, 5, 6, 7 (high) of inputs 0-15,
  // u[4..7] the same features' inputs 16-31.
  alignas(32) float d[8], m[8];
  _mm256_store_ps(d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb))));
  if constexpr (F == kQ4_1) {
    _mm256_store_ps(m, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 16))));
  }
  for (int c = 0; c < 8; ++c) {
    // the selector must be an immediate whether or not the compiler unrolls this loop
    const __m256i bytes = c < 4 ? _mm256_permute2x128_si256(u[c], u[4 + c], 0x20)
                                : _mm256_permute2x128_si256(u[c - 4], u[c], 0x31);
    const __m256 dv = _mm256_set1_ps(d[c]);
    const __m256 mv = _mm256_set1_ps(F == kQ4_1 ? m[c] : -8.f * d[c]);
    for (int q = 0; q < 4; ++q) {
      const __m128i eight = q < 2 ? _mm256_castsi256_si128(bytes) : _mm256_extracti128_si256(bytes, 1);
      const __m128i part = (q & 1) ? _mm_srli_si128(eight, 8) : eight;
      __m256 w;
      if constexpr (F == kQ8_0) {
        w = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part)));
      } else {
        w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part)), dv, mv);
      }
      _mm256_storeu_ps(out + c * ld + 8 * q, w);
    }
  }
}

// How far ahead of the block being multiplied its group's bytes are asked for (into L1): the
// hardware prefetcher alone let a one-row Q4_1 step stream its weights at 8.8 GB/s where a
// plain read of them ran at 13-15 (one core of an AMX Xeon); 2, 4 and 8 KiB ahead measured
// alike, 1 KiB less well (benchmarks/step_profile.py --quantization gguf). Into L2 instead
// (prefetcht1, as decode attention asks for its blocks), a lone Q4_1 step on one core of a
// Zen 4 EPYC took 8.0 and 8.0 ms against 6.8 and 7.0: these requests are a few lines a block,
// spread over the stream, which L1 keeps up with.
constexpr int64_t kPrefetchBytes = 4096;

inline __m256i broadcast_quad(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, 4);
  return _mm256_set1_epi32(quad);
}

// A block's 8 lane-wise dot products of 4 bytes: quant vectors w times row x's 32 int8 q. With
// VNNI, dpbusd takes the unsigned quants as they are. Without it, maddubs multiplies unsigned
// by signed bytes into int16 pairs. A 4-bit pair is at most 2 x 15 x 127 = 3,810, so the
// block's 8 pair vectors are summed in int16 (at most 30,480) and widened once, where a
// madd per vector took twice the instructions; the sum is exact, so every path still agrees
// bit for bit. Q8_0's pairs (up to 2 x 128 x 127) would overflow that, and its 0-255 quants
// overflow maddubs itself, so it takes its signed q as |q| with q's sign moved onto x, as
// llama.cpp's AVX2 path does, and widens each pair vector.
template <int64_t F, bool kVnni>
inline __m256i block_dot(const __m256i* w, const int8_t* xq) {
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
  static_assert(!kVnni, "dpbusd needs a build with AVX512-VNNI");
#endif
  __m256i dots[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // two short chains
  for (int j = 0; j < 8; ++j) {
    const __m256i xv = broadcast_quad(xq + 4 * j);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if constexpr (kVnni) {
      dots[j & 1] = _mm256_dpbusd_epi32(dots[j & 1], w[j], xv);
      continue;
    }
#endif
    if constexpr (F == kQ8_0) {
      const __m256i pairs =
          _mm256_maddubs_epi16(_mm256_sign_epi8(w[j], w[j]), _mm256_sign_epi8(xv, w[j]));
      dots[j & 1] = _mm256_add_epi32(dots[j & 1], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    } else {
      dots[j & 1] = _mm256_add_epi16(dots[j & 1], _mm256_maddubs_epi16(w[j], xv));
    }
  }
  if constexpr (kVnni || F == kQ8_0) return _mm256_add_epi32(dots[0], dots[1]);
  return _mm256_madd_epi16(_mm256_add_epi16(dots[0], dots[1]), _mm256_set1_epi16(1));
}

// The group of 8 features times R rows: per block, the quant vectors are read and unpacked
// once for all R rows; each row adds 8 lane-wise dot products of 4 bytes (block_dot).
template <int64_t F, int R, bool kVnni>
void group_avx2(const QuantizedRows& x, int64_t r0, const uint8_t* group, float* sums) {
  const int64_t blocks = x.k / kBlock;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* gb = group + b * group_block_bytes(F);
    for (int64_t line = 0; line < group_block_bytes(F); line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(gb) + kPrefetchBytes + line, _MM_HINT_T0);
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb)));
    __m256 m = _mm256_setzero_ps();
    if constexpr (F == kQ4_1) {
      m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 16)));
    }
    __m256i w[8];  // 4 consecutive inputs each: 32 per block
    load_quants<F, !kVnni>(gb, w);  // maddubs needs Q8_0's q signed
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.q.data() + (r0 + r) * x.k + b * kBlock;
      const int64_t i = (r0 + r) * blocks + b;
      __m256i dot = block_dot<F, kVnni>(w, xq);
      constexpr int32_t offset = F == kQ8_0 && !kVnni ? 0 : unsigned_offset(F);
      if constexpr (offset != 0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(offset * x.qsum[i]));
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x.scale[i]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
      if constexpr (F == kQ4_1) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sum[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(sums + r * kGroup, acc[r]);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// The most rows of one group_pair_vnni call: R accumulators beside the 8 quant vectors and a
// few temporaries in the 32 vector registers.
constexpr int kVnniPairRows = 8;

// Two groups (16 features) times R rows with 512-bit dpbusd: each group block's quant vectors
// are unpacked as group_avx2 unpacks them, the two groups' side by side in one 512-bit vector,
// so each row takes 8 dot-product instructions for 16 features where group_avx2 takes 8 for 8.
// Per lane the arithmetic is group_avx2's with VNNI, in the same order, so every row's result
// is bit for bit that path's (and the tiles'). sums [R][16 features].
template <int64_t F, int R>
void group_pair_vnni_rows(const QuantizedRows& x, int64_t r0, const uint8_t* group0,
                          const uint8_t* group1, float* sums) {
  constexpr int32_t offset = unsigned_offset(F);
  const int64_t blocks = x.k / kBlock;
  const auto halves = [](const uint8_t* a, const uint8_t* b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
  };
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* gb0 = group0 + b * group_block_bytes(F);
    const uint8_t* gb1 = group1 + b * group_block_bytes(F);
    for (int64_t line = 0; line < group_block_bytes(F); line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(gb0) + kPrefetchBytes + line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(gb1) + kPrefetchBytes + line, _MM_HINT_T0);
    }
    const __m512 d = halves(gb0, gb1);
    const __m512 m = F == kQ4_1 ? halves(gb0 + 16, gb1 + 16) : _mm512_setzero_ps();
    __m256i w0[8], w1[8];
    load_quants<F, false>(gb0, w0);
    load_quants<F, false>(gb1, w1);
    __m512i w[8];
    for (int j = 0; j < 8; ++j) w[j] = _mm512_inserti64x4(_mm512_castsi256_si512(w0[j]), w1[j], 1);
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.q.data() + (r0 + r) * x.k + b * kBlock;
      const int64_t i = (r0 + r) * blocks + b;
      __m512i dots[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int j = 0; j < 8; ++j) {
        int32_t quad;
        std::memcpy(&quad, xq + 4 * j, 4);
        dots[j & 1] = _mm512_dpbusd_epi32(dots[j & 1], w[j], _mm512_set1_epi32(quad));
      }
      __m512i dot = _mm512_add_epi32(dots[0], dots[1]);
      if constexpr (offset != 0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offset * x.qsum[i]));
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x.scale[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
      if constexpr (F == kQ4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums + 16 * r, acc[r]);
}

// group_pair_vnni_rows for `rows` rows, 1 to kVnniPairRows (r0 on).
template <int64_t F>
void group_pair_vnni(const QuantizedRows& x, int64_t r0, int rows, const uint8_t* group0,
                     const uint8_t* group1, float* sums) {
  switch (rows) {
    case 1: return group_pair_vnni_rows<F, 1>(x, r0, group0, group1, sums);
    case 2: return group_pair_vnni_rows<F, 2>(x, r0, group0, group1, sums);
    case 3: return group_pair_vnni_rows<F, 3>(x, r0, group0, group1, sums);
    case 4: return group_pair_vnni_rows<F, 4>(x, r0, group0, group1, sums);
    case 5: return group_pair_vnni_rows<F, 5>(x, r0, group0, group1, sums);
    case 6: return group_pair_vnni_rows<F, 6>(x, r0, group0, group1, sums);
    case 7: return group_pair_vnni_rows<F, 7>(x, r0, group0, group1, sums);
    default: return group_pair_vnni_rows<F, kVnniPairRows>(x, r0, group0, group1, sums);
  }
}
#endif

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__)
// Tiles as group_pair_tiles configures them (amx_tiles.h's configure): the int32 products
// [rows x 16 features], the rows' int8 x [rows x 32 inputs], and the two groups' quants in the
// layout tile products take [8 input quads x 16 features x 4 bytes]; rows is kTileRows, or
// fewer for a step with fewer rows (tile_shape_rows).
constexpr int kTileRows = 16;  // the most rows of one tile product
constexpr int kTileCount = 3;
constexpr uint16_t kTileShapeBytes[kTileCount] = {64, 32, 64};

struct TileShapeRows {
  uint8_t rows[kTileCount];
};

inline TileShapeRows tile_shape_rows(int rows) {
  return {{static_cast<uint8_t>(rows), static_cast<uint8_t>(rows), 8}};
}

// The int32 dot products of block b for the tiles' rows (r0 on) and two groups' block bytes
// `gb`, into dots [rows][16 features], on tiles 0 (products), 1 (x) and 2 (quants).
template <int64_t F>
inline void tile_dots(const QuantizedRows& x, int64_t r0, int64_t b, const uint8_t* const* gb,
                      uint8_t* quants, int32_t* dots) {
  for (int half = 0; half < 2; ++half) {
    for (int64_t line = 0; line < group_block_bytes(F); line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(gb[half]) + kPrefetchBytes + line, _MM_HINT_T0);
    }
    __m256i w[8];
    load_quants<F, false>(gb[half], w);
    for (int j = 0; j < 8; ++j) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(quants + 64 * j + 32 * half), w[j]);
    }
  }
  _tile_zero(0);
  _tile_loadd(1, x.q.data() + r0 * x.k + b * kBlock, x.k);
  _tile_loadd(2, quants, 64);
  _tile_dpbsud(0, 1, 2);
  _tile_stored(0, dots, 64);
}

// acc[r] (16 features) += block b's dots of row r0 + r, r < rows, scaled as group_avx2 scales
// them.
template <int64_t F>
inline void scale_dots(const QuantizedRows& x, int64_t r0, int rows, int64_t b,
                       const uint8_t* const* gb, const int32_t* dots, __m512* acc) {
  constexpr int32_t offset = unsigned_offset(F);
  const int64_t blocks = x.k / kBlock;
  const auto halves = [&](int64_t at) {
    return _mm512_insertf32x8(
        _mm512_castps256_ps512(_mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(gb[0] + at)))),
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb[1] + at))), 1);
  };
  const __m512 d = halves(0);
  const __m512 m = F == kQ4_1 ? halves(16) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    const int64_t i = (r0 + r) * blocks + b;
    __m512i dot = _mm512_load_si512(dots + 16 * r);
    if constexpr (offset != 0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offset * x.qsum[i]));
    const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x.scale[i]));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
    if constexpr (F == kQ4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum[i]), acc[r]);
  }
}

// `rows` rows (r0 on; at most kTileRows, the tiles configured with tile_shape_rows(rows)) times
// two packed groups (16 features) on AMX-INT8 tiles. Per block of 32 inputs, one tile product
// of the rows' int8 x (read in place) by the two groups' unsigned quants gives the same int32
// dot products as group_avx2's dpbusd (a quant vector is already half a tile row: 4 inputs of
// 8 features), where group_avx2 takes 8 dot-product instructions per row. They are then scaled
// exactly as group_avx2 scales them, a lane per feature, so every row's result is bit for bit
// the VNNI path's. sums [rows][16 features]. (Two sets of tiles, one block's products running
// while the other's were scaled, measured no faster.)
template <int64_t F>
void group_pair_tiles(const QuantizedRows& x, int64_t r0, int rows, const uint8_t* group0,
                      const uint8_t* group1, float* sums) {
  alignas(64) uint8_t quants[8 * 64];
  alignas(64) int32_t dots[kTileRows * 16];
  __m512 acc[kTileRows];
  for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.k / kBlock; ++b) {
    const uint8_t* gb[2] = {group0 + b * group_block_bytes(F), group1 + b * group_block_bytes(F)};
    tile_dots<F>(x, r0, b, gb, quants, dots);
    scale_dots<F>(x, r0, rows, b, gb, dots, acc);
  }
  for (int r = 0; r < rows; ++r) _mm512_storeu_ps(sums + 16 * r, acc[r]);
}
#endif

}  // namespace int8_dot
