// Small-batch linear layers y = x W^T (+ b) over weights kept in their stored format: llama.cpp's
// block-quantized Q8_0, Q4_0 and Q4_1 (GGUF), per-channel int8, bf16 and fp32. At decode batch
// sizes a linear layer is bound by reading its weight, so each weight is read from memory once
// for all the step's rows (the weight-streaming GEMV of llama.cpp and of weight-only kernels
// such as Marlin). The dequantized weight never exists at full size. Three kinds of products:
// - int8 (GGUF formats, packed at load in groups of 8 output features): x quantized per
//   32-input block, integer dot products on the stored bytes (int8_dot.h), as llama.cpp
//   computes;
// - float32 (the row formats): a tile of 4 output columns is dequantized into an L1-resident
//   buffer, 512 inputs at a time, and every row is multiplied against it in float32 before the
//   next tile is read; the only rounding beyond the dequantized product's is the summation
//   order;
// - bf16 pairs (the row formats, bf16 x, AVX512-BF16): the same tile rounded to bf16 and
//   multiplied by dpbf16ps, as the dense bf16 model would compute.
//
// Paths: AVX-512 (16 lanes; VNNI for int8), AVX2 + FMA (8 lanes) and scalar, each compiled where
// the compiler targets it (-march=native) and chosen at run time from what the CPU reports;
// `path` forces a narrower one (tests compare every path present against a
// dequantize-then-multiply reference).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#include <immintrin.h>

#include "int8_dot.h"
#include "stored_blocks.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#define NALAR_INT8_TILES 1
#include "amx_tiles.h"
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define NALAR_VNNI 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace stored;  // the formats, block sizes and helpers shared with int8_dot.h

enum Path : int64_t { kBest = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };
enum Products : int64_t { kFloat32 = 0, kInt8 = 1, kBf16Pairs = 2 };

constexpr int64_t kChunk = 512;         // inputs dequantized per buffer fill (16 blocks)
constexpr int64_t kCols = 4;            // output columns per tile
constexpr int64_t kRows = 4;            // rows per register tile
constexpr int64_t kMacsPerTask = 1 << 16;  // under this much work, one thread

// Bytes a row of `k` weights takes (GGUF layout; the per-channel int8 row has a float32 scale
// in front of its k int8 values).
int64_t row_bytes(int64_t format, int64_t k) {
  TORCH_CHECK(format >= kQ8_0 && format <= kF32, "unknown weight format ", format);
  return row_header_bytes(format) + k / kBlock * block_bytes(format);
}

// The float a row's weights are scaled by after the dot product (per-channel int8), else 1.
float row_scale(int64_t format, const uint8_t* row) {
  if (format != kInt8Channel) return 1.f;
  float scale;
  std::memcpy(&scale, row, 4);
  return scale;
}

// ---- dequantizing one block of 32 weights of a row format into out[0..32) ------------------

template <int64_t format>
inline void block_scalar(const uint8_t* b, float* out) {
  switch (format) {
    case kInt8Channel:
      for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(static_cast<int8_t>(b[j]));
      return;
    case kBF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(b);
      for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(c10::BFloat16(h[j], c10::BFloat16::from_bits()));
      return;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
template <int64_t format>
inline void block_avx2(const uint8_t* b, float* out) {
  switch (format) {
    case kInt8Channel:
      for (int i = 0; i < 4; ++i) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * i));
        _mm256_storeu_ps(out + 8 * i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
      }
      return;
    case kBF16:
      for (int i = 0; i < 4; ++i) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * i));
        _mm256_storeu_ps(out + 8 * i, _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
      }
      return;
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <int64_t format>
inline void block_avx512(const uint8_t* b, float* out) {
  switch (format) {
    case kInt8Channel:
      for (int i = 0; i < 2; ++i) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * i));
        _mm512_storeu_ps(out + 16 * i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
      }
      return;
    case kBF16:
      for (int i = 0; i < 2; ++i) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * i));
        _mm512_storeu_ps(out + 16 * i, _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
      }
      return;
  }
}
#endif

// ---- the register tile: sums[r][c] += dot(x row r, w column c) over n inputs -------------

template <int R, int C>
void tile_scalar(const float* x, int64_t ldx, const float* const* w, int64_t n, float* sums) {
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < n; ++k) acc += x[r * ldx + k] * w[c][k];
      sums[r * kCols + c] += acc;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
template <int R, int C>
void tile_avx2(const float* x, int64_t ldx, const float* const* w, int64_t n, float* sums) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w[c] + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r * kCols + c] += reduce_add(acc[r][c]);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <int R, int C>
void tile_avx512(const float* x, int64_t ldx, const float* const* w, int64_t n, float* sums) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 16) {
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_ps(w[c] + k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r * kCols + c] += _mm512_reduce_add_ps(acc[r][c]);
}
#endif

// Dequantizes `count` consecutive blocks of one row (the per-block code inlined: called through
// a pointer once per buffer fill, not once per block).
using BlocksFn = void (*)(const uint8_t*, int64_t, float*);

#if defined(__AVX512BF16__)
// Pair products (AVX512-BF16's dpbf16ps: 32 products a step into 16 float32 sums): bf16 x
// against the weights rounded to bf16, as the dense bf16 model computes; twice the products of
// the float32 tile per instruction. x rows are bf16; w[c] are n bf16 weights.
template <int R, int C>
void tile_bf16_pairs(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t n,
                     float* sums) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 32) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w[c] + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r * kCols + c] += _mm512_reduce_add_ps(acc[r][c]);
}

// n floats (a multiple of 32) to bf16, rounded to nearest even.
void to_bf16(const float* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(in + i + 16), _mm512_loadu_ps(in + i));
    _mm512_storeu_si512(out + i, (__m512i)pair);
  }
}
#endif

template <int64_t format, void (*block)(const uint8_t*, float*)>
void blocks(const uint8_t* data, int64_t count, float* out) {
  for (int64_t b = 0; b < count; ++b) block(data + b * block_bytes(format), out + b * kBlock);
}

#define NALAR_BLOCKS_TABLE(fn) {blocks<kInt8Channel, fn<kInt8Channel>>, blocks<kBF16, fn<kBF16>>}
using TileFn = void (*)(const float*, int64_t, const float* const*, int64_t, float*);
using Bf16TileFn = void (*)(const uint16_t*, int64_t, const uint16_t* const*, int64_t, float*);

// tiles[r - 1][c - 1] multiplies r rows by c columns.
struct Kernels {
  BlocksFn blocks[2];  // per-channel int8, bf16 (format - kInt8Channel); fp32 is read in place
  TileFn tiles[kRows][kCols];
  Bf16TileFn bf16_tiles[kRows][kCols];  // set where the build and CPU have AVX512-BF16
};

#define NALAR_TILE_TABLE(fn)                                                              \
  {{fn<1, 1>, fn<1, 2>, fn<1, 3>, fn<1, 4>}, {fn<2, 1>, fn<2, 2>, fn<2, 3>, fn<2, 4>},   \
   {fn<3, 1>, fn<3, 2>, fn<3, 3>, fn<3, 4>}, {fn<4, 1>, fn<4, 2>, fn<4, 3>, fn<4, 4>}}

bool cpu_has(Path path) {
  __builtin_cpu_init();
  switch (path) {
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    default: return true;
  }
}

// The paths compiled into this build that this CPU runs, widest first (asked once: every
// layer's call looks them up).
const std::vector<Path>& available_paths() {
  static const std::vector<Path> paths = [] {
    std::vector<Path> found;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (cpu_has(kAvx512)) found.push_back(kAvx512);
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (cpu_has(kAvx2)) found.push_back(kAvx2);
#endif
    found.push_back(kScalar);
    return found;
  }();
  return paths;
}

Kernels kernels_for(Path path) {
  const auto& paths = available_paths();
  if (path == kBest) path = paths.front();
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(),
              "path ", static_cast<int64_t>(path), " is not available on this CPU or build");
  switch (path) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    case kAvx512:
#if defined(__AVX512BF16__)
      if (__builtin_cpu_supports("avx512bf16")) {
        return {NALAR_BLOCKS_TABLE(block_avx512), NALAR_TILE_TABLE(tile_avx512),
                NALAR_TILE_TABLE(tile_bf16_pairs)};
      }
#endif
      return {NALAR_BLOCKS_TABLE(block_avx512), NALAR_TILE_TABLE(tile_avx512), {}};
#endif
#if defined(__AVX2__) && defined(__FMA__)
    case kAvx2: return {NALAR_BLOCKS_TABLE(block_avx2), NALAR_TILE_TABLE(tile_avx2), {}};
#endif
    default: return {NALAR_BLOCKS_TABLE(block_scalar), NALAR_TILE_TABLE(tile_scalar), {}};
  }
}

// ---- one tile of up to kCols output columns, all rows ----------------------------------------

struct Problem {
  const float* x;       // [rows, k] float32 (null for pair products)
  const uint16_t* xb;   // [rows, k] bf16 for pair products, else null
  int64_t rows, k;
  const uint8_t* w;     // [n, row_bytes]
  int64_t format, row_bytes;
};

void pair_products(const Problem& p, const Kernels& kern, const float* const* w, int64_t cols,
                   int64_t k0, int64_t n, uint16_t* buffer_bf16, float* sums) {
#if defined(__AVX512BF16__)
  const uint16_t* wb[kCols];
  for (int64_t c = 0; c < cols; ++c) {
    to_bf16(w[c], n, buffer_bf16 + c * kChunk);
    wb[c] = buffer_bf16 + c * kChunk;
  }
  for (int64_t r0 = 0; r0 < p.rows; r0 += kRows) {
    const int64_t rows = std::min(kRows, p.rows - r0);
    kern.bf16_tiles[rows - 1][cols - 1](p.xb + r0 * p.k + k0, p.k, wb, n, sums + r0 * kCols);
  }
#endif
}

// Adds the tile's dot products over inputs [k0, k0 + n) into sums [rows][kCols].
void chunk(const Problem& p, const Kernels& kern, int64_t col0, int64_t cols, int64_t k0,
           int64_t n, float* buffer, uint16_t* buffer_bf16, float* sums) {
  const float* w[kCols];
  for (int64_t c = 0; c < cols; ++c) {
    const uint8_t* row = p.w + (col0 + c) * p.row_bytes;
    if (p.format == kF32) {  // already floats: multiply straight from the weight
      w[c] = reinterpret_cast<const float*>(row) + k0;
      continue;
    }
    const uint8_t* data = row + row_header_bytes(p.format);
    float* out = buffer + c * kChunk;
    kern.blocks[p.format - kInt8Channel](data + k0 / kBlock * block_bytes(p.format), n / kBlock, out);
    w[c] = out;
  }
  if (p.xb != nullptr) {
    pair_products(p, kern, w, cols, k0, n, buffer_bf16, sums);
    return;
  }
  for (int64_t r0 = 0; r0 < p.rows; r0 += kRows) {
    const int64_t rows = std::min(kRows, p.rows - r0);
    kern.tiles[rows - 1][cols - 1](p.x + r0 * p.k + k0, p.k, w, n, sums + r0 * kCols);
  }
}

template <typename Out>
void column_tile(const Problem& p, const Kernels& kern, int64_t col0, int64_t cols,
                 const float* bias, Out* y, int64_t n_out, std::vector<float>& sums,
                 float* buffer, uint16_t* buffer_bf16) {
  sums.assign(p.rows * kCols, 0.f);
  for (int64_t k0 = 0; k0 < p.k; k0 += kChunk) {
    chunk(p, kern, col0, cols, k0, std::min(kChunk, p.k - k0), buffer, buffer_bf16,
          sums.data());
  }
  for (int64_t c = 0; c < cols; ++c) {
    const float scale = row_scale(p.format, p.w + (col0 + c) * p.row_bytes);
    const float b = bias != nullptr ? bias[col0 + c] : 0.f;
    for (int64_t r = 0; r < p.rows; ++r) {
      y[r * n_out + col0 + c] = static_cast<Out>(sums[r * kCols + c] * scale + b);
    }
  }
}

template <typename Out>
void run(const Problem& p, const Kernels& kern, int64_t n_out, const float* bias, Out* y) {
  const int64_t tiles = (n_out + kCols - 1) / kCols;
  const int64_t macs_per_tile = kCols * p.k * p.rows;
  const int64_t grain = std::max<int64_t>(1, kMacsPerTask / std::max<int64_t>(macs_per_tile, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> sums;
    alignas(64) float buffer[kCols * kChunk];
    alignas(64) uint16_t buffer_bf16[kCols * kChunk];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t col0 = t * kCols;
      column_tile(p, kern, col0, std::min(kCols, n_out - col0), bias, y, n_out, sums, buffer,
                  buffer_bf16);
    }
  });
}

// ---- GGUF formats: packed groups times int8 activations (int8_dot.h) ----------------------

using int8_dot::kGroup;

constexpr int kInt8Rows = 4;  // rows per group call (its unpacked quants reused across them)

using GroupFn = void (*)(const int8_dot::QuantizedRows&, int64_t, const uint8_t*, float*);
using PairFn = void (*)(const int8_dot::QuantizedRows&, int64_t, int, const uint8_t*,
                        const uint8_t*, float*);
constexpr int64_t kMaxPairRows = 16;  // the most rows of one PairFn call (a tile's)

// The fewest rows that take pairs of groups through 512-bit VNNI on an AMD CPU. On a Zen 4
// EPYC, one thread, 30 layers of SmolLM2's Q4_1 projections read from memory (66 MB a step),
// pairs from 1 row against from 5, three rounds alternating: 1 row 6.1, 5.8, 5.7 against 3.0,
// 3.0, 4.3 ms; 3 rows 6.1, 5.6, 6.0 against 5.6, 3.9, 6.2; 4 rows 6.3, 6.8, 6.1 against 5.8,
// 4.7, 7.5; a lone decode step 12.1, 10.8, 11.7 against 7.4, 7.3, 6.3 ms
// (results/epyc-avx512bf16/vnni-pair-rows-91c1931/). One group at a time a lone row streams
// its weights at 15-22 GB/s, in pairs at 11-12 (also in throwaway builds that prefetched each
// of the two streams, or nothing); with the weights in cache the pairs are faster at every row
// count on one thread (results/epyc-avx512bf16/vnni-pairs-160d066/), and from memory they are
// even at 5 rows and take 0.84-1.01x at 8 to 16 (the same folder's from17/). On the AMX Xeons pairs
// gained from one row (results/xeon-amx/vnni-pairs-160d066/), so Intel CPUs take them from 1.
// Zen 5, whose 512-bit units are not split in halves, was not measured.
constexpr int kVnniPairMinRowsAmd = 5;

// groups[r - 1] multiplies r rows by one packed group of one format. Two groups at once, bit
// for bit as groups would: pair_tiles, where AMX-INT8 runs, up to 16 rows
// (int8_dot::group_pair_tiles); pair_vnni, where AVX512-VNNI runs, up to 8 rows a pass, for
// steps of pair_vnni_min_rows or more (int8_dot::group_pair_vnni).
struct Int8Kernels {
  GroupFn groups[kInt8Rows];
  PairFn pair_tiles = nullptr;
  PairFn pair_vnni = nullptr;
  int64_t pair_vnni_min_rows = 1;
};

#define NALAR_GROUP_TABLE(fn, ...) \
  {{fn<__VA_ARGS__, 1>, fn<__VA_ARGS__, 2>, fn<__VA_ARGS__, 3>, fn<__VA_ARGS__, 4>}}

template <int64_t F, int R>
void group_vnni(const int8_dot::QuantizedRows& x, int64_t r0, const uint8_t* g, float* sums) {
  int8_dot::group_avx2<F, R, true>(x, r0, g, sums);
}
template <int64_t F, int R>
void group_maddubs(const int8_dot::QuantizedRows& x, int64_t r0, const uint8_t* g, float* sums) {
  int8_dot::group_avx2<F, R, false>(x, r0, g, sums);
}

template <int64_t F>
Int8Kernels int8_kernels_for(Path path) {
  switch (path) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    case kAvx512:
#ifdef NALAR_VNNI
      if (__builtin_cpu_supports("avx512vnni")) {
        Int8Kernels kernels = NALAR_GROUP_TABLE(group_vnni, F);
        kernels.pair_vnni = int8_dot::group_pair_vnni<F>;
        if (__builtin_cpu_is("amd")) kernels.pair_vnni_min_rows = kVnniPairMinRowsAmd;
#ifdef NALAR_INT8_TILES
        if (__builtin_cpu_supports("amx-int8") && nalar_tiles::granted()) {
          kernels.pair_tiles = int8_dot::group_pair_tiles<F>;
        }
#endif
        return kernels;
      }
#endif
      [[fallthrough]];
    case kAvx2:
      return NALAR_GROUP_TABLE(group_maddubs, F);
#endif
    default:
      return NALAR_GROUP_TABLE(int8_dot::group_scalar, F);
  }
}

Int8Kernels int8_kernels(int64_t format, Path path) {
  const auto& paths = available_paths();
  if (path == kBest) path = paths.front();
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(),
              "path ", static_cast<int64_t>(path), " is not available on this CPU or build");
  switch (format) {
    case kQ8_0: return int8_kernels_for<kQ8_0>(path);
    case kQ4_0: return int8_kernels_for<kQ4_0>(path);
    case kQ4_1: return int8_kernels_for<kQ4_1>(path);
  }
  TORCH_CHECK(false, "int8 activations need a Q8_0, Q4_0 or Q4_1 weight, got format ", format);
}

// sums [rows][stride] (features col0 on, `cols` of them) plus the bias into y's rows r0 on.
template <typename Out>
void store_rows(const float* sums, int64_t stride, int64_t rows, int64_t r0, int64_t col0,
                int64_t cols, int64_t n_out, const float* bias, Out* y) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float b = bias != nullptr ? bias[col0 + c] : 0.f;
      y[(r0 + r) * n_out + col0 + c] = static_cast<Out>(sums[r * stride + c] + b);
    }
  }
}

// One group's rows from `first_row` on, kInt8Rows at a time.
template <typename Out>
void group_rows(const int8_dot::QuantizedRows& x, const uint8_t* group, int64_t g,
                int64_t first_row, int64_t n_out, const Int8Kernels& kern, const float* bias,
                Out* y) {
  alignas(32) float sums[kInt8Rows * kGroup];
  const int64_t col0 = g * kGroup, cols = std::min(kGroup, n_out - col0);
  for (int64_t r0 = first_row; r0 < x.rows; r0 += kInt8Rows) {
    const int64_t rows = std::min<int64_t>(kInt8Rows, x.rows - r0);
    kern.groups[rows - 1](x, r0, group, sums);
    store_rows(sums, kGroup, rows, r0, col0, cols, n_out, bias, y);
  }
}

// Fewest rows a step takes on AMX-INT8 tiles. A tile product costs the same for any number of
// rows up to 16, but each block's quants are first unpacked and stored for it, so a tile pass
// has a fixed cost: SmolLM2's four Q4_1 projections took about 0.3 ms on one thread from 4 rows
// to 8, where VNNI grows from 0.18 ms at 4 rows; tiles were faster from 12 rows (0.38-0.46
// against 0.48-0.52 ms) and mixed at 10 (results/xeon-amx/int8-short-tiles-513d5aa/).
constexpr int64_t kMinTileRows = 12;

// Groups in pairs, two groups' 16 features at once: `pair` over `step` rows at a time up to
// `paired_rows`, then the rows past those, and an odd last group, one group at a time.
template <typename Out>
void pair_of_groups(const int8_dot::QuantizedRows& x, const uint8_t* w, int64_t bytes,
                    int64_t pair_index, PairFn pair, int64_t step, int64_t paired_rows,
                    int64_t n_out, const Int8Kernels& kern, const float* bias, Out* y) {
  const int64_t g = 2 * pair_index, col0 = g * kGroup;
  if (g + 1 == int8_dot::groups(n_out)) {
    group_rows(x, w + g * bytes, g, 0, n_out, kern, bias, y);
    return;
  }
  alignas(64) float sums[kMaxPairRows * 2 * kGroup];
  for (int64_t r0 = 0; r0 < paired_rows; r0 += step) {
    const int rows = static_cast<int>(std::min(step, paired_rows - r0));
    pair(x, r0, rows, w + g * bytes, w + (g + 1) * bytes, sums);
    store_rows(sums, 2 * kGroup, rows, r0, col0, std::min(2 * kGroup, n_out - col0), n_out,
               bias, y);
  }
  group_rows(x, w + g * bytes, g, paired_rows, n_out, kern, bias, y);
  group_rows(x, w + (g + 1) * bytes, g + 1, paired_rows, n_out, kern, bias, y);
}

// Groups are read once, in order, each group's blocks consecutively: one stream the hardware
// prefetcher follows (the feature-at-a-time layout read 4 streams and needed software
// prefetching); two streams where groups go in pairs. Where AMX-INT8 runs and a step has
// kMinTileRows rows or more, pairs go on tiles, 16 rows at a time (or all of them in one tile,
// when fewer), the rows past the last 16 one group at a time. Else, where AVX512-VNNI runs and
// the step has pair_vnni_min_rows rows or more, pairs go through 512-bit dot products, 8 rows
// at a time.
template <typename Out>
void run_int8(const int8_dot::QuantizedRows& x, const uint8_t* w, int64_t format, int64_t n_out,
              const Int8Kernels& kern, const float* bias, Out* y) {
  const int64_t bytes = int8_dot::group_bytes(format, x.k);
  const int64_t macs_per_group = kGroup * x.k * x.rows;
  const int64_t grain = std::max<int64_t>(1, kMacsPerTask / std::max<int64_t>(macs_per_group, 1));
  [[maybe_unused]] const int64_t pairs = (int8_dot::groups(n_out) + 1) / 2;
  [[maybe_unused]] const int64_t pair_grain = std::max<int64_t>(1, grain / 2);
#ifdef NALAR_INT8_TILES
  static_assert(int8_dot::kTileRows <= kMaxPairRows);
  if (kern.pair_tiles != nullptr && x.rows >= kMinTileRows) {
    const int tile = static_cast<int>(std::min<int64_t>(int8_dot::kTileRows, x.rows));
    const int64_t tiled_rows = x.rows / tile * tile;
    at::parallel_for(0, pairs, pair_grain, [&](int64_t begin, int64_t end) {
      nalar_tiles::configure(int8_dot::kTileCount, int8_dot::tile_shape_rows(tile).rows,
                              int8_dot::kTileShapeBytes);
      for (int64_t pair = begin; pair < end; ++pair) {
        pair_of_groups(x, w, bytes, pair, kern.pair_tiles, tile, tiled_rows, n_out, kern, bias, y);
      }
      _tile_release();
    });
    return;
  }
#endif
#ifdef NALAR_VNNI
  static_assert(int8_dot::kVnniPairRows <= kMaxPairRows);
  if (kern.pair_vnni != nullptr && x.rows >= kern.pair_vnni_min_rows) {
    at::parallel_for(0, pairs, pair_grain, [&](int64_t begin, int64_t end) {
      for (int64_t pair = begin; pair < end; ++pair) {
        pair_of_groups(x, w, bytes, pair, kern.pair_vnni, int8_dot::kVnniPairRows, x.rows,
                       n_out, kern, bias, y);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, int8_dot::groups(n_out), grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) group_rows(x, w + g * bytes, g, 0, n_out, kern, bias, y);
  });
}

// The bytes a weight of `format` takes: GGUF formats packed in groups, the rest as rows.
std::vector<int64_t> weight_shape(int64_t format, int64_t out_features, int64_t in_features) {
  if (int8_dot::is_gguf(format)) {
    return {int8_dot::groups(out_features), int8_dot::group_bytes(format, in_features)};
  }
  return {out_features, row_bytes(format, in_features)};
}

void check_weight(const at::Tensor& weight, int64_t format, int64_t out_features,
                  int64_t in_features) {
  TORCH_CHECK(format >= kQ8_0 && format <= kF32, "unknown weight format ", format);
  TORCH_CHECK(in_features > 0 && in_features % kBlock == 0,
              "in_features must be a positive multiple of ", kBlock, ", got ", in_features);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte
              && weight.is_contiguous(), "weight: contiguous uint8 bytes on the CPU");
  const auto shape = weight_shape(format, out_features, in_features);
  TORCH_CHECK(weight.sizes() == at::IntArrayRef(shape), "weight must be ", at::IntArrayRef(shape),
              " bytes for this format and size (GGUF formats packed: pack()), got ",
              weight.sizes());
}

}  // namespace

// x [M, K] float32 or bfloat16; weight: for a GGUF format its packed groups
// [ceil(N / 8), group bytes] (pack()), else its rows [N, row_bytes(format, K)] uint8; bias [N]
// float32 or None; path 0 picks the widest this CPU has. products: GGUF formats take only kInt8
// (x quantized per block to int8, integer products: int8_dot.h); the row formats take kFloat32
// (x in float32 times the weights dequantized to float32) or kBf16Pairs (bf16 x, AVX512-BF16:
// bf16 x times the weights rounded to bf16). Returns [M, N] in x's dtype.
at::Tensor weight_linear(at::Tensor x, at::Tensor weight, int64_t format, int64_t out_features,
                         c10::optional<at::Tensor> bias, int64_t path, int64_t products) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x: [M, K] on the CPU");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x: float32 or bfloat16");
  const int64_t k = x.size(1);
  check_weight(weight, format, out_features, k);
  at::Tensor bias_f;
  if (bias.has_value()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.dim() == 1 && bias_f.size(0) == out_features, "bias: [out_features]");
  }
  TORCH_CHECK(products >= kFloat32 && products <= kBf16Pairs, "unknown products ", products);
  TORCH_CHECK(int8_dot::is_gguf(format) == (products == kInt8),
              int8_dot::is_gguf(format) ? "GGUF formats multiply with int8 activations only"
                                        : "int8 activations need a Q8_0, Q4_0 or Q4_1 weight",
              ", got format ", format);
  auto y = at::empty({x.size(0), out_features}, x.options());
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (products == kInt8) {
    const Int8Kernels kern = int8_kernels(format, static_cast<Path>(path));
    const at::Tensor xc = x.contiguous();
    int8_dot::QuantizedRows xq;
    const uint8_t* w = weight.data_ptr<uint8_t>();
    if (dtype == at::kFloat) {
      xq.quantize(xc.data_ptr<float>(), x.size(0), k);
      run_int8(xq, w, format, out_features, kern, b, y.data_ptr<float>());
    } else {
      xq.quantize(xc.data_ptr<at::BFloat16>(), x.size(0), k);
      run_int8(xq, w, format, out_features, kern, b, y.data_ptr<at::BFloat16>());
    }
    return y;
  }
  const bool pairs = products == kBf16Pairs;
  // float32 x for the float32 products; pair products read bf16 x as it is.
  const at::Tensor xf = pairs ? x.contiguous() : x.to(at::kFloat).contiguous();
  const Kernels kern = kernels_for(static_cast<Path>(path));
  TORCH_CHECK(!pairs || (dtype == at::kBFloat16 && kern.bf16_tiles[0][0] != nullptr),
              "bf16 pair products need bfloat16 x and a CPU and build with AVX512-BF16");
  const float* x32 = pairs ? nullptr : xf.data_ptr<float>();
  const uint16_t* xb = pairs ? reinterpret_cast<const uint16_t*>(xf.data_ptr<at::BFloat16>())
                             : nullptr;
  const Problem p{x32, xb, x.size(0), k, weight.data_ptr<uint8_t>(), format,
                  row_bytes(format, k)};
  if (dtype == at::kFloat) {
    run(p, kern, out_features, b, y.data_ptr<float>());
  } else {
    run(p, kern, out_features, b, y.data_ptr<at::BFloat16>());
  }
  return y;
}

// rows [N, row_bytes(format, K)] uint8, GGUF's rows of a Q8_0, Q4_0 or Q4_1 tensor. Returns
// [ceil(N / 8), group bytes]: the same bytes packed in groups of 8 features (int8_dot.h).
at::Tensor pack(at::Tensor rows, int64_t format, int64_t in_features) {
  TORCH_CHECK(int8_dot::is_gguf(format), "only GGUF formats are packed, got format ", format);
  TORCH_CHECK(in_features > 0 && in_features % kBlock == 0,
              "in_features must be a positive multiple of ", kBlock, ", got ", in_features);
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kByte && rows.dim() == 2
              && rows.size(1) == row_bytes(format, in_features),
              "rows must be uint8 [N, ", row_bytes(format, in_features), "] on the CPU");
  const int64_t n = rows.size(0);
  const at::Tensor src = rows.contiguous();
  auto out = at::zeros({int8_dot::groups(n), int8_dot::group_bytes(format, in_features)}, at::kByte);
  const uint8_t* in = src.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t bytes = row_bytes(format, in_features), blocks = in_features / kBlock;
  for (int64_t f = 0; f < n; ++f) {
    uint8_t* group = dst + f / kGroup * out.size(1);
    for (int64_t b = 0; b < blocks; ++b) {
      int8_dot::pack_block(format, in + f * bytes + b * block_bytes(format), f % kGroup,
                           group + b * int8_dot::group_block_bytes(format));
    }
  }
  return out;
}

// The inverse of pack(): packed [ceil(N / 8), group bytes] to GGUF's rows [N, row bytes].
at::Tensor unpack(at::Tensor packed, int64_t format, int64_t out_features, int64_t in_features) {
  check_weight(packed, format, out_features, in_features);
  auto out = at::empty({out_features, row_bytes(format, in_features)}, at::kByte);
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t bytes = row_bytes(format, in_features), blocks = in_features / kBlock;
  for (int64_t f = 0; f < out_features; ++f) {
    const uint8_t* group = src + f / kGroup * packed.size(1);
    for (int64_t b = 0; b < blocks; ++b) {
      int8_dot::unpack_block(format, group + b * int8_dot::group_block_bytes(format), f % kGroup,
                             dst + f * bytes + b * block_bytes(format));
    }
  }
  return out;
}

// `count` float32 values into out as they are, or as bf16 rounded to nearest even (what
// torch's .to(bfloat16) does, so a bf16 dequantization equals the float32 one converted).
inline void store_as(const float* src, float* out, int64_t count) {
  std::copy(src, src + count, out);
}

inline void store_as(const float* src, at::BFloat16* out, int64_t count) {
  at::vec::convert(src, out, count);
}

// Every feature of a packed weight into out [N, K], a group at a time: float32 straight into
// out, bf16 through a float32 group (K x 8 floats, in L2) converted as it is finished.
template <typename Out>
void dequantize_packed(const uint8_t* w, int64_t format, int64_t n, int64_t k, Path path,
                       Out* out) {
  using BlockFn = void (*)(const uint8_t*, float*, int64_t);
  BlockFn simd = nullptr;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (path != kScalar) {
    simd = format == kQ8_0 ? int8_dot::dequantize_group_block_avx2<kQ8_0>
         : format == kQ4_0 ? int8_dot::dequantize_group_block_avx2<kQ4_0>
                           : int8_dot::dequantize_group_block_avx2<kQ4_1>;
  }
#endif
  const int64_t bytes = int8_dot::group_bytes(format, k), blocks = k / kBlock;
  at::parallel_for(0, int8_dot::groups(n), 8, [&](int64_t begin, int64_t end) {
    std::vector<float> group;  // a group's float32, where it cannot land in out directly
    for (int64_t g = begin; g < end; ++g) {
      const int64_t features = std::min(kGroup, n - g * kGroup);
      float* dst = nullptr;
      if constexpr (std::is_same_v<Out, float>) {
        if (features == kGroup) dst = out + g * kGroup * k;
      }
      if (dst == nullptr) {
        group.resize(kGroup * k);  // the last group's padding features land here, then go
        dst = group.data();
      }
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* gb = w + g * bytes + b * int8_dot::group_block_bytes(format);
        if (simd != nullptr) {
          simd(gb, dst + b * kBlock, k);
          continue;
        }
        for (int64_t c = 0; c < kGroup; ++c) {
          int8_dot::dequantize_block(format, gb, c, dst + c * k + b * kBlock);
        }
      }
      if (dst == group.data()) store_as(dst, out + g * kGroup * k, features * k);
    }
  });
}

// Features `index` [T] of a weight into out [T, K] (an embedding lookup; all features for a
// per-row format), a feature at a time through a float32 row.
template <typename Out>
void dequantize_features(const uint8_t* w, int64_t format, int64_t k, int64_t bytes,
                         const Kernels& kern, const int64_t* index, int64_t count, Out* out) {
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row_buffer(k);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t f = index[i];
      float* o = row_buffer.data();
      if (int8_dot::is_gguf(format)) {
        const uint8_t* group = w + f / kGroup * bytes;
        for (int64_t b = 0; b < blocks; ++b) {
          int8_dot::dequantize_block(format, group + b * int8_dot::group_block_bytes(format),
                                     f % kGroup, o + b * kBlock);
        }
      } else if (format == kF32) {
        std::memcpy(o, w + f * bytes, 4 * k);
      } else {
        const uint8_t* row = w + f * bytes;
        kern.blocks[format - kInt8Channel](row + row_header_bytes(format), blocks, o);
        const float scale = row_scale(format, row);
        if (scale != 1.f) {
          for (int64_t j = 0; j < k; ++j) o[j] *= scale;
        }
      }
      store_as(o, out + i * k, k);
    }
  });
}

// The weight (all features, or those in `index`) into out, by groups where the format packs
// them, else a feature at a time.
template <typename Out>
void dequantize_into(const uint8_t* w, int64_t format, int64_t n, int64_t k, int64_t bytes,
                     int64_t path, const Kernels& kern, const at::Tensor& index, Out* out) {
  if (!index.defined() && int8_dot::is_gguf(format)) {
    const Path resolved = path == kBest ? available_paths().front() : static_cast<Path>(path);
    dequantize_packed(w, format, n, k, resolved, out);
    return;
  }
  const at::Tensor features = index.defined() ? index : at::arange(n, at::kLong);
  dequantize_features(w, format, k, bytes, kern, features.data_ptr<int64_t>(), features.numel(),
                      out);
}

// weight as weight_linear takes it (N output features of K inputs); rows: int64 [T] feature
// indices (an embedding lookup), or None for all. Returns [N or T, K] of `dtype` (float32, or
// bfloat16 rounded to nearest even): the weights as the kernel multiplies them (per-channel
// int8 rows times their scale).
at::Tensor dequantize(at::Tensor weight, int64_t format, int64_t out_features, int64_t in_features,
                      c10::optional<at::Tensor> rows, int64_t path, at::ScalarType dtype) {
  check_weight(weight, format, out_features, in_features);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "weights dequantize to float32 or bfloat16, not ", dtype);
  const Kernels kern = kernels_for(static_cast<Path>(path));  // checks the path
  const uint8_t* w = weight.data_ptr<uint8_t>();
  at::Tensor index;
  if (rows.has_value()) {
    index = rows->to(at::kLong).contiguous();
    const int64_t* features = index.data_ptr<int64_t>();
    for (int64_t i = 0; i < index.numel(); ++i) {
      TORCH_CHECK(features[i] >= 0 && features[i] < out_features, "row ", features[i],
                  " out of range for ", out_features, " features");
    }
  }
  auto out = at::empty({index.defined() ? index.numel() : out_features, in_features},
                       at::TensorOptions().dtype(dtype));
  if (dtype == at::kBFloat16) {
    dequantize_into(w, format, out_features, in_features, weight.size(1), path, kern, index,
                    out.data_ptr<at::BFloat16>());
  } else {
    dequantize_into(w, format, out_features, in_features, weight.size(1), path, kern, index,
                    out.data_ptr<float>());
  }
  return out;
}

std::vector<std::string> paths() {
  std::vector<std::string> names;
  for (Path p : available_paths()) {
    names.push_back(p == kAvx512 ? "avx512" : p == kAvx2 ? "avx2" : "scalar");
  }
  return names;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("weight_linear", &weight_linear, "x W^T (+ b) over weights in their stored format",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("format"),
        pybind11::arg("out_features"), pybind11::arg("bias"), pybind11::arg("path") = 0,
        pybind11::arg("products") = 0,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("has_int8_tiles", [] { return int8_kernels(kQ4_1, kBest).pair_tiles != nullptr; },
        "whether GGUF formats take AMX-INT8 tiles here (from int8_tile_min_rows rows on)");
  m.attr("int8_tile_min_rows") = kMinTileRows;
  m.def("int8_pair_min_rows", [] {
    const Int8Kernels kernels = int8_kernels(kQ4_1, kBest);
    return kernels.pair_vnni != nullptr ? kernels.pair_vnni_min_rows : int64_t{0};
  }, "the fewest rows whose steps take GGUF groups in pairs through 512-bit VNNI (0: never)");
  m.def("has_bf16_pairs", [] { return kernels_for(kBest).bf16_tiles[0][0] != nullptr; },
        "whether bf16 pair products (products=2) run here");
  m.def("dequantize", &dequantize,
        "stored weights (all, or the rows asked for) as float32 or bfloat16",
        pybind11::arg("weight"), pybind11::arg("format"), pybind11::arg("out_features"),
        pybind11::arg("in_features"), pybind11::arg("rows") = pybind11::none(),
        pybind11::arg("path") = 0, pybind11::arg("dtype") = at::kFloat,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("pack", &pack, "GGUF rows packed in groups of 8 features for the int8 kernel",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("unpack", &unpack, "packed groups back to GGUF rows",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("row_bytes", &row_bytes, "bytes of one stored row of k weights");
  m.def("paths", &paths, "the paths this build and CPU run, widest first");
}
