// RMSNorm (Zhang & Sennrich 2019) of each row of a [T, H] tensor in one call, rounding as
// transformers' Llama-family modules do (LlamaRMSNorm, Qwen2RMSNorm, ...): the variance in
// float32, the row times 1/sqrt(variance + eps) rounded to the input's dtype, then that times
// the weight rounded again. Those modules take eight torch ops per call, and at decode batch
// sizes each op's dispatch costs more than its arithmetic.
//
// add_rms_norm also adds a residual first (vLLM's fused_add_rms_norm): the sum rounded to the
// dtype, as torch's add rounds it, is both returned and normalised, so a decoder layer's
// residual add and the next norm are one call instead of two.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor to and from Python; far lighter than torch/extension.h
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kElementsPerTask = 1 << 15;  // under this, one thread: a fork costs more

// Sum of squares of n floats: vector partial sums, then one shuffle-tree reduction.
float sum_of_squares(const float* x, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

// Row r of x, plus row r of residual where there is one (the sum rounded to T and stored in
// sum), as floats in row.
template <typename T>
void load_row(const T* x, const T* residual, T* sum, int64_t r, int64_t hidden, float* row) {
  const T* in = x + r * hidden;
  if (residual == nullptr) {
    for (int64_t i = 0; i < hidden; ++i) row[i] = static_cast<float>(in[i]);
    return;
  }
  const T* add = residual + r * hidden;
  T* dst = sum + r * hidden;
  for (int64_t i = 0; i < hidden; ++i) {
    dst[i] = static_cast<T>(static_cast<float>(in[i]) + static_cast<float>(add[i]));
    row[i] = static_cast<float>(dst[i]);
  }
}

template <typename T>
void norm_rows(const T* x, const T* residual, T* sum, const T* weight, T* out, int64_t begin,
               int64_t end, int64_t hidden, float eps) {
  std::vector<float> row(hidden);
  for (int64_t r = begin; r < end; ++r) {
    load_row<T>(x, residual, sum, r, hidden, row.data());
    const float variance = sum_of_squares(row.data(), hidden) / static_cast<float>(hidden);
    const float inverse = 1.f / std::sqrt(variance + eps);
    T* dst = out + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) {
      const T normed = static_cast<T>(row[i] * inverse);
      dst[i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));
    }
  }
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16)
              && weight.scalar_type() == dtype, "float32 or bfloat16 x and weight, of one dtype");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "x [T, H] and weight [H]");
}

// out = norm(x + residual), sum = x + residual where residual is defined, else out = norm(x).
void norm(const at::Tensor& x, const at::Tensor& residual, at::Tensor& sum,
          const at::Tensor& weight, at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(hidden, 1));
  const auto eps_f = static_cast<float>(eps);
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      const float* add = residual.defined() ? residual.data_ptr<float>() : nullptr;
      float* total = sum.defined() ? sum.data_ptr<float>() : nullptr;
      at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        norm_rows<float>(x.data_ptr<float>(), add, total, weight.data_ptr<float>(),
                         out.data_ptr<float>(), begin, end, hidden, eps_f);
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using BF16 = at::BFloat16;
      const BF16* add = residual.defined() ? residual.data_ptr<BF16>() : nullptr;
      BF16* total = sum.defined() ? sum.data_ptr<BF16>() : nullptr;
      at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        norm_rows<BF16>(x.data_ptr<BF16>(), add, total, weight.data_ptr<BF16>(),
                        out.data_ptr<BF16>(), begin, end, hidden, eps_f);
      });
    }));
}

}  // namespace

// x [T, H] float32 or bfloat16; weight [H] of x's dtype. Returns [T, H] in x's dtype.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check(x, weight);
  const auto input = x.contiguous();
  auto out = at::empty_like(input);
  at::Tensor none;
  norm(input, none, none, weight.contiguous(), out, eps);
  return out;
}

// x and residual [T, H], weight [H], all float32 or all bfloat16. Returns (x + residual,
// rms_norm(x + residual)), both [T, H] in their dtype.
std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                                     double eps) {
  check(x, weight);
  TORCH_CHECK(residual.device().is_cpu() && residual.scalar_type() == x.scalar_type()
              && residual.sizes() == x.sizes(), "residual of x's shape and dtype");
  const auto input = x.contiguous();
  const auto add = residual.contiguous();
  auto sum = at::empty_like(input);
  auto out = at::empty_like(input);
  norm(input, add, sum, weight.contiguous(), out, eps);
  return {sum, out};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, rounded as transformers' Llama modules",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "a residual added, then RMSNorm of each row of the sum",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
