// Causal flash attention for bf16 prefill spans (CPU), on Intel AMX tiles or in AVX512-BF16.
//
// A span of new tokens attends to its sequence's cached context (read through the block table
// where it lies in the paged cache) and causally to itself, with the online softmax of flash
// attention (Dao et al. 2022) over key blocks of kKeys. Keys and values are packed once per
// call into bf16 pairs: a key row holds one pair of dims for 16 keys, a value row one pair of
// keys for 16 dims. Two backends consume those rows:
// - tiles: the AMX tile unit (TMUL: 16 x 16 fp32 accumulators fed bf16 pairs), where the CPU
//   has AMX-BF16 and Linux grants the tile registers;
// - pairs: AVX512-BF16's pair product (vdpbf16ps: 16 fp32 lanes += two bf16 products each),
//   one packed row against a broadcast query (or probability) pair, where the CPU has
//   AVX512-BF16 without AMX.
// The softmax runs in AVX-512 fp32 either way. Key blocks start at absolute positions 0,
// kKeys, 2 kKeys..., and a query row's result depends only on its own row and those blocks,
// so a prompt gets bit-identical attention chunked or not, cold or over a cached prefix.
//
// Where the compiler targets neither (the build is -march=native), the module still loads and
// `backend` is empty.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor to and from Python; far lighter than torch/extension.h
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#define NALAR_PAIRS 1
#include "avx512_exp2.h"
#include "avx512_transpose.h"
#if defined(__AMX_BF16__)
#define NALAR_TILES 1
#include "amx_tiles.h"
#endif
#endif

#ifdef NALAR_PAIRS
namespace {

constexpr int64_t kRows = 16;   // query rows per tile
constexpr int64_t kKeys = 128;  // keys per online-softmax step
constexpr int64_t kChunk = 32;  // keys per P.V tile product (16 bf16 pairs)
constexpr int64_t kMaxDim = 256;
constexpr int64_t kTile = 16 * 32;  // bf16 values in one operand tile

// Where a span's keys (or values) lie: the first `cached` tokens in the paged cache, through
// `table`, the rest in the span's own projections.
struct Source {
  const uint16_t* cache;  // [kv_heads, slots, D]
  int64_t slots;
  const int64_t* table;
  int64_t block_size, cached;
  const uint16_t* fresh;  // [n, kv_heads, D], any row and head strides
  int64_t fresh_row_stride, fresh_head_stride, dim;

  const uint16_t* row(int64_t head, int64_t token) const {
    if (token < cached) {
      const int64_t slot = table[token / block_size] * block_size + token % block_size;
      return cache + (head * slots + slot) * dim;
    }
    return fresh + (token - cached) * fresh_row_stride + head * fresh_head_stride;
  }
};

// Keys as the B operand of Q.K^T, for 16 keys and 32 dims a tile: row p holds dims
// (2p, 2p + 1) of each key in turn. Laid out [kv_heads][key tiles][D / 32][16][16] pairs;
// keys past `total` are zero. A tile's 16 key rows, 32 dims at a time, are 16 vectors of 16
// pairs: one 16 x 16 transpose of 32-bit lanes makes its 16 packed rows. (Element by element,
// packing a 1,024-token context was two thirds of a 32-token span's attention over it.)
void pack_keys(const Source& src, int64_t heads, int64_t tiles, int64_t total, uint32_t* out) {
  const int64_t chunks = src.dim / 32;
  at::parallel_for(0, heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t head = item / tiles, tile = item % tiles;
      const uint16_t* keys[16];
      for (int64_t key = 0; key < 16; ++key) {
        const int64_t token = tile * 16 + key;
        keys[key] = token < total ? src.row(head, token) : nullptr;
      }
      uint32_t* dst = out + item * chunks * 256;
      for (int64_t c = 0; c < chunks; ++c) {
        __m512i pairs[16];
        for (int key = 0; key < 16; ++key) {
          pairs[key] = keys[key] != nullptr ? _mm512_loadu_si512(keys[key] + c * 32)
                                            : _mm512_setzero_si512();
        }
        nalar_avx512::transpose_16x16(pairs);  // pairs[p]: pair p of each of the 16 keys
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + (c * 16 + p) * 16, pairs[p]);
      }
    }
  });
}

// Values as the B operand of P.V, for 32 keys and 16 dims a tile: row p holds keys
// (2p, 2p + 1) of each dim in turn. Laid out [kv_heads][key chunks][D / 16][16][32];
// keys past `total` are zero. A packed row is two keys' 16 dims interleaved: one permute of
// the two rows' halves side by side.
void pack_values(const Source& src, int64_t heads, int64_t chunks, int64_t total,
                 uint16_t* out) {
  const int64_t dim_tiles = src.dim / 16;
  alignas(64) uint16_t order[32];  // lane 2j + b takes dim j of key b: lane j of half b
  for (int i = 0; i < 32; ++i) order[i] = static_cast<uint16_t>((i % 2) * 16 + i / 2);
  const __m512i interleave = _mm512_load_si512(order);
  at::parallel_for(0, heads * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t head = item / chunks, chunk = item % chunks;
      uint16_t* dst = out + item * dim_tiles * kTile;
      for (int64_t pair = 0; pair < kChunk / 2; ++pair) {
        const uint16_t* keys[2];
        for (int b = 0; b < 2; ++b) {
          const int64_t token = chunk * kChunk + 2 * pair + b;
          keys[b] = token < total ? src.row(head, token) : nullptr;
        }
        for (int64_t t = 0; t < dim_tiles; ++t) {
          __m256i half[2];
          for (int b = 0; b < 2; ++b) {
            half[b] = keys[b] != nullptr
                ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys[b] + t * 16))
                : _mm256_setzero_si256();
          }
          const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1);
          _mm512_storeu_si512(dst + (t * 16 + pair) * 32,
                              _mm512_permutexvar_epi16(interleave, both));
        }
      }
    }
  });
}

struct Span {
  const uint32_t* keys;    // pack_keys
  const uint16_t* values;  // pack_values
  int64_t key_tiles, value_chunks;  // per KV head
  int64_t dim, offset;     // query i is at position offset + i
  float scale;
};

// 16 query rows at work: their queries and scratch, and their running state (output
// accumulators [16][D], maximum and sum per row), which lives in the span's State between key
// ranges.
struct Rows {
  alignas(64) uint16_t q[kRows * kMaxDim];
  alignas(64) float scores[kRows * kKeys];
  alignas(64) uint16_t probs[kRows * kKeys];
  alignas(64) float product[kRows * 64];
  float correction[kRows];
  float* out;
  float* max;
  float* sum;
};

// Every query row's running state, [H][rows rounded up to 16] (x D for the accumulators).
struct State {
  std::vector<float> out, max, sum;
  int64_t padded, dim;

  State(int64_t heads, int64_t n, int64_t dim)
      : out(heads * ((n + kRows - 1) / kRows * kRows) * dim, 0.f),
        max(heads * ((n + kRows - 1) / kRows * kRows), -std::numeric_limits<float>::infinity()),
        sum(max.size(), 0.f), padded((n + kRows - 1) / kRows * kRows), dim(dim) {}

  void point(Rows& rows, int64_t head, int64_t begin) {
    const int64_t row = head * padded + begin;
    rows.out = out.data() + row * dim;
    rows.max = max.data() + row;
    rows.sum = sum.data() + row;
  }
};

// Which of the 16 keys from `t` a row that sees `visible` keys of the block sees.
inline __mmask16 seen_mask(int64_t visible, int64_t t) {
  const int64_t n = std::clamp<int64_t>(visible - t, 0, 16);
  return _cvtu32_mask16(n == 16 ? 0xFFFFu : (1u << n) - 1);
}

using nalar_avx512::exp2_nonpositive;

// One row's share of a block's online softmax: the maximum of the raw scores it sees (and of
// `running_max`), then p = 2^(s c - max c), bf16 into `p`, and their sum. `Full`: the row
// sees all kKeys keys, so no lane is masked and the loops have a fixed count.
template <bool Full>
void softmax_row(const float* s, uint16_t* p, float running_max, __m512 vc, int64_t visible,
                 int64_t width, float& block_max, float& block_sum) {
  const int64_t n = Full ? kKeys : width;
  auto seen = [&](int64_t t) { return Full ? __mmask16(0xFFFF) : seen_mask(visible, t); };
  // Two chains in flight: each max (and add) would wait on the previous one's latency.
  __m512 max0 = _mm512_set1_ps(running_max), max1 = max0;
  for (int64_t t = 0; t < n; t += 32) {
    max0 = _mm512_mask_max_ps(max0, seen(t), max0, _mm512_loadu_ps(s + t));
    if (t + 16 < n) {
      max1 = _mm512_mask_max_ps(max1, seen(t + 16), max1, _mm512_loadu_ps(s + t + 16));
    }
  }
  block_max = _mm512_reduce_max_ps(_mm512_max_ps(max0, max1));
  const __m512 offset = _mm512_set1_ps(-block_max * vc[0]);
  auto probability = [&](int64_t t) {
    const __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(s + t), vc, offset);
    const __m512 e = Full ? exp2_nonpositive(x) : _mm512_maskz_mov_ps(seen(t), exp2_nonpositive(x));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(e));
    return e;
  };
  __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
  for (int64_t t = 0; t < n; t += 32) {
    sum0 = _mm512_add_ps(sum0, probability(t));
    if (t + 16 < n) sum1 = _mm512_add_ps(sum1, probability(t + 16));
  }
  block_sum = _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

// Online softmax over one key block: row r sees the block's first `visible(r)` keys. The
// maximum is taken on the raw scores (the scale is positive), and exp(scale (s - max)) is
// computed as 2^(s c - max c) with c = scale log2(e), one fused multiply-add. Writes the
// block's probabilities (bf16, zero past what a row sees, up to `width_padded`) and each row's
// correction of what it had summed.
void softmax_block(Rows& rows, const Span& span, int64_t first_pos, int64_t first, int64_t width,
                   int64_t width_padded) {
  const __m512 vc = _mm512_set1_ps(span.scale * 1.4426950408889634f);
  alignas(64) float block_max[kRows], block_sum[kRows];
  const bool full = width == kKeys && first_pos + 1 - first >= kKeys;  // row 0 sees it all
  for (int64_t r = 0; r < kRows; ++r) {
    const float* s = rows.scores + r * kKeys;
    uint16_t* p = rows.probs + r * kKeys;
    if (full) {
      softmax_row<true>(s, p, rows.max[r], vc, kKeys, kKeys, block_max[r], block_sum[r]);
    } else {
      softmax_row<false>(s, p, rows.max[r], vc, first_pos + r + 1 - first, width, block_max[r],
                         block_sum[r]);
      std::fill(p + width, p + width_padded, 0);
    }
  }
  // The 16 rows' corrections in one vector. Before a row's first block its old maximum is
  // -inf: clamped, its correction underflows to 0 (2^-200), where -inf would give NaN.
  const __m512 new_max = _mm512_loadu_ps(block_max);
  const __m512 old_max = _mm512_loadu_ps(rows.max);
  const __m512 correction = exp2_nonpositive(_mm512_max_ps(
      _mm512_mul_ps(_mm512_sub_ps(old_max, new_max), vc), _mm512_set1_ps(-200.f)));
  _mm512_storeu_ps(rows.correction, correction);
  _mm512_storeu_ps(rows.sum, _mm512_fmadd_ps(_mm512_loadu_ps(rows.sum), correction,
                                             _mm512_loadu_ps(block_sum)));
  _mm512_storeu_ps(rows.max, new_max);
}

#ifdef NALAR_TILES
// The AMX backend: products of 16-row tiles on the tile unit.
struct Tiles {
  static void begin() { nalar_tiles::configure(); }
  static void end() { _tile_release(); }

  // S = Q.K^T for `tiles` key tiles from key `first` (rounded up to whole groups of four,
  // which the packed keys always hold), into rows.scores [16][kKeys]: four accumulators in
  // flight, as one would wait on the other's latency.
  static void score(Rows& rows, const Span& span, int64_t kv_head, int64_t first, int64_t tiles) {
    const int64_t chunks = span.dim / 32;
    const uint32_t* keys = span.keys + (kv_head * span.key_tiles + first / 16) * chunks * 256;
    for (int64_t t = 0; t < tiles; t += 4) {
      const uint32_t* k = keys + t * chunks * 256;
      const int64_t tile_stride = chunks * 256;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(4, rows.q + c * 32, span.dim * 2);
        _tile_loadd(5, k + c * 256, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, k + tile_stride + c * 256, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, k + 2 * tile_stride + c * 256, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, k + 3 * tile_stride + c * 256, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, rows.scores + t * 16, kKeys * 4);
      _tile_stored(1, rows.scores + t * 16 + 16, kKeys * 4);
      _tile_stored(2, rows.scores + t * 16 + 32, kKeys * 4);
      _tile_stored(3, rows.scores + t * 16 + 48, kKeys * 4);
    }
  }

  // out = out * correction + P.V over `chunks` key chunks from key `first`, 64 dims at a time
  // in four accumulator tiles.
  static void accumulate(Rows& rows, const Span& span, int64_t kv_head, int64_t first,
                        int64_t chunks) {
    const int64_t dim_tiles = span.dim / 16;
    const uint16_t* values =
        span.values + (kv_head * span.value_chunks + first / kChunk) * dim_tiles * kTile;
    for (int64_t g = 0; g < span.dim; g += 64) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t* v = values + (c * dim_tiles + g / 16) * kTile;
        _tile_loadd(4, rows.probs + c * kChunk, kKeys * 2);
        _tile_loadd(5, v, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, v + kTile, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, v + 2 * kTile, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, v + 3 * kTile, 64);
        _tile_dpbf16ps(3, 4, 6);
      }
      _tile_stored(0, rows.product, 64 * 4);
      _tile_stored(1, rows.product + 16, 64 * 4);
      _tile_stored(2, rows.product + 32, 64 * 4);
      _tile_stored(3, rows.product + 48, 64 * 4);
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512 corr = _mm512_set1_ps(rows.correction[r]);
        float* o = rows.out + r * span.dim + g;
        for (int64_t d = 0; d < 64; d += 16) {
          _mm512_storeu_ps(o + d, _mm512_fmadd_ps(_mm512_loadu_ps(o + d), corr,
                                                  _mm512_loadu_ps(rows.product + r * 64 + d)));
        }
      }
    }
  }
};
#endif

// The AVX512-BF16 backend: a register block of query rows by 16-lane vectors, each product a
// packed row (16 keys' or 16 dims' bf16 pairs) against a broadcast pair of the query row (or
// of its probabilities). D, the head size, is a compile-time constant so the blocks unroll.
template <int64_t D>
struct Pairs {
  static constexpr int64_t kPairs = D / 2;
  static constexpr int64_t kVectors = D / 16;  // fp32 vectors in an output row
  // Rows per P.V register block: kAccRows x kVectors accumulators, at most 16 of the 32
  // registers, the rest for the values and broadcasts.
  static constexpr int64_t kAccRows = kVectors >= 16 ? 1 : 16 / kVectors;
  static_assert(kRows % kAccRows == 0, "whole register blocks of rows");

  static void begin() {}
  static void end() {}

  static __m512bh broadcast(const uint32_t* pair) {
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(*pair));
  }

  // S = Q.K^T for `tiles` key tiles from key `first` (whole groups of four), into
  // rows.scores [16][kKeys]: four rows by four key tiles (64 keys) of accumulators, so each
  // loaded key row serves four rows and each broadcast four key tiles.
  static void score(Rows& rows, const Span& span, int64_t kv_head, int64_t first,
                    int64_t tiles) {
    const uint32_t* keys = span.keys + (kv_head * span.key_tiles + first / 16) * kPairs * 16;
    const uint32_t* q = reinterpret_cast<const uint32_t*>(rows.q);
    for (int64_t t = 0; t < tiles; t += 4) {
      const uint32_t* k = keys + t * kPairs * 16;
      for (int64_t r = 0; r < kRows; r += 4) {
        __m512 acc[4][4];
        for (auto& row : acc) {
          for (auto& a : row) a = _mm512_setzero_ps();
        }
        for (int64_t p = 0; p < kPairs; ++p) {
          __m512bh key[4];
          for (int64_t j = 0; j < 4; ++j) {
            key[j] = (__m512bh)_mm512_loadu_si512(k + (j * kPairs + p) * 16);
          }
          for (int64_t i = 0; i < 4; ++i) {
            const __m512bh query = broadcast(q + (r + i) * kPairs + p);
            for (int64_t j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], query, key[j]);
          }
        }
        for (int64_t i = 0; i < 4; ++i) {
          for (int64_t j = 0; j < 4; ++j) {
            _mm512_storeu_ps(rows.scores + (r + i) * kKeys + (t + j) * 16, acc[i][j]);
          }
        }
      }
    }
  }

  // out = out * correction + P.V over `chunks` key chunks from key `first`: the corrected
  // accumulators stay in registers over every key pair of the block.
  static void accumulate(Rows& rows, const Span& span, int64_t kv_head, int64_t first,
                         int64_t chunks) {
    const uint16_t* values =
        span.values + (kv_head * span.value_chunks + first / kChunk) * kVectors * kTile;
    const uint32_t* probs = reinterpret_cast<const uint32_t*>(rows.probs);
    for (int64_t r = 0; r < kRows; r += kAccRows) {
      __m512 acc[kAccRows][kVectors];
      for (int64_t i = 0; i < kAccRows; ++i) {
        const __m512 correction = _mm512_set1_ps(rows.correction[r + i]);
        for (int64_t g = 0; g < kVectors; ++g) {
          acc[i][g] = _mm512_mul_ps(_mm512_loadu_ps(rows.out + (r + i) * D + g * 16), correction);
        }
      }
      for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t* v = values + c * kVectors * kTile;
        for (int64_t p = 0; p < kChunk / 2; ++p) {
          __m512bh prob[kAccRows];
          for (int64_t i = 0; i < kAccRows; ++i) {
            prob[i] = broadcast(probs + ((r + i) * kKeys + c * kChunk) / 2 + p);
          }
          for (int64_t g = 0; g < kVectors; ++g) {
            const __m512bh value = (__m512bh)_mm512_loadu_si512(v + g * kTile + p * 32);
            for (int64_t i = 0; i < kAccRows; ++i) {
              acc[i][g] = _mm512_dpbf16_ps(acc[i][g], prob[i], value);
            }
          }
        }
      }
      for (int64_t i = 0; i < kAccRows; ++i) {
        for (int64_t g = 0; g < kVectors; ++g) {
          _mm512_storeu_ps(rows.out + (r + i) * D + g * 16, acc[i][g]);
        }
      }
    }
  }
};

// Query rows [begin, begin + count) of one head over keys [from, to) (whole key blocks from
// `from`), where the rows' state already holds what they saw before `from`.
template <typename Kernel>
void attend_range(Rows& rows, const Span& span, const uint16_t* query, int64_t row_stride,
                  int64_t kv_head, int64_t begin, int64_t count, int64_t from, int64_t to) {
  const int64_t dim = span.dim;
  std::fill(rows.q, rows.q + kRows * dim, 0);
  for (int64_t r = 0; r < count; ++r) {
    std::memcpy(rows.q + r * dim, query + (begin + r) * row_stride, dim * 2);
  }
  const int64_t first_pos = span.offset + begin;
  for (int64_t first = from; first < to; first += kKeys) {
    const int64_t tiles = (std::min(kKeys, to - first) + 15) / 16;
    const int64_t chunks = (tiles * 16 + kChunk - 1) / kChunk;
    Kernel::score(rows, span, kv_head, first, tiles);
    softmax_block(rows, span, first_pos, first, tiles * 16, chunks * kChunk);
    Kernel::accumulate(rows, span, kv_head, first, chunks);
  }
}

// out[i] = accumulator / sum, as bf16, for `count` rows.
void write_rows(const Rows& rows, int64_t count, int64_t dim, uint16_t* out, int64_t stride) {
  for (int64_t r = 0; r < count; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / rows.sum[r]);
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(rows.out + r * dim + d), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * stride + d),
                          (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}

// Row blocks in an order whose halves (and quarters...) hold equal causal work: the cheap
// first blocks alternate with the costly last ones, as parallel_for splits its range evenly.
int64_t balanced_block(int64_t j, int64_t blocks) {
  return j % 2 == 0 ? j / 2 : blocks - 1 - j / 2;
}

// The span's queries [n, H, D] (row and head strides) and its output [n, H, D], contiguous.
struct Queries {
  const uint16_t* query;
  int64_t row_stride, head_stride, n, heads, group;  // group: query heads per KV head
  uint16_t* out;
};

template <typename Kernel>
void attend_span(const Span& span, const Queries& q, int64_t total) {
  const int64_t dim = span.dim, n = q.n, num_cached = span.offset;
  const int64_t blocks = (n + kRows - 1) / kRows;
  // Keys in ranges of about 512 KiB packed per KV head, each taken by every row block that
  // sees it before the next: the range stays in a core's L2 (at 8k tokens a head's packed
  // keys and values are 2 MiB, and re-reading them from L3 for every row block measured
  // slower than torch's flash kernel).
  const int64_t range = std::max<int64_t>(kKeys, (int64_t{1} << 19) / (dim * 4) / kKeys * kKeys);
  State state(q.heads, n, dim);
  for (int64_t from = 0; from < total; from += range) {
    // Row blocks seeing keys at or past `from`; in head-major order, so a thread's
    // consecutive items share a KV head.
    const int64_t first_block = std::max<int64_t>(0, from - num_cached) / kRows;
    const int64_t active = blocks - first_block;
    at::parallel_for(0, q.heads * active, 1, [&](int64_t begin, int64_t end) {
      Kernel::begin();
      auto rows = std::make_unique<Rows>();
      for (int64_t item = begin; item < end; ++item) {
        const int64_t head = item / active;
        const int64_t block = first_block + balanced_block(item % active, active);
        const int64_t first = block * kRows, count = std::min(kRows, n - first);
        const int64_t seen = num_cached + first + count;  // keys the last row sees
        state.point(*rows, head, first);
        attend_range<Kernel>(*rows, span, q.query + head * q.head_stride, q.row_stride,
                             head / q.group, first, count, from, std::min(seen, from + range));
        if (seen <= from + range) {
          write_rows(*rows, count, dim, q.out + (first * q.heads + head) * dim, q.heads * dim);
        }
      }
      Kernel::end();
    });
  }
}

}  // namespace
#endif

// What computes the products: "amx-tiles", "avx512-bf16", or "" where neither can run.
std::string backend() {
#ifdef NALAR_TILES
  if (nalar_tiles::granted()) return "amx-tiles";
#endif
#ifdef NALAR_PAIRS
  return "avx512-bf16";
#else
  return "";
#endif
}

// query [n, H, D], key and value [n, KV, D] (the span's own tokens; unit stride in a head);
// key_cache, value_cache [KV, slots, D] contiguous; cached_blocks [M] int64 covering the
// sequence's first num_cached tokens; all bf16. Query i is at position num_cached + i and sees
// keys 0..num_cached + i. Returns [n, H, D] bf16.
at::Tensor prefill_attention(at::Tensor query, at::Tensor key, at::Tensor value,
                             at::Tensor key_cache, at::Tensor value_cache,
                             at::Tensor cached_blocks, int64_t num_cached, int64_t block_size,
                             double scale) {
  const std::string kind = backend();
  TORCH_CHECK(!kind.empty(), "neither AMX-BF16 nor AVX512-BF16 on this CPU or build");
  for (const auto* t : {&query, &key, &value, &key_cache, &value_cache, &cached_blocks}) {
    TORCH_CHECK(t->device().is_cpu(), "CPU tensors");
  }
  for (const auto* t : {&query, &key, &value, &key_cache, &value_cache}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "bfloat16 query, keys, values and cache");
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1, "3-d tensors, unit stride within a head");
  }
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous()
              && value_cache.sizes() == key_cache.sizes(), "contiguous caches of one shape");
  const int64_t n = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key.size(1);
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == n && key.size(2) == dim,
              "key and value [n, kv_heads, D] beside query [n, H, D]");
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, "query heads a multiple of KV heads");
  TORCH_CHECK(key_cache.size(0) == kv_heads && key_cache.size(2) == dim, "cache geometry");
#ifdef NALAR_PAIRS
  // head_dims (the module's attribute) lists exactly these.
  TORCH_CHECK(dim % 64 == 0 && dim <= kMaxDim, "head_dim a multiple of 64, at most ", kMaxDim);
  TORCH_CHECK(cached_blocks.scalar_type() == at::kLong, "int64 block table");
  const auto table = cached_blocks.contiguous();
  TORCH_CHECK(num_cached >= 0 && num_cached <= table.numel() * block_size && block_size >= 1,
              "num_cached outside the block table");
  const int64_t slots = key_cache.size(1);
  const int64_t* ids = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < table.numel(); ++i) {
    TORCH_CHECK(ids[i] >= 0 && (ids[i] + 1) * block_size <= slots, "block id outside the cache");
  }
  const int64_t total = num_cached + n;
  const int64_t key_tiles = (total + kKeys - 1) / kKeys * kKeys / 16;
  const int64_t value_chunks = key_tiles * 16 / kChunk;
  auto raw = [](const at::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
  };
  const Source keys{raw(key_cache), slots, ids, block_size, num_cached, raw(key),
                    key.stride(0), key.stride(1), dim};
  const Source values{raw(value_cache), slots, ids, block_size, num_cached, raw(value),
                      value.stride(0), value.stride(1), dim};
  // Left uninitialised: the packing writes every element (zeros past the span's keys).
  const std::unique_ptr<uint32_t[]> packed_keys(new uint32_t[kv_heads * key_tiles * dim * 8]);
  const std::unique_ptr<uint16_t[]> packed_values(
      new uint16_t[kv_heads * value_chunks * dim * kChunk]);
  pack_keys(keys, kv_heads, key_tiles, total, packed_keys.get());
  pack_values(values, kv_heads, value_chunks, total, packed_values.get());
  const Span span{packed_keys.get(), packed_values.get(), key_tiles, value_chunks, dim,
                  num_cached, static_cast<float>(scale)};
  auto out = at::empty({n, heads, dim}, query.options());
  const Queries queries{raw(query), query.stride(0), query.stride(1), n, heads,
                        heads / kv_heads,
                        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>())};
#ifdef NALAR_TILES
  if (kind == "amx-tiles") {
    attend_span<Tiles>(span, queries, total);
    return out;
  }
#endif
  switch (dim) {
    case 64: attend_span<Pairs<64>>(span, queries, total); break;
    case 128: attend_span<Pairs<128>>(span, queries, total); break;
    case 192: attend_span<Pairs<192>>(span, queries, total); break;
    default: attend_span<Pairs<256>>(span, queries, total); break;
  }
  return out;
#else
  return at::Tensor();
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("backend") = backend();
  m.attr("head_dims") = std::vector<int64_t>{64, 128, 192, 256};
  m.def("prefill_attention", &prefill_attention,
        "causal bf16 flash attention of a prefill span over its paged context",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
