// Structured output's token masks applied to a step's logits in one call: for each constrained
// row, every token whose bit is clear in the row's packed mask gets -inf. The mask is the
// grammar engine's (llguidance's) bitmask, 32 tokens a word, bit t % 32 of word t / 32.
//
// In torch the same takes an unpack to one bool per token and a masked fill: 1.6 ms for 16
// rows of SmolLM2's 49,152 tokens on a 2-core Zen 5 VM, against a 22 ms decode step, almost
// all of it the fill. Here a word whose tokens are all allowed (a free string's position) is
// skipped, and one with none allowed (a structural position) is 32 stores.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <limits>

// logits [B, V] float32, contiguous, updated in place; rows [C] int64, the constrained rows;
// masks [C, W] int32, W >= ceil(V / 32), row c's mask for logits row rows[c].
void apply_token_bitmask(at::Tensor logits, at::Tensor rows, at::Tensor masks) {
  TORCH_CHECK(logits.device().is_cpu() && rows.device().is_cpu() && masks.device().is_cpu(),
              "CPU tensors");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "logits [B, V] float32, contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "rows [C] int64");
  TORCH_CHECK(masks.scalar_type() == at::kInt && masks.dim() == 2 && masks.is_contiguous() &&
                  masks.size(0) == rows.size(0),
              "masks [C, W] int32, contiguous, one per row");
  const int64_t batch = logits.size(0), vocab = logits.size(1), words = masks.size(1);
  TORCH_CHECK(words * 32 >= vocab, "masks cover the vocabulary");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t c = 0; c < rows.size(0); ++c) {
    TORCH_CHECK(row_ids[c] >= 0 && row_ids[c] < batch, "row outside the logits");
  }
  float* out = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>());
  const float forbidden = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      float* row = out + row_ids[c] * vocab;
      const uint32_t* row_bits = bits + c * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = row_bits[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t first = w * 32, last = std::min<int64_t>(first + 32, vocab);
        for (int64_t t = first; t < last; ++t) {
          if (!((word >> (t - first)) & 1u)) row[t] = forbidden;
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "-inf for every token a row's packed mask forbids, in place",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
