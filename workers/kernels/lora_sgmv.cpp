// LoRA deltas of a step's rows, grouped by adapter, in one call per projection: for each
// adapter g and each of its rows r, out[r] += (x[r] @ A_g^T) @ Bt_g. This is the segmented
// gather-matmul-scatter of Punica's SGMV (Chen et al., 2023, "Punica: Multi-Tenant LoRA
// Serving") and S-LoRA (Sheng et al., 2023) on a CPU: each adapter's A and Bt are read once for
// all of its rows, row by row (each row of A or Bt is used by every row of x before the next is
// read, in order, so the reads are sequential), rows are gathered and scattered by index, so
// the rows of one adapter need not be consecutive. In torch the same work is four ops per
// adapter and projection; at decode sizes their fixed cost, not the arithmetic, was the step's
// LoRA time (measured: 18 us per small matmul, 960 of them a step at 16 rows over 4 adapters).
//
// x and out are float32 or bfloat16 (out is updated in place, rounded once per element: out +
// delta in float32, as torch's out += delta rounds); A [R, I] and Bt [R, O] are float32 or
// bfloat16, all of one dtype (Bt is lora_B transposed, its scaling folded in), widened to
// float32 as they are read. Accumulation is in float32. At decode sizes the deltas are bound by
// reading the adapters' weights, so bf16 weights halve their time.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kColumnsPerTask = 256;  // output columns per parallel task (a multiple of
                                          // the register block's)

float dot(const float* a, const float* b, int64_t n) {
  Vec acc0(0.0f), acc1(0.0f);
  int64_t i = 0;
  for (; i + 2 * Vec::size() <= n; i += 2 * Vec::size()) {
    acc0 = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + i + Vec::size()), Vec::loadu(b + i + Vec::size()),
                          acc1);
  }
  for (; i + Vec::size() <= n; i += Vec::size()) {
    acc0 = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc0);
  }
  Vec acc = acc0 + acc1;
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

template <typename T>
void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// xa[j, k] = x[rows[j]] . a[k], for the n rows of one adapter; each row of a is widened to
// float32 once for all n rows.
template <typename T, typename W>
void shrink(const T* x, int64_t in, const int64_t* rows, int64_t n, const W* a, int64_t rank,
            float* xa) {
  std::vector<float> xs(n * in), a_row(in);
  for (int64_t j = 0; j < n; ++j) load_row(x + rows[j] * in, xs.data() + j * in, in);
  for (int64_t k = 0; k < rank; ++k) {
    const float* weights = a_row.data();
    if constexpr (std::is_same_v<W, float>) {
      weights = a + k * in;
    } else {
      load_row(a + k * in, a_row.data(), in);
    }
    for (int64_t j = 0; j < n; ++j) xa[j * rank + k] = dot(xs.data() + j * in, weights, in);
  }
}

// kVectors float vectors of Bt at p (float32, or bfloat16 widened).
template <int kCount>
void load_vectors(const float* p, Vec* out) {
  for (int v = 0; v < kCount; ++v) out[v] = Vec::loadu(p + v * Vec::size());
}

template <int kCount>
void load_vectors(const at::BFloat16* p, Vec* out) {
  using Half = at::vec::Vectorized<at::BFloat16>;
  static_assert(kCount % 2 == 0, "bf16 loads widen to two float vectors");
  for (int v = 0; v < kCount; v += 2) {
    auto [low, high] = at::vec::convert_bfloat16_float(Half::loadu(p + v * Vec::size()));
    out[v] = low;
    out[v + 1] = high;
  }
}

// out[c] = out[c] + delta[c], rounded once to out's dtype, c < n.
void add_row(float* out, const float* delta, int64_t n) {
  int64_t c = 0;
  for (; c + Vec::size() <= n; c += Vec::size()) {
    (Vec::loadu(out + c) + Vec::loadu(delta + c)).store(out + c);
  }
  for (; c < n; ++c) out[c] += delta[c];
}

void add_row(at::BFloat16* out, const float* delta, int64_t n) {
  using Half = at::vec::Vectorized<at::BFloat16>;
  int64_t c = 0;
  for (; c + Half::size() <= n; c += Half::size()) {
    auto [low, high] = at::vec::convert_bfloat16_float(Half::loadu(out + c));
    at::vec::convert_float_bfloat16(low + Vec::loadu(delta + c),
                                    high + Vec::loadu(delta + c + Vec::size()))
        .store(out + c);
  }
  for (; c < n; ++c) out[c] = static_cast<float>(out[c]) + delta[c];
}

constexpr int kRows = 4;     // rows of x per register block
constexpr int kVectors = 4;  // column vectors per register block: kRows x kVectors sums

// The sums of a block of up to kRows rows over kVectors column vectors at column c: each
// vector of Bt is loaded once and used by every row of the block, in registers.
template <typename W>
void block_sums(const float* xa, int64_t rank, int rows, const W* bt, int64_t width,
                int64_t c, float sums[kRows][kVectors * Vec::size()]) {
  Vec acc[kRows][kVectors];
  for (int j = 0; j < kRows; ++j) {
    for (int v = 0; v < kVectors; ++v) acc[j][v] = Vec(0.0f);
  }
  for (int64_t k = 0; k < rank; ++k) {
    Vec b[kVectors];
    load_vectors<kVectors>(bt + k * width + c, b);
    for (int j = 0; j < kRows; ++j) {
      if (j >= rows) break;
      const Vec scale(xa[j * rank + k]);
      for (int v = 0; v < kVectors; ++v) acc[j][v] = at::vec::fmadd(scale, b[v], acc[j][v]);
    }
  }
  for (int j = 0; j < rows; ++j) {
    for (int v = 0; v < kVectors; ++v) acc[j][v].store(sums[j] + v * Vec::size());
  }
}

// out[rows[j], c] += sum_k xa[j, k] * bt[k, c] for the columns [begin, end): register blocks
// of kRows rows by kVectors vectors, then what is left of the columns one scalar at a time.
template <typename T, typename W>
void expand(T* out, int64_t width, const int64_t* rows, int64_t n, const float* xa,
            const W* bt, int64_t rank, int64_t begin, int64_t end) {
  constexpr int64_t kColumns = kVectors * Vec::size();
  float sums[kRows][kColumns];
  for (int64_t j0 = 0; j0 < n; j0 += kRows) {
    const int block = static_cast<int>(std::min<int64_t>(kRows, n - j0));
    const float* block_xa = xa + j0 * rank;
    int64_t c = begin;
    for (; c + kColumns <= end; c += kColumns) {
      block_sums(block_xa, rank, block, bt, width, c, sums);
      for (int j = 0; j < block; ++j) add_row(out + rows[j0 + j] * width + c, sums[j], kColumns);
    }
    for (; c < end; ++c) {
      for (int j = 0; j < block; ++j) {
        float sum = 0.0f;
        for (int64_t k = 0; k < rank; ++k) {
          sum += block_xa[j * rank + k] * static_cast<float>(bt[k * width + c]);
        }
        add_row(out + rows[j0 + j] * width + c, &sum, 1);
      }
    }
  }
}

template <typename T, typename W>
void apply(at::Tensor& out, const at::Tensor& x, const int64_t* rows,
           const std::vector<int64_t>& offsets, const std::vector<at::Tensor>& a,
           const std::vector<at::Tensor>& bt) {
  const int64_t in = x.size(1), width = out.size(1);
  const T* x_data = x.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int64_t n = offsets[g + 1] - offsets[g];
    const int64_t rank = a[g].size(0);
    if (n == 0 || rank == 0) continue;  // no rows, or an adapter that skips this projection
    const int64_t* group = rows + offsets[g];
    std::vector<float> xa(n * rank);
    shrink(x_data, in, group, n, a[g].data_ptr<W>(), rank, xa.data());
    const W* bt_data = bt[g].data_ptr<W>();
    // Columns are split between threads in whole vectors: every row of a task is its own.
    const int64_t vectors = (width + Vec::size() - 1) / Vec::size();
    at::parallel_for(0, vectors, kColumnsPerTask / Vec::size(), [&](int64_t v0, int64_t v1) {
      expand(out_data, width, group, n, xa.data(), bt_data, rank, v0 * Vec::size(),
             std::min(width, v1 * Vec::size()));
    });
  }
}

// out [T, O] += per adapter g, for its rows rows[offsets[g]:offsets[g+1]]: (x @ a[g]^T) @ bt[g].
void lora_delta(at::Tensor out, const at::Tensor& x, const at::Tensor& rows,
                const std::vector<int64_t>& offsets, const std::vector<at::Tensor>& a,
                const std::vector<at::Tensor>& bt) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0),
              "out [T, O] and x [T, I] must share their rows");
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous(), "out and x must be contiguous");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "out and x must both be float32 or both bfloat16");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "rows must be a contiguous int64 vector");
  TORCH_CHECK(!offsets.empty() && offsets.size() == a.size() + 1 && a.size() == bt.size(),
              "offsets needs one entry more than a and bt");
  TORCH_CHECK(offsets.front() == 0 && offsets.back() == rows.size(0),
              "offsets must span rows from 0 to its length");
  const int64_t* row_data = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(row_data[i] >= 0 && row_data[i] < x.size(0), "row index out of range");
  }
  const auto weight_type = a.empty() ? at::kFloat : a[0].scalar_type();
  TORCH_CHECK(weight_type == at::kFloat || weight_type == at::kBFloat16,
              "a and bt must be float32 or bfloat16");
  for (size_t g = 0; g < a.size(); ++g) {
    TORCH_CHECK(offsets[g] <= offsets[g + 1], "offsets must not decrease");
    TORCH_CHECK(a[g].scalar_type() == weight_type && bt[g].scalar_type() == weight_type &&
                    a[g].is_contiguous() && bt[g].is_contiguous(),
                "every a and bt must be contiguous and of one dtype");
    TORCH_CHECK(a[g].dim() == 2 && a[g].size(1) == x.size(1) && bt[g].dim() == 2 &&
                    bt[g].size(0) == a[g].size(0) && bt[g].size(1) == out.size(1),
                "a [R, I] and bt [R, O] must fit x [T, I] and out [T, O]");
  }
  const bool float_x = x.scalar_type() == at::kFloat;
  if (weight_type == at::kFloat) {
    float_x ? apply<float, float>(out, x, row_data, offsets, a, bt)
            : apply<at::BFloat16, float>(out, x, row_data, offsets, a, bt);
  } else {
    float_x ? apply<float, at::BFloat16>(out, x, row_data, offsets, a, bt)
            : apply<at::BFloat16, at::BFloat16>(out, x, row_data, offsets, a, bt);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_delta", &lora_delta,
        "out[rows of adapter g] += (x[rows] @ a[g]^T) @ bt[g], in place",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
