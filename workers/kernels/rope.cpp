// Rotary position embedding (RoPE, Su et al. 2021) in transformers' half-split layout, in one
// call per tensor: out = x * cos + rotate_half(x) * sin, where rotate_half(x) is
// (-x[D/2:], x[:D/2]). Each product and the sum are rounded to x's dtype, as torch's
// elementwise ops round them one by one, so the result is bit-identical to transformers'
// apply_rotary_pos_emb (built with -ffp-contract=off: no fused multiply-add may merge them).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor to and from Python; far lighter than torch/extension.h
#include <ATen/Parallel.h>

#include <cstdint>

namespace {

constexpr int64_t kElementsPerTask = 1 << 15;  // under this, one thread: a fork costs more

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

template <typename T>
void rotate(const T* x, int64_t token_stride, int64_t head_stride, const T* cos, const T* sin,
            T* out, int64_t heads, int64_t dim, int64_t begin, int64_t end) {
  const int64_t half = dim / 2;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t t = item / heads, h = item % heads;
    const T* in = x + t * token_stride + h * head_stride;
    const T* c = cos + t * dim;
    const T* s = sin + t * dim;
    T* dst = out + item * dim;
    for (int64_t i = 0; i < dim; ++i) {
      const float rotated = i < half ? -static_cast<float>(in[i + half])
                                     : static_cast<float>(in[i - half]);
      const T straight = round_to<T>(static_cast<float>(in[i]) * static_cast<float>(c[i]));
      const T turned = round_to<T>(rotated * static_cast<float>(s[i]));
      dst[i] = round_to<T>(static_cast<float>(straight) + static_cast<float>(turned));
    }
  }
}

}  // namespace

// x [T, H, D] (any token and head strides, unit stride within a head), float32 or bfloat16;
// cos, sin [T, D] of x's dtype. Returns a contiguous [T, H, D] in x's dtype.
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "CPU tensors");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16)
              && cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "float32 or bfloat16 x, cos and sin, of one dtype");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x [T, H, D] with unit stride within a head");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "an even head size");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == dim
              && sin.sizes() == cos.sizes(), "cos and sin [T, D]");
  const auto c = cos.contiguous();
  const auto s = sin.contiguous();
  auto out = at::empty({tokens, heads, dim}, x.options());
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(dim, 1));
  AT_DISPATCH_SWITCH(dtype, "rope",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      at::parallel_for(0, tokens * heads, grain, [&](int64_t begin, int64_t end) {
        rotate<float>(x.data_ptr<float>(), x.stride(0), x.stride(1), c.data_ptr<float>(),
                      s.data_ptr<float>(), out.data_ptr<float>(), heads, dim, begin, end);
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using BF16 = at::BFloat16;
      at::parallel_for(0, tokens * heads, grain, [&](int64_t begin, int64_t end) {
        rotate<BF16>(x.data_ptr<BF16>(), x.stride(0), x.stride(1), c.data_ptr<BF16>(),
                     s.data_ptr<BF16>(), out.data_ptr<BF16>(), heads, dim, begin, end);
      });
    }));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope", &rope, "rotary position embedding, bit-identical to transformers'");
}
