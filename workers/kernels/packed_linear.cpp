// Small-batch linear layers over dense bf16 weights packed once (CPU, AVX-512).
//
// A decode step multiplies a few rows by every weight of the model once, so its time is the
// time to read the weights. At 1 to 4 rows oneDNN's prepacked bf16 matmul read SmolLM2's
// weights at 8 to 10 GB/s on one core of an Intel Xeon with AMX, where summing a tensor reads
// 15 GB/s, and torch and ideep add about 15 us to each of a step's 121 calls. Here the
// weights are packed once in groups of 16 output features, an input pair's 16 features in one
// 64-byte line ([N / 16][K / 2][16][2]). Each line is widened in registers (bf16 is fp32's top
// half: a shift gives the even input's weights, a mask the odd one's) and multiplied in fp32
// FMAs into 16 outputs at a time, with no horizontal sums. AVX512-BF16's pair product was
// measured and not used: on that Xeon it ran at 1.6 G instructions/s against 6.6 G for FMAs,
// half the products per second. Groups are read in panels of 4 (64 features), which stay in
// L2 while the rows pass over them 4 at a time, so each weight comes from memory once a call.
// Every output sums its products in input order in fp32 whatever the call's row count, so a
// row's result is the same alone or in a batch. From 8 rows on oneDNN (on AMX tiles where the
// CPU has them) is faster, and the caller keeps it there.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor to and from Python; far lighter than torch/extension.h
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <array>
#include <optional>
#include <utility>

namespace {

constexpr int64_t kFeatures = 16;  // output features a group holds: one vector of fp32 sums
constexpr int64_t kPanel = 4;      // groups read together: 4 independent chains per row
constexpr int64_t kRows = 4;       // rows a pass over a panel takes: 16 sums in registers

#if defined(__AVX512F__)
constexpr bool kBuilt = true;

// sums [R][G * 16] = x [R rows of 2 * pairs fp32, ldx apart] . panel [G][pairs][16 pairs].
template <int R, int G>
void panel_product(const float* x, int64_t ldx, const uint32_t* w, int64_t pairs,
                   float* sums) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  }
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    for (int g = 0; g < G; ++g) {
      const __m512i line = _mm512_loadu_si512(w + (g * pairs + p) * kFeatures);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(line, 16));
      for (int r = 0; r < R; ++r) {
        acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * p]), even, acc[r][g]);
      }
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(line, high));
      for (int r = 0; r < R; ++r) {
        acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * p + 1]), odd, acc[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(sums + (r * G + g) * kFeatures, acc[r][g]);
  }
}

using PanelFn = void (*)(const float*, int64_t, const uint32_t*, int64_t, float*);

template <int R, int... G>
constexpr std::array<PanelFn, sizeof...(G)> panels_of(std::integer_sequence<int, G...>) {
  return {&panel_product<R, G + 1>...};
}

template <int... R>
constexpr std::array<std::array<PanelFn, kPanel>, sizeof...(R)> panel_table(
    std::integer_sequence<int, R...>) {
  return {panels_of<R + 1>(std::make_integer_sequence<int, kPanel>())...};
}

constexpr auto kPanels = panel_table(std::make_integer_sequence<int, kRows>());

PanelFn panel_for(int64_t rows, int64_t groups) { return kPanels[rows - 1][groups - 1]; }

#else
constexpr bool kBuilt = false;
#endif

bool runs_here() { return kBuilt && __builtin_cpu_supports("avx512f"); }

}  // namespace

// weight [N, K] bfloat16 (K even) -> [ceil(N / 16), K / 2, 32] bfloat16: groups of 16 output
// features, each input pair's 16 features together; the last group padded with zeros.
at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2
              && weight.scalar_type() == at::kBFloat16, "a [N, K] bfloat16 CPU weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % 2 == 0, "K must be even (inputs go in pairs), got ", k);
  const auto w = weight.contiguous();
  const int64_t groups = (n + kFeatures - 1) / kFeatures, pairs = k / 2;
  auto packed = at::zeros({groups, pairs, 2 * kFeatures}, weight.options());
  const auto* src = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t features = std::min(kFeatures, n - g * kFeatures);
      for (int64_t p = 0; p < pairs; ++p) {
        for (int64_t c = 0; c < features; ++c) {
          dst[(g * pairs + p) * kFeatures + c] = src[(g * kFeatures + c) * pairs + p];
        }
      }
    }
  });
  return packed;
}

// x [M, K] bfloat16 times the packed weight of N output features (+ bias [N], any float
// dtype) -> [M, N] bfloat16, each output summed in fp32 and rounded once.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(runs_here(), "packed bf16 linear needs a build and CPU with AVX-512");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "x must be a [M, K] bfloat16 CPU tensor");
  const int64_t m = x.size(0), k = x.size(1), groups = (n + kFeatures - 1) / kFeatures;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16
              && packed.is_contiguous() && packed.size(0) == groups
              && packed.size(1) * 2 == k && packed.size(2) == 2 * kFeatures,
              "packed weight [", groups, ", ", k / 2, ", 32] expected for N = ", n, ", K = ", k);
  at::Tensor bias_f;  // float32 and contiguous: read in place when it already is
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "bias of ", n, " features expected");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bias_values = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
#if defined(__AVX512F__)
  const auto xf = x.to(at::kFloat).contiguous();
  const float* xs = xf.data_ptr<float>();
  const auto* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  auto* y = out.data_ptr<at::BFloat16>();
  const int64_t pairs = k / 2, panels = (groups + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kRows * kPanel * kFeatures];
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t g0 = panel * kPanel, g = std::min(kPanel, groups - g0);
      const int64_t col0 = g0 * kFeatures, cols = std::min(g * kFeatures, n - col0);
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = std::min(kRows, m - r0);
        panel_for(rows, g)(xs + r0 * k, k, w + g0 * pairs * kFeatures, pairs, sums);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            const float b = bias_values != nullptr ? bias_values[col0 + c] : 0.f;
            y[(r0 + r) * n + col0 + c] = at::BFloat16(sums[r * g * kFeatures + c] + b);
          }
        }
      }
    }
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "a [N, K] bf16 weight packed in groups of 16 output features");
  m.def("linear", &linear, "x W^T (+ b) over a packed bf16 weight");
  m.def("runs_here", &runs_here, "whether this build and CPU have AVX-512");
}
