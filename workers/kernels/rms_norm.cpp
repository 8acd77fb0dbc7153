// RMSNorm (Zhang & Sennrich 2019) of each row of a [T, H] tensor in one call, rounding as
// transformers' Llama-family modules do (LlamaRMSNorm, Qwen2RMSNorm, ...): the variance in
// float32, the row times 1/sqrt(variance + eps) rounded to the input's dtype, then that times
// the weight rounded again. Those modules take eight torch ops per call, and at decode batch
// sizes each op's dispatch costs more than its arithmetic.
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

template <typename T>
void norm_rows(const T* x, const T* weight, T* out, int64_t begin, int64_t end, int64_t hidden,
               float eps) {
  std::vector<float> row(hidden);
  for (int64_t r = begin; r < end; ++r) {
    const T* in = x + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) row[i] = static_cast<float>(in[i]);
    const float variance = sum_of_squares(row.data(), hidden) / static_cast<float>(hidden);
    const float inverse = 1.f / std::sqrt(variance + eps);
    T* dst = out + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) {
      const T normed = static_cast<T>(row[i] * inverse);
      dst[i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));
    }
  }
}

}  // namespace

// x [T, H] float32 or bfloat16; weight [H] of x's dtype. Returns [T, H] in x's dtype.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16)
              && weight.scalar_type() == dtype, "float32 or bfloat16 x and weight, of one dtype");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "x [T, H] and weight [H]");
  const auto input = x.contiguous();
  const auto w = weight.contiguous();
  auto out = at::empty_like(input);
  const int64_t rows = input.size(0), hidden = input.size(1);
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(hidden, 1));
  const auto eps_f = static_cast<float>(eps);
  AT_DISPATCH_SWITCH(dtype, "rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        norm_rows<float>(input.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(),
                         begin, end, hidden, eps_f);
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        norm_rows<at::BFloat16>(input.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                                out.data_ptr<at::BFloat16>(), begin, end, hidden, eps_f);
      });
    }));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, rounded as transformers' Llama modules");
}
