// Small-batch linear layers over dense weights packed once (CPU): bf16 or fp32 weights, on AVX2
// with FMA or AVX-512.
//
// A decode step multiplies a few rows by every weight of the model once, so its time is the
// time to read the weights. At 1 to 4 rows oneDNN's prepacked bf16 matmul read SmolLM2's
// weights at 8 to 10 GB/s on one core of an Intel Xeon with AMX, where summing a tensor reads
// 15 GB/s, and torch and ideep add about 15 us to each of a step's 121 calls. Its fp32 matmul
// did no better on an AVX2-only AMD EPYC: SmolLM2's linear layers took 44 ms a step at one row
// on one core, where reading their 513 MiB takes 30 ms, and 45 ms on two cores.
//
// bf16: the weights are packed once in groups of 16 output features, an input pair's 16
// features in one 64-byte line ([N / 16][K / 2][16][2]). Each line is widened in registers
// (bf16 is fp32's top half: a shift gives the even input's weights, a mask the odd one's) and
// multiplied in fp32 FMAs into 16 outputs at a time, with no horizontal sums. On an AMX Xeon
// AVX512-BF16's pair product ran at 1.6 G instructions/s against 6.6 G for FMAs, half the
// products per second, so it keeps FMAs. On a CPU with AVX512-BF16 and no AMX (AMD Zen 4) the
// same line is the pair product's operand as it is: one dpbf16ps against a broadcast input pair
// makes a group's 32 products, where the widening path needs two FMAs, a shift and a mask. One
// core then made about 110 G products a second from 16 rows on (SmolLM2's gate/up, warm in
// cache), faster than oneDNN's prepacked matmul up to 32 rows and within 5% either way at 64
// and 128.
// With AVX2 the bf16 groups are 8 features wide, widened the same way; there oneDNN has no bf16
// kernels, and torch's own bf16 matmul took 2.5-9x as long as this one at 1 to 256 rows
// (SmolLM2's projections, an AMD EPYC Zen 3), so it takes every bf16 matmul.
// fp32: groups of one vector's width of output features (8 with AVX2, 16 with AVX-512), each
// input's features in one vector ([N / W][K][W]), one FMA per input and group.
//
// Groups are read in panels of 4, which stay in L2 while the rows pass over them a few at a
// time (as many as the registers hold sums for), so each weight comes from memory once a call.
// Every output sums its products in input order in fp32 whatever the call's row count, so a
// row's result is the same alone or in a batch. From 8 rows on oneDNN was faster over FMAs in
// bf16 (on AMX tiles where the CPU has them), and in fp32 within 5% at 8 rows and faster at 16
// (Zen 4, AVX-512); with AVX2 (Zen 3) this kernel was faster up to 16 rows and even at 32. The
// caller keeps the crossover per path.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor to and from Python; far lighter than torch/extension.h
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>

// bf16 weights by pair products where the CPU has AVX512-BF16 and no AMX (see above).
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#define NALAR_PAIR_PRODUCTS
#endif

namespace {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t kPanel = 4;  // groups read together: independent FMA chains per row

// How a packed weight of element type W is laid out and consumed: output features per group,
// packed elements per input step (a bf16 pair is one uint32_t, two inputs), and rows a pass
// over a panel takes (its sums, the panel's loads and a row's broadcast fit the registers:
// 16 of them with AVX2, 32 with AVX-512).
template <typename W>
struct Layout;

template <>
struct Layout<uint32_t> {  // bf16 pairs
#if !defined(__AVX512F__)
  // AVX2: 8 features a group, widened like AVX-512's; 2 rows a pass fill the 16 registers
  // as the fp32 path's do (8 sums, a line, its widened half and a broadcast)
  static constexpr int64_t kFeatures = 8, kInputs = 2, kRows = 2;
  using Input = float;
#elif defined(NALAR_PAIR_PRODUCTS)
  // 24 sums, 4 lines and a broadcast: a verification block's 5 rows take one pass (in a
  // throwaway sweep at 4 rows a pass, 5 rows took 1.48x as long as 4 on SmolLM2's gate/up, one
  // thread; at 6 rows a pass, 1.26x; 8 rows a pass was no faster than 6)
  static constexpr int64_t kFeatures = 16, kInputs = 2, kRows = 6;
  using Input = uint32_t;  // x as bf16 pairs, multiplied by dpbf16ps
#else
  static constexpr int64_t kFeatures = 16, kInputs = 2, kRows = 4;
  using Input = float;  // x widened, multiplied by FMAs
#endif
};

template <>
struct Layout<float> {
  static constexpr int64_t kFeatures = Vec::size(), kInputs = 1, kRows = Vec::size() >= 16 ? 4 : 2;
  using Input = float;
};

template <typename W>
using Input = typename Layout<W>::Input;

// sums [R][G * features] = x [R rows of K inputs, ldx apart] . panel [G][steps][features].
template <typename W, int R, int G>
void panel_product(const Input<W>* x, int64_t ldx, const W* w, int64_t steps, float* sums) {
  constexpr int64_t F = Layout<W>::kFeatures;
  if constexpr (std::is_same_v<W, float>) {
    Vec acc[R][G];
    for (int r = 0; r < R; ++r) {
      for (int g = 0; g < G; ++g) acc[r][g] = Vec(0.f);
    }
    for (int64_t i = 0; i < steps; ++i) {
      Vec lines[G];
      for (int g = 0; g < G; ++g) lines[g] = Vec::loadu(w + (g * steps + i) * F);
      for (int r = 0; r < R; ++r) {
        const Vec input(x[r * ldx + i]);
        for (int g = 0; g < G; ++g) acc[r][g] = at::vec::fmadd(input, lines[g], acc[r][g]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int g = 0; g < G; ++g) acc[r][g].store(sums + (r * G + g) * F);
    }
  } else {
#if defined(__AVX512F__)
    __m512 acc[R][G];
    for (int r = 0; r < R; ++r) {
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
    }
#ifdef NALAR_PAIR_PRODUCTS
    for (int64_t p = 0; p < steps; ++p) {
      __m512bh lines[G];
      for (int g = 0; g < G; ++g) {
        lines[g] = (__m512bh)_mm512_loadu_si512(w + (g * steps + p) * F);
      }
      for (int r = 0; r < R; ++r) {
        const __m512bh input = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + p]));
        for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], input, lines[g]);
      }
    }
#else
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t p = 0; p < steps; ++p) {
      for (int g = 0; g < G; ++g) {
        const __m512i line = _mm512_loadu_si512(w + (g * steps + p) * F);
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
#endif
    for (int r = 0; r < R; ++r) {
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(sums + (r * G + g) * F, acc[r][g]);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[R][G];
    for (int r = 0; r < R; ++r) {
      for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
    }
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t p = 0; p < steps; ++p) {
      for (int g = 0; g < G; ++g) {
        const __m256i line = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w + (g * steps + p) * F));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(line, 16));
        for (int r = 0; r < R; ++r) {
          acc[r][g] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + 2 * p]), even, acc[r][g]);
        }
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(line, high));
        for (int r = 0; r < R; ++r) {
          acc[r][g] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + 2 * p + 1]), odd, acc[r][g]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int g = 0; g < G; ++g) _mm256_storeu_ps(sums + (r * G + g) * F, acc[r][g]);
    }
#endif
  }
}

template <typename W>
using PanelFn = void (*)(const Input<W>*, int64_t, const W*, int64_t, float*);

template <typename W, int R, int... G>
constexpr std::array<PanelFn<W>, sizeof...(G)> panels_of(std::integer_sequence<int, G...>) {
  return {&panel_product<W, R, G + 1>...};
}

template <typename W, int... R>
constexpr std::array<std::array<PanelFn<W>, kPanel>, sizeof...(R)> panel_table(
    std::integer_sequence<int, R...>) {
  return {panels_of<W, R + 1>(std::make_integer_sequence<int, kPanel>())...};
}

template <typename W>
PanelFn<W> panel_for(int64_t rows, int64_t groups) {
  static constexpr auto kPanels =
      panel_table<W>(std::make_integer_sequence<int, Layout<W>::kRows>());
  return kPanels[rows - 1][groups - 1];
}

// y [M, N] = x [M, K] . packed weight + bias, each output rounded once to Out. x holds K
// inputs a row as Input<W>: fp32, or bf16 pairs for pair products.
template <typename W, typename Out>
void run_panels(const Input<W>* x, int64_t m, int64_t k, const W* w, int64_t n,
                const float* bias, Out* y) {
  constexpr int64_t F = Layout<W>::kFeatures, kRows = Layout<W>::kRows;
  const int64_t groups = (n + F - 1) / F, steps = k / Layout<W>::kInputs;
  const int64_t ldx = std::is_same_v<Input<W>, float> ? k : steps;
  const int64_t panels = (groups + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kRows * kPanel * F];
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t g0 = panel * kPanel, g = std::min(kPanel, groups - g0);
      const int64_t col0 = g0 * F, cols = std::min(g * F, n - col0);
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = std::min(kRows, m - r0);
        panel_for<W>(rows, g)(x + r0 * ldx, ldx, w + g0 * steps * F, steps, sums);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            const float b = bias != nullptr ? bias[col0 + c] : 0.f;
            y[(r0 + r) * n + col0 + c] = static_cast<Out>(sums[r * g * F + c] + b);
          }
        }
      }
    }
  });
}

bool runs_f32() {
#if defined(__AVX512F__)
  return __builtin_cpu_supports("avx512f");
#elif defined(__AVX2__) && defined(__FMA__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool runs_bf16() { return runs_f32(); }  // the same instructions: AVX-512, or AVX2 with FMA

// [N, K] -> [ceil(N / F)][K / inputs][F * inputs] elements: groups of F output
// features, each input step's features together; the last group padded with zeros.
template <typename W>
void pack_into(const W* src, int64_t n, int64_t k, W* dst) {
  constexpr int64_t F = Layout<W>::kFeatures;
  const int64_t groups = (n + F - 1) / F, steps = k / Layout<W>::kInputs;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t features = std::min(F, n - g * F);
      for (int64_t p = 0; p < steps; ++p) {
        for (int64_t c = 0; c < features; ++c) {
          dst[(g * steps + p) * F + c] = src[(g * F + c) * steps + p];
        }
      }
    }
  });
}

}  // namespace

// weight [N, K] bfloat16 (K even) -> [ceil(N / W), K / 2, 2 * W] bfloat16, or float32 ->
// [ceil(N / W), K, W] float32, with W the vector width (8 with AVX2, 16 with AVX-512).
at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2
              && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "a [N, K] bfloat16 or float32 CPU weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  const auto w = weight.contiguous();
  if (weight.scalar_type() == at::kFloat) {
    constexpr int64_t F = Layout<float>::kFeatures;
    auto packed = at::zeros({(n + F - 1) / F, k, F}, weight.options());
    pack_into(w.data_ptr<float>(), n, k, packed.data_ptr<float>());
    return packed;
  }
  TORCH_CHECK(k % 2 == 0, "K must be even (bf16 inputs go in pairs), got ", k);
  constexpr int64_t F = Layout<uint32_t>::kFeatures;
  auto packed = at::zeros({(n + F - 1) / F, k / 2, 2 * F}, weight.options());
  pack_into(reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>()), n, k,
            reinterpret_cast<uint32_t*>(packed.data_ptr<at::BFloat16>()));
  return packed;
}

// x [M, K] times the packed weight of N output features (+ bias [N], any float dtype) ->
// [M, N] in x's dtype (bfloat16 over a bf16 pack, float32 over a float32 one), each output
// summed in fp32 and rounded once.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const std::optional<at::Tensor>& bias) {
  const bool f32 = packed.scalar_type() == at::kFloat;
  TORCH_CHECK(f32 ? runs_f32() : runs_bf16(), "the packed ", f32 ? "float32" : "bf16",
              " linear needs a build and CPU with AVX2 and FMA");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == packed.scalar_type(),
              "x must be a [M, K] CPU tensor of the packed weight's dtype");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t features = f32 ? Layout<float>::kFeatures : Layout<uint32_t>::kFeatures;
  const int64_t groups = (n + features - 1) / features, inputs = f32 ? 1 : 2;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(0) == groups
              && packed.size(1) * inputs == k && packed.size(2) == features * inputs,
              "packed weight [", groups, ", ", k / inputs, ", ", features * inputs,
              "] expected for N = ", n, ", K = ", k);
  at::Tensor bias_f;  // float32 and contiguous: read in place when it already is
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "bias of ", n, " features expected");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bias_values = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  if (f32) {
    const auto xf = x.contiguous();
    run_panels(xf.data_ptr<float>(), m, k, packed.data_ptr<float>(), n, bias_values,
               out.data_ptr<float>());
  } else {
    const auto* w = reinterpret_cast<const uint32_t*>(packed.data_ptr());
#ifdef NALAR_PAIR_PRODUCTS
    const auto xb = x.contiguous();  // bf16 pairs, read as they are
    const auto* inputs = reinterpret_cast<const uint32_t*>(xb.data_ptr());
#else
    const auto xb = x.to(at::kFloat).contiguous();
    const float* inputs = xb.data_ptr<float>();
#endif
    run_panels(inputs, m, k, w, n, bias_values, out.data_ptr<at::BFloat16>());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "a [N, K] bf16 or fp32 weight packed in groups of output features",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear", &linear, "x W^T (+ b) over a packed weight",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("runs_bf16", &runs_bf16, "whether this build and CPU run the bf16 path (AVX2+FMA)");
  m.def("runs_f32", &runs_f32, "whether this build and CPU run the fp32 path (AVX2+FMA)");
  m.attr("f32_features") = Layout<float>::kFeatures;
  m.attr("bf16_features") = Layout<uint32_t>::kFeatures;
  m.attr("bf16_pairs") = std::is_same_v<Input<uint32_t>, uint32_t>;
}
