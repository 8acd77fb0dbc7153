// The gated MLP's activation, silu(gate) * up (Shazeer 2020, "GLU variants"), over the fused
// gate/up projection's output in one pass. torch takes two ops and a [T, I] intermediate for
// it, each a pass over memory; here each element is read once.
//
// Bit-identical to torch's F.silu(gate) * up: silu is computed as torch's CPU kernel computes
// it (x / (1 + exp(-x)) in float32 with the same vectorised exp on each row's whole vectors,
// std::exp on the remainder, as its vectorised loop splits a row), rounded to the input's
// dtype, then the product rounded again. (Where torch splits a large tensor between threads
// in the middle of a row, it computes that row's pieces with their own remainders; only there
// can an element's last bit differ.)
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor to and from Python; far lighter than torch/extension.h
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kElementsPerTask = 1 << 15;  // under this, one thread: a fork costs more

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

inline Vec silu(const Vec& x) { return x / (Vec(1.0f) + x.neg().exp()); }

// torch's vectorised loop takes two of its vectors (of the tensor's dtype) at a time and
// leaves the rest of a row to the scalar function.
template <typename T>
constexpr int64_t torch_vector_span() {
  return 2 * at::vec::Vectorized<T>::size();
}

void row(const float* gate, const float* up, float* out, int64_t width) {
  const int64_t vectorised = width / torch_vector_span<float>() * torch_vector_span<float>();
  for (int64_t i = 0; i < vectorised; i += Vec::size()) {
    (silu(Vec::loadu(gate + i)) * Vec::loadu(up + i)).store(out + i);
  }
  for (int64_t i = vectorised; i < width; ++i) out[i] = silu(gate[i]) * up[i];
}

void row(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* out, int64_t width) {
  using Half = at::vec::Vectorized<at::BFloat16>;
  const int64_t vectorised =
      width / torch_vector_span<at::BFloat16>() * torch_vector_span<at::BFloat16>();
  for (int64_t i = 0; i < vectorised; i += Half::size()) {
    auto [g0, g1] = at::vec::convert_bfloat16_float(Half::loadu(gate + i));
    auto [u0, u1] = at::vec::convert_bfloat16_float(Half::loadu(up + i));
    // Round silu to bf16 first, as torch's separate op writes it.
    auto [s0, s1] = at::vec::convert_bfloat16_float(
        at::vec::convert_float_bfloat16(silu(g0), silu(g1)));
    at::vec::convert_float_bfloat16(s0 * u0, s1 * u1).store(out + i);
  }
  for (int64_t i = vectorised; i < width; ++i) {
    const at::BFloat16 s = silu(static_cast<float>(gate[i]));
    out[i] = static_cast<float>(s) * static_cast<float>(up[i]);
  }
}

template <typename T>
void rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t count = gate_up.size(0), width = out.size(1), stride = gate_up.stride(0);
  const T* in = gate_up.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(width, 1));
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      row(in + r * stride, in + r * stride + width, dst + r * width, width);
    }
  });
}

}  // namespace

// gate_up [T, 2I] float32 or bfloat16 (gate then up, unit stride along a row). Returns
// [T, I] silu(gate) * up in its dtype.
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu(), "CPU tensors");
  const auto dtype = gate_up.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "gate_up [T, 2I], unit stride along a row");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (dtype == at::kFloat) {
    rows<float>(gate_up, out);
  } else {
    rows<at::BFloat16>(gate_up, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_mul", &silu_mul, "silu(gate) * up over a fused gate/up projection",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
