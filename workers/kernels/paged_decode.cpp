// Decode attention read straight from the paged KV cache (fp32 or bf16 cache, fp32 arithmetic;
// CPU).
//
// A sequence's query rows attend to its cached tokens, block by block through its block table,
// with the online softmax of flash attention (Dao et al. 2022): a running maximum and sum per
// query row, so no score vector over the whole context and no gathered copy of K/V is ever
// made. The rows of one KV head are the query heads that share it (GQA) and, for a
// verification block (a decode token and its drafts), those of each of its tokens: every row
// sees its own number of tokens, and all of them share each block's reads. Every (sequence,
// KV head) pair is independent, and a row's arithmetic is that of the row alone, so its result
// never depends on what else is in the batch or the block.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor to and from Python; far lighter than torch/extension.h
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AMX_BF16__) && defined(CPU_CAPABILITY_AVX512)
#define NALAR_TILES 1
#include "amx_tiles.h"
#endif
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#define NALAR_PAIRS 1
#endif
#if defined(NALAR_TILES) || defined(NALAR_PAIRS)
#include "avx512_exp2.h"
#endif
#ifdef NALAR_PAIRS
#include "avx512_transpose.h"
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kMaxBlockSize = 256;
constexpr int64_t kMaxRows = 16;  // query rows a KV head of a sequence attends for at once

inline float widen(float x) { return x; }

// bf16 is the top half of an fp32: widening is exact, a shift the compiler vectorises.
inline float widen(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// A block's keys as fp32: the cache itself in fp32, a widened copy (in `scratch`, at most
// kMaxBlockSize x D floats) in bf16, made once for all the rows of a KV head.
inline const float* as_float(const float* block, int64_t, float*) { return block; }

inline const float* as_float(const at::BFloat16* block, int64_t count, float* scratch) {
  for (int64_t i = 0; i < count; ++i) scratch[i] = widen(block[i]);
  return scratch;
}

// Asks for a block's keys and values to come into L2 (prefetcht1): blocks lie scattered over
// the pool, so the hardware prefetcher would only start on each at its first miss. Into L2,
// not L1: a block is 64 lines, more than L1 tracks misses for, and a burst of L1 prefetches
// (prefetcht0) gained little. The fence emits no code; without it GCC 12's dead-code
// elimination drops every prefetch of this loop once it is inlined (found in stop 17: the
// built kernel held no prefetch at all; GCC's prefetch-loop collapse is also reported in
// intel/ScalableVectorSearch#361).
template <typename T>
inline void prefetch_block(const T* keys, const T* values, int64_t count) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t i = 0; i < count; i += kLine) {
    __builtin_prefetch(keys + i, 0, 2);
    __builtin_prefetch(values + i, 0, 2);
    std::atomic_signal_fence(std::memory_order_seq_cst);
  }
}

// q . k over D floats: vector partial sums, then one shuffle-tree reduction (a fixed order).
template <int64_t D>
inline float dot(const float* q, const float* k) {
  static_assert(D % Vec::size() == 0, "head_dim must be a multiple of the vector width");
  Vec sum(0.f);
  for (int64_t d = 0; d < D; d += Vec::size()) {
    sum = at::vec::fmadd(Vec::loadu(q + d), Vec::loadu(k + d), sum);
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
}

// p[t] = exp(s[t] - max) for t < n, in place, returning their sum: the exponential torch's
// own CPU flash attention uses (exp_u20), a vector at a time.
inline float exp_shifted(float* s, float max, int64_t n) {
  float sum = 0.f;
  for (int64_t t = 0; t < n; t += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - t);
    (Vec::loadu(s + t, count) - Vec(max)).exp_u20().store(s + t, count);
    for (int64_t j = 0; j < count; ++j) sum += s[t + j];
  }
  return sum;
}

// Vec::size() cached values as fp32: bf16 widened in registers (exact), fp32 as they are.
inline Vec load_widened(const float* p) { return Vec::loadu(p); }

inline Vec load_widened(const at::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(bits, 16)));
#else
  float wide[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) wide[i] = widen(p[i]);
  return Vec::loadu(wide);
#endif
}

// Accumulators a group of rows may hold in vector registers beside one token's values (of 32
// registers with AVX-512, 16 with AVX2).
constexpr int64_t kAccumulators = Vec::size() >= 16 ? 12 : 6;

// acc[g] [D] = acc[g] * correction[g] + probs[g] [n] . v [n, D] for G rows sharing one block's
// values, in fp32; row g's probability of token t is probs[g * row_stride + t * token_stride]. Tokens outer: each token's values are loaded (and widened) once for the G
// rows, and the rows' G x D / W accumulators are independent FMA chains, where a row at a time
// re-read the block per row and waited on D / W chains' latency. Each row sums in token order,
// as a row on its own would.
template <typename T, int64_t D, int64_t G>
inline void accumulate_group(const float* probs, int64_t row_stride, int64_t token_stride,
                             const float* correction, int64_t n, const T* v, float* acc) {
  constexpr int64_t kVectors = D / Vec::size();
  Vec sums[G][kVectors];
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = 0; j < kVectors; ++j) {
      sums[g][j] = Vec::loadu(acc + g * D + j * Vec::size()) * Vec(correction[g]);
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    Vec values[kVectors];
    for (int64_t j = 0; j < kVectors; ++j) values[j] = load_widened(v + t * D + j * Vec::size());
    for (int64_t g = 0; g < G; ++g) {
      const Vec p(probs[g * row_stride + t * token_stride]);
      for (int64_t j = 0; j < kVectors; ++j) sums[g][j] = at::vec::fmadd(p, values[j], sums[g][j]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = 0; j < kVectors; ++j) sums[g][j].store(acc + g * D + j * Vec::size());
  }
}

// accumulate_group over all `rows` rows of a KV head: as many whole groups as fit the
// registers, then the rest one row at a time (the probabilities laid out as accumulate_group's).
template <typename T, int64_t D>
inline void accumulate_rows(const float* probs, int64_t row_stride, int64_t token_stride,
                            const float* correction, int64_t rows, int64_t n, const T* v,
                            float* acc) {
  static_assert(D % Vec::size() == 0, "head_dim must be a multiple of the vector width");
  constexpr int64_t kGroup = std::clamp<int64_t>(kAccumulators / (D / Vec::size()), 1, 4);
  int64_t r = 0;
  for (; r + kGroup <= rows; r += kGroup) {
    accumulate_group<T, D, kGroup>(probs + r * row_stride, row_stride, token_stride,
                                   correction + r, n, v, acc + r * D);
  }
  for (; r < rows; ++r) {
    accumulate_group<T, D, 1>(probs + r * row_stride, row_stride, token_stride, correction + r,
                              n, v, acc + r * D);
  }
}

// Folds one block's scaled scores `probs` [n] of a query row into its running maximum and sum
// (flash attention's online softmax), turning them into exp(score - maximum) in place.
// Returns the correction of what was accumulated under the old maximum: exactly 1 where the
// row sees none of the block (n = 0, never its first block).
inline float softmax_block(float* probs, int64_t n, float& running_max, float& running_sum) {
  float block_max = running_max;
  for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, probs[t]);
  const float correction = std::exp(running_max - block_max);
  running_sum = running_sum * correction + exp_shifted(probs, block_max, n);
  running_max = block_max;
  return correction;
}

// out[r] = acc[r] / sum[r] for the `rows` rows.
template <int64_t D>
inline void normalise(const float* acc, const float* running_sum, int64_t rows, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const Vec inv(1.f / running_sum[r]);
    for (int64_t d = 0; d < D; d += Vec::size()) {
      (Vec::loadu(acc + r * D + d) * inv).store(out + r * D + d);
    }
  }
}

// How many of the n tokens of the block at `start` a row that sees `row_length` tokens attends
// to. The block's other tokens get probability 0 for that row: they are this step's own later
// tokens (a verification block's), written before attention, so 0 times their values is 0.
inline int64_t seen_in_block(int64_t row_length, int64_t start, int64_t n) {
  return std::clamp<int64_t>(row_length - start, 0, n);
}

// The next kPrefetchBlocks blocks' keys and values, asked for while this one is computed.
// Two blocks ahead, each asked for twice (once as the second block ahead, then as the next);
// asking for both beat either alone, perhaps because a request the memory system drops gets a
// second chance. One thread, 16 sequences x 512 tokens of bf16 KV over 30 layers, blocks
// scattered (kernel_choices.py's decode_attention_from_dram), on a Zen 4 EPYC: 31 ms with the
// next block into L1, 21-23 with the next or the second alone into L2, 16.5 with both; with
// blocks in order 15.7, 17-22 and 14.7 (the KV read alone: 6.3 ms). On an AVX2-only Zen 3
// EPYC, fp32 KV, where the kernel is bound by its arithmetic, the same change cost 3% on one
// thread (45.5 against 47.0 ms, scattered) and nothing measurable on two (docs/performance.md).
constexpr int64_t kPrefetchBlocks = 2;

template <typename T, int64_t D>
inline void prefetch_ahead(const T* keys, const T* values, const int64_t* table, int64_t start,
                           int64_t length, int64_t block_size) {
  for (int64_t ahead = 1; ahead <= kPrefetchBlocks; ++ahead) {
    const int64_t from = start + ahead * block_size;
    if (from >= length) return;
    const int64_t slot = table[from / block_size] * block_size * D;
    prefetch_block(keys + slot, values + slot, std::min(block_size, length - from) * D);
  }
}


// The `rows` query rows of one KV head of one sequence, row r over the first lengths[r] tokens
// of its context, block after block (flash attention's online softmax: a running maximum and
// sum per row). D is a compile-time head size, so every loop over a head is unrolled into
// whole vectors.
template <typename T, int64_t D>
void attend_rows(const float* q, const at::BFloat16*, const T* keys, const T* values,
                 const int64_t* table, const int64_t* lengths, int64_t rows, int64_t block_size,
                 float scale, float* out) {
  const int64_t length = *std::max_element(lengths, lengths + rows);
  float acc[kMaxRows * D] = {};
  float running_max[kMaxRows], running_sum[kMaxRows] = {}, correction[kMaxRows];
  std::fill(running_max, running_max + rows, -std::numeric_limits<float>::infinity());
  std::vector<float> k_scratch(block_size * D), probs(rows * block_size);
  for (int64_t start = 0; start < length; start += block_size) {
    const int64_t n = std::min(block_size, length - start);
    const int64_t slot = table[start / block_size] * block_size;
    prefetch_ahead<T, D>(keys, values, table, start, length, block_size);
    const float* k = as_float(keys + slot * D, n * D, k_scratch.data());
    for (int64_t r = 0; r < rows; ++r) {
      float* row_probs = probs.data() + r * block_size;
      const int64_t seen = seen_in_block(lengths[r], start, n);
      for (int64_t t = 0; t < seen; ++t) row_probs[t] = dot<D>(q + r * D, k + t * D) * scale;
      correction[r] = softmax_block(row_probs, seen, running_max[r], running_sum[r]);
      std::fill(row_probs + seen, row_probs + n, 0.f);
    }
    accumulate_rows<T, D>(probs.data(), block_size, 1, correction, rows, n, values + slot * D,
                          acc);
  }
  normalise<D>(acc, running_sum, rows, out);
}

#ifdef NALAR_TILES
// The online softmax of up to 16 query rows at once, a row per lane, for the tile path, whose
// block scores come as [token][row]: a block's maxima, probabilities and sums are vector
// arithmetic over all the rows, where a row at a time cost a scalar loop per row and block
// (most of a verification block's time at 15 rows). Per lane it is the pair path's
// softmax_scores: maxima on raw scores, exp(scale (s - max)) as 2^(s c - max c).
class LaneSoftmax {
 public:
  LaneSoftmax(const int64_t* lengths, int64_t rows, float scale)
      : c_(_mm512_set1_ps(scale * 1.4426950408889634f)) {
    alignas(64) int32_t seen[16] = {};  // lanes past the rows see no token
    for (int64_t r = 0; r < rows; ++r) seen[r] = static_cast<int32_t>(lengths[r]);
    lengths_ = _mm512_load_si512(seen);
  }

  // Folds a block's raw scores [16 tokens][16 rows] (its first n tokens, the first at position
  // `start`) into each row's running maximum and sum: probs [16][16] gets the rows'
  // probabilities (0 for a token a row does not see), correction [16] the factor for what
  // each row accumulated before.
  void fold(const float* scores, int64_t start, int64_t n, float* probs, float* correction) {
    __mmask16 sees[16];
    __m512 block_max = max_;
    for (int64_t t = 0; t < n; ++t) {
      sees[t] = _mm512_cmpgt_epi32_mask(lengths_, _mm512_set1_epi32(static_cast<int32_t>(start + t)));
      block_max = _mm512_mask_max_ps(block_max, sees[t], block_max, _mm512_load_ps(scores + 16 * t));
    }
    const __m512 shift = _mm512_mul_ps(block_max, c_);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __m512 p = _mm512_maskz_mov_ps(sees[t], nalar_avx512::exp2_nonpositive(
          _mm512_fmsub_ps(_mm512_load_ps(scores + 16 * t), c_, shift)));
      _mm512_store_ps(probs + 16 * t, p);
      sum = _mm512_add_ps(sum, p);
    }
    // 2^0 is exactly 1, so a row that sees none of the block keeps its sums as they were
    // (bit for bit: a verification row as a plain decode); before a row's first token its
    // maximum is -inf and the correction 0.
    const __mmask16 started = _mm512_cmp_ps_mask(
        max_, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
    const __m512 factor = _mm512_maskz_mov_ps(started, nalar_avx512::exp2_nonpositive(
        _mm512_mul_ps(_mm512_sub_ps(max_, block_max), c_)));
    sum_ = _mm512_fmadd_ps(sum_, factor, sum);
    max_ = block_max;
    _mm512_storeu_ps(correction, factor);
  }

  void sums(float* out) const { _mm512_storeu_ps(out, sum_); }

 private:
  __m512 c_;
  __m512i lengths_;
  __m512 max_ = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 sum_ = _mm512_setzero_ps();
};

// attend_rows for bf16 caches in blocks of 16 tokens, on AMX tiles: a block's scores for all
// the rows are one tile product, keys (the A operand: 16 tokens x 32 dims, read in place) by
// the rows' queries transposed into the B operand's pairs, instead of one dot product and
// horizontal sum per token and row, and the keys are never widened.
template <int64_t D>
void attend_rows_tiles(const float*, const at::BFloat16* q, const at::BFloat16* keys,
                       const at::BFloat16* values, const int64_t* table, const int64_t* lengths,
                       int64_t rows, int64_t block_size, float scale, float* out) {
  static_assert(D % 32 == 0, "tiles take the head in 32-dim chunks");
  const int64_t length = *std::max_element(lengths, lengths + rows);
  constexpr int64_t kChunks = D / 32;
  // B operand per chunk: row p holds dims (2p, 2p + 1) of each query row in turn.
  alignas(64) uint16_t q_pairs[kChunks * 16 * 32] = {};
  const auto* q_bits = reinterpret_cast<const uint16_t*>(q);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < D; ++d) {
      q_pairs[((d / 32) * 16 + (d % 32) / 2) * 32 + r * 2 + d % 2] = q_bits[r * D + d];
    }
  }
  float acc[kMaxRows * D] = {};
  alignas(64) float scores[16 * 16], probs[16 * 16];  // [token][row]
  float correction[16], running_sum[16];
  LaneSoftmax softmax(lengths, rows, scale);
  for (int64_t start = 0; start < length; start += block_size) {
    const int64_t n = std::min(block_size, length - start);
    const int64_t slot = table[start / block_size] * block_size;
    prefetch_ahead<at::BFloat16, D>(keys, values, table, start, length, block_size);
    // A block's unused tail rows may hold anything; their scores are never read.
    _tile_zero(0);
    for (int64_t c = 0; c < kChunks; ++c) {
      _tile_loadd(1, keys + slot * D + c * 32, D * 2);
      _tile_loadd(2, q_pairs + c * 16 * 32, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, scores, 64);
    softmax.fold(scores, start, n, probs, correction);
    accumulate_rows<at::BFloat16, D>(probs, 1, 16, correction, rows, n, values + slot * D, acc);
  }
  softmax.sums(running_sum);
  normalise<D>(acc, running_sum, rows, out);
}
#endif

#ifdef NALAR_PAIRS
// Raw scores of a block of 16 tokens for `rows` query rows, lane t of scores[r] = q_r . k_t
// (fp32 sums of exact bf16 products). The keys [16, D], read in place, are transposed once per
// 32 dims into one vector per dim pair (16 tokens' pairs), shared by every row: a row then
// takes one pair product per dim pair against a broadcast of its own pair, with no horizontal
// sum. Rows go four at a time (the queries are zero-padded to whole fours), two accumulators
// each, so eight independent chains hide the product's latency; the accumulators wait in
// `even`/`odd` between the 32-dim chunks. Rows of the block past the sequence's length are
// loaded too; the caller masks their lanes.
template <int64_t D>
inline void score_block_pairs(const at::BFloat16* keys, const uint32_t* q_pairs, int64_t rows,
                              __m512* scores) {
  constexpr int64_t kPairs = D / 2;
  const int64_t padded = (rows + 3) / 4 * 4;
  __m512 even[kMaxRows], odd[kMaxRows];
  for (int64_t r = 0; r < padded; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D / 32; ++c) {
    __m512i k[16];
    for (int t = 0; t < 16; ++t) k[t] = _mm512_loadu_si512(keys + t * D + c * 32);
    nalar_avx512::transpose_16x16(k);  // k[p]: dims c * 32 + 2p, 2p + 1 of the 16 tokens
    for (int64_t r = 0; r < padded; r += 4) {
      __m512 e[4], o[4];
      for (int i = 0; i < 4; ++i) {
        e[i] = even[r + i];
        o[i] = odd[r + i];
      }
      for (int p = 0; p < 16; p += 2) {
        for (int i = 0; i < 4; ++i) {
          const uint32_t* q = q_pairs + (r + i) * kPairs + c * 16 + p;
          e[i] = _mm512_dpbf16_ps(e[i], (__m512bh)_mm512_set1_epi32(q[0]), (__m512bh)k[p]);
          o[i] = _mm512_dpbf16_ps(o[i], (__m512bh)_mm512_set1_epi32(q[1]), (__m512bh)k[p + 1]);
        }
      }
      for (int i = 0; i < 4; ++i) {
        even[r + i] = e[i];
        odd[r + i] = o[i];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) scores[r] = _mm512_add_ps(even[r], odd[r]);
}

// Folds a block's raw scores `s` (lanes = its first n tokens) into a row's online softmax:
// the maximum on raw scores (the scale is positive), exp(scale (s - max)) as 2^(s c - max c)
// with c = scale log2(e), stored to `probs` [16] (0 in the lanes from n). Returns the
// correction of what was accumulated under the old maximum (1 where n = 0).
inline float softmax_scores(__m512 s, int64_t n, float c, float& running_max,
                            float& running_sum, float* probs) {
  const __mmask16 valid = _cvtu32_mask16(n >= 16 ? 0xFFFFu : (1u << n) - 1);
  const float block_max = std::max(running_max, _mm512_mask_reduce_max_ps(valid, s));
  const __m512 p = _mm512_maskz_mov_ps(valid, nalar_avx512::exp2_nonpositive(
      _mm512_fmadd_ps(s, _mm512_set1_ps(c), _mm512_set1_ps(-block_max * c))));
  // Before the first block the maximum is -inf and the correction 2^-inf = 0.
  const float correction = std::exp2((running_max - block_max) * c);
  running_sum = running_sum * correction + _mm512_reduce_add_ps(p);
  running_max = block_max;
  _mm512_store_ps(probs, p);
  return correction;
}

// attend_rows for bf16 caches in blocks of 16 tokens with AVX512-BF16's pair products for the
// scores (score_block_pairs) and a vector softmax over the block's 16 lanes.
template <int64_t D>
void attend_rows_pairs(const float*, const at::BFloat16* q, const at::BFloat16* keys,
                       const at::BFloat16* values, const int64_t* table, const int64_t* lengths,
                       int64_t rows, int64_t block_size, float scale, float* out) {
  static_assert(D % 32 == 0, "the head is taken in 32-dim chunks");
  const int64_t length = *std::max_element(lengths, lengths + rows);
  alignas(64) uint32_t q_pairs[kMaxRows * D / 2] = {};
  std::memcpy(q_pairs, q, rows * D * sizeof(at::BFloat16));
  float acc[kMaxRows * D] = {};
  float running_max[kMaxRows], running_sum[kMaxRows] = {}, correction[kMaxRows];
  std::fill(running_max, running_max + rows, -std::numeric_limits<float>::infinity());
  const float c = scale * 1.4426950408889634f;
  __m512 scores[kMaxRows];
  alignas(64) float probs[kMaxRows * 16];
  for (int64_t start = 0; start < length; start += block_size) {
    const int64_t n = std::min(block_size, length - start);
    const int64_t slot = table[start / block_size] * block_size;
    prefetch_ahead<at::BFloat16, D>(keys, values, table, start, length, block_size);
    score_block_pairs<D>(keys + slot * D, q_pairs, rows, scores);
    for (int64_t r = 0; r < rows; ++r) {
      correction[r] = softmax_scores(scores[r], seen_in_block(lengths[r], start, n), c,
                                     running_max[r], running_sum[r], probs + r * 16);
    }
    accumulate_rows<at::BFloat16, D>(probs, 16, 1, correction, rows, n, values + slot * D, acc);
  }
  normalise<D>(acc, running_sum, rows, out);
}
#endif

// Query rows (fp32, and bf16 for the tile path), keys, values, table, each row's length,
// rows, block_size, scale, out.
template <typename T>
using RowsFn = void (*)(const float*, const at::BFloat16*, const T*, const T*, const int64_t*,
                        const int64_t*, int64_t, int64_t, float, float*);

#define NALAR_HEAD_DIMS(X) X(32) X(64) X(80) X(96) X(128) X(256)

template <typename T>
RowsFn<T> rows_for(int64_t dim) {
#define NALAR_CASE(D) \
  if (dim == D) return &attend_rows<T, D>;
  NALAR_HEAD_DIMS(NALAR_CASE)
#undef NALAR_CASE
  return nullptr;
}

// A bf16 path whose scores take products of bf16 pairs (`Path<D>::attend`: tiles or pairs)
// for `dim`, where it is a whole number of 32-dim chunks; nullptr otherwise.
template <template <int64_t> typename Path>
RowsFn<at::BFloat16> score_rows_for(int64_t dim) {
#define NALAR_CASE(D) \
  if constexpr (D % 32 == 0) {               \
    if (dim == D) return Path<D>::attend;    \
  }
  NALAR_HEAD_DIMS(NALAR_CASE)
#undef NALAR_CASE
  return nullptr;
}

#ifdef NALAR_TILES
template <int64_t D>
struct TileRows {
  static constexpr auto attend = &attend_rows_tiles<D>;
};
#endif
#ifdef NALAR_PAIRS
template <int64_t D>
struct PairRows {
  static constexpr auto attend = &attend_rows_pairs<D>;
};
#endif

}  // namespace

// What bf16 decodes over blocks of `block_size` tokens with `head_dim`-wide heads score with:
// "tiles" (AMX-BF16 tile products, where the CPU has them and Linux grants them), "pairs"
// (AVX512-BF16 pair products), or "" (dot products of widened keys); the first two need blocks
// of 16 and heads of 32-dim chunks.
std::string score_products(int64_t block_size, int64_t head_dim) {
  if (block_size != 16) return "";
#ifdef NALAR_TILES
  if (nalar_tiles::granted() && score_rows_for<TileRows>(head_dim) != nullptr) return "tiles";
#endif
#ifdef NALAR_PAIRS
  if (score_rows_for<PairRows>(head_dim) != nullptr) return "pairs";
#endif
  (void)head_dim;
  return "";
}

// row_lengths [B, R]: the tokens each query row of each sequence sees.
template <typename T>
void attend_all(const at::Tensor& q, const at::BFloat16* q_bf16,
                const at::Tensor& key_cache, const at::Tensor& value_cache,
                const at::Tensor& tables, const std::vector<int64_t>& row_lengths,
                int64_t block_size, float scale, at::Tensor& out) {
  const int64_t batch = q.size(0), kv_heads = q.size(1), rows = q.size(2), dim = q.size(3);
  const int64_t slots = key_cache.size(1), max_blocks = tables.size(1);
  const float* q_ptr = q.data_ptr<float>();
  const T* k_ptr = key_cache.data_ptr<T>();
  const T* v_ptr = value_cache.data_ptr<T>();
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  RowsFn<T> attend = rows_for<T>(dim);
  bool tiles = false;
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const std::string products = score_products(block_size, dim);
#ifdef NALAR_TILES
    if (products == "tiles") {
      attend = score_rows_for<TileRows>(dim);
      tiles = true;
    }
#endif
#ifdef NALAR_PAIRS
    if (products == "pairs") attend = score_rows_for<PairRows>(dim);
#endif
  }
  TORCH_CHECK(attend != nullptr, "head_dim ", dim, " is not one of the kernel's head sizes");
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
#ifdef NALAR_TILES
    if (tiles) nalar_tiles::configure();
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      attend(q_ptr + item * rows * dim, q_bf16 ? q_bf16 + item * rows * dim : nullptr,
             k_ptr + h * slots * dim, v_ptr + h * slots * dim, table_ptr + b * max_blocks,
             row_lengths.data() + b * rows, rows, block_size, scale,
             out_ptr + item * rows * dim);
    }
#ifdef NALAR_TILES
    if (tiles) _tile_release();
#endif
  });
}

// query [B, kv_heads, R, D]; key_cache, value_cache [kv_heads, slots, D], float32 or bfloat16
// (the query's dtype); block_tables [B, M] int64; lengths int64 (each >= 1): [B], the tokens
// every row of a sequence sees, or [B, Q] with R a multiple of Q, where row r sees
// lengths[b, r / (R / Q)] (a verification block's Q tokens, each with its R / Q query heads).
// Returns [B, kv_heads, R, D] in the query's dtype, computed in float32.
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache,
                                     at::Tensor value_cache, at::Tensor block_tables,
                                     at::Tensor lengths, int64_t block_size, double scale) {
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu()
              && value_cache.device().is_cpu() && block_tables.device().is_cpu()
              && lengths.device().is_cpu(), "CPU tensors");
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16)
              && key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "float32 or bfloat16 query and cache, all of one dtype");
  TORCH_CHECK(query.dim() == 4 && key_cache.dim() == 3 && value_cache.dim() == 3,
              "query [B, kv_heads, R, D], caches [kv_heads, slots, D]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
  TORCH_CHECK(block_size >= 1 && block_size <= kMaxBlockSize, "block_size outside 1..",
              kMaxBlockSize);
  TORCH_CHECK(query.size(2) <= kMaxRows, "more than ", kMaxRows, " query rows per KV head");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "int64 block tables and lengths");
  const auto q = query.to(at::kFloat).contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = lengths.contiguous();
  const int64_t batch = q.size(0), kv_heads = q.size(1), dim = q.size(3);
  TORCH_CHECK(key_cache.size(0) == kv_heads && key_cache.size(2) == dim
              && value_cache.sizes() == key_cache.sizes(), "cache geometry");
  TORCH_CHECK(tables.size(0) == batch && lens.size(0) == batch, "one table per sequence");
  const int64_t rows = q.size(2), per_sequence = lens.dim() == 2 ? lens.size(1) : 1;
  TORCH_CHECK(lens.dim() <= 2 && per_sequence >= 1 && rows % per_sequence == 0,
              "lengths [B] or [B, Q], the rows a multiple of Q");
  const int64_t slots = key_cache.size(1), max_blocks = tables.size(1);
  const int64_t* length_ptr = lens.data_ptr<int64_t>();
  std::vector<int64_t> row_lengths(batch * rows);
  for (int64_t i = 0; i < batch * rows; ++i) {
    const int64_t length = length_ptr[i / rows * per_sequence + i % rows / (rows / per_sequence)];
    TORCH_CHECK(length >= 1 && length <= max_blocks * block_size,
                "length outside the block table");
    row_lengths[i] = length;
  }
  const int64_t* ids = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i) {
    TORCH_CHECK(ids[i] >= 0 && (ids[i] + 1) * block_size <= slots, "block id outside the cache");
  }
  auto out = at::empty_like(q);
  const auto scale_f = static_cast<float>(scale);
  if (dtype == at::kFloat) {
    attend_all<float>(q, nullptr, key_cache, value_cache, tables, row_lengths, block_size,
                      scale_f, out);
  } else {
    const auto q_bf16 = query.contiguous();
    attend_all<at::BFloat16>(q, q_bf16.data_ptr<at::BFloat16>(), key_cache, value_cache, tables,
                             row_lengths, block_size, scale_f, out);
  }
  return out.to(dtype);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged KV cache",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("score_products", &score_products, "what bf16 decodes with this block and head size "
        "score with: tiles, pairs, or empty (widened dot products)");
#define NALAR_DIM(D) D,
  m.attr("head_dims") = std::vector<int64_t>{NALAR_HEAD_DIMS(NALAR_DIM)};
#undef NALAR_DIM
  m.attr("max_rows") = kMaxRows;
}
