// Rotary position embedding (RoPE, Su et al. 2021) in transformers' half-split layout, in one
// call per tensor: out = x * cos + rotate_half(x) * sin, where rotate_half(x) is
// (-x[D/2:], x[:D/2]). Each product and the sum are rounded to x's dtype, as torch's
// elementwise ops round them one by one, so the result is bit-identical to transformers'
// apply_rotary_pos_emb (built with -ffp-contract=off: no fused multiply-add may merge them).
//
// rope_store does a decoder layer's whole step between its q/k/v projection and attention in
// one call: it rotates q and k straight out of the fused projection's output and writes the
// rotated keys and the values into their paged-cache slots (vLLM fuses the same pair). Done
// as split, two rotations and two index copies, that was nine dispatched ops a layer, which
// cProfile put at about 1.5 ms of a 23 ms one-request decode step on one core of an AMX Xeon.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor to and from Python; far lighter than torch/extension.h
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

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

// Heads of tokens [begin, end) into a cache [kv_heads, slot_count, dim] at their tokens' slots:
// token t's head h is read at src + t * row_stride + h * dim.
template <typename T>
void store(const T* src, int64_t row_stride, T* cache, const int64_t* slots, int64_t slot_count,
           int64_t kv_heads, int64_t dim, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T* head = src + t * row_stride + h * dim;
      std::copy(head, head + dim, cache + (h * slot_count + slots[t]) * dim);
    }
  }
}

template <typename T>
void rope_store_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     int64_t heads, int64_t kv_heads, int64_t dim, at::Tensor& q, at::Tensor& k,
                     at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slots) {
  const int64_t tokens = qkv.size(0), row = qkv.stride(0);
  const int64_t slot_count = key_cache.size(1);
  const T* x = qkv.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* rotated_keys = k.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / (dim * (heads + 2 * kv_heads)));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    rotate<T>(x, row, dim, c, s, q.data_ptr<T>(), heads, dim, begin * heads, end * heads);
    rotate<T>(x + heads * dim, row, dim, c, s, rotated_keys, kv_heads, dim,
              begin * kv_heads, end * kv_heads);
    store<T>(rotated_keys, kv_heads * dim, key_cache.data_ptr<T>(), slot, slot_count, kv_heads,
             dim, begin, end);
    store<T>(x + (heads + kv_heads) * dim, row, value_cache.data_ptr<T>(), slot, slot_count,
             kv_heads, dim, begin, end);
  });
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

// qkv [T, (H + 2 KV) D] (unit stride along a row): q, k and v side by side, as the fused
// projection computes them; cos, sin [T, D]; key_cache, value_cache [KV, slots, D]
// contiguous; slots [T] int64. All floating tensors float32 or all bfloat16. Writes rotated
// keys and the values to their slots and returns (q, k, v): q [T, H, D] and k [T, KV, D]
// rotated, contiguous, and v [T, KV, D] a view of qkv.
std::vector<at::Tensor> rope_store(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads,
                                   int64_t kv_heads, at::Tensor key_cache, at::Tensor value_cache,
                                   at::Tensor slots) {
  for (const auto& t : {qkv, cos, sin, key_cache, value_cache, slots}) {
    TORCH_CHECK(t.device().is_cpu(), "CPU tensors");
  }
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && cos.scalar_type() == dtype
              && sin.scalar_type() == dtype && key_cache.scalar_type() == dtype
              && value_cache.scalar_type() == dtype,
              "float32 or bfloat16 qkv, cos, sin and caches, of one dtype");
  TORCH_CHECK(heads > 0 && kv_heads > 0, "positive head counts");
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.is_contiguous()
              && value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous()
              && key_cache.size(0) == kv_heads, "contiguous caches [KV, slots, D]");
  const int64_t dim = key_cache.size(2), tokens = qkv.size(0);
  TORCH_CHECK(dim % 2 == 0, "an even head size");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "qkv [T, (H + 2 KV) D] with unit stride along a row");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == dim
              && sin.sizes() == cos.sizes(), "cos and sin [T, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == tokens,
              "slots [T] int64");
  const auto slot_ids = slots.contiguous();
  const int64_t* slot = slot_ids.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(slot, slot + tokens,
                          [&](int64_t i) { return i >= 0 && i < key_cache.size(1); }),
              "slots inside the cache");
  const auto c = cos.contiguous();
  const auto s = sin.contiguous();
  auto q = at::empty({tokens, heads, dim}, qkv.options());
  auto k = at::empty({tokens, kv_heads, dim}, qkv.options());
  AT_DISPATCH_SWITCH(dtype, "rope_store",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      rope_store_rows<float>(qkv, c, s, heads, kv_heads, dim, q, k, key_cache, value_cache,
                             slot_ids);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      rope_store_rows<at::BFloat16>(qkv, c, s, heads, kv_heads, dim, q, k, key_cache,
                                    value_cache, slot_ids);
    }));
  auto v = qkv.narrow(1, (heads + kv_heads) * dim, kv_heads * dim).view({tokens, kv_heads, dim});
  return {q, k, v};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope", &rope, "rotary position embedding, bit-identical to transformers'",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rope_store", &rope_store,
        "q and k rotated out of a fused projection, keys and values stored in the paged cache",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
