// The CPU kernels of pipeline/cpu_kernels.py: one pass per row where PyTorch's operators would make several over
// memory (the attention's softmax and its gradient, the loss's softmax cross-entropy). Plain loops for the compiler
// to vectorize (-O3 -march=native -fopenmp-simd).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as PyTorch's conversion (NaN stays NaN)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// exp(x) for x <= 0 to within 2 ulp (exp(-87) below): Cody-Waite reduction to |r| <= ln2/2, Taylor to r^7, the
// power of two set in the exponent bits; plain float arithmetic the compiler vectorizes
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline float load(const uint16_t v) { return to_float(v); }
inline float load(const float v) { return v; }
inline void store(uint16_t* at, float v) { *at = to_bf16(v); }
inline void store(float* at, float v) { *at = v; }

// softmax(scores * scale) over each row's allowed keys; rows: (sequences x kv heads, groups x queries, keys), the
// block of `queries` queries starting at query `offset`, against keys 0 .. keys - 1. A mask (sequences or 1, all
// queries, all keys) says which keys each query sees; causal: none after its own position.
template <typename T>
void probs_impl(const T* in, T* res, const bool* m, int64_t mask_batches, int64_t mask_queries, int64_t mask_keys,
                int64_t batches, int64_t rows, int64_t keys, int64_t queries, int64_t kv_heads, int64_t offset,
                bool causal, float s) {
  at::parallel_for(0, batches * rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(keys);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / rows, q = offset + (r % rows) % queries;
      const T* x = in + r * keys;
      T* y = res + r * keys;
      const bool* allow = m ? m + ((mask_batches > 1 ? b / kv_heads : 0) * mask_queries + q) * mask_keys : nullptr;
      const int64_t limit = causal ? std::min(keys, q + 1) : keys;
      float peak = -3.0e38f;
      bool any = !allow;
      for (int64_t j = 0; j < limit && !any; ++j) any = allow[j];
      if (!any) {  // attends nowhere (a padded query): zero probabilities, zero gradient
        std::memset(y, 0, keys * sizeof(T));
        continue;
      }
#pragma omp simd reduction(max : peak)
      for (int64_t j = 0; j < limit; ++j) {
        const float v = (!allow || allow[j]) ? load(x[j]) * s : -3.0e38f;
        buf[j] = v;
        peak = v > peak ? v : peak;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < limit; ++j) {
        const float e = (!allow || allow[j]) ? exp_nonpositive(buf[j] - peak) : 0.f;
        buf[j] = e;
        sum += e;
      }
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t j = 0; j < limit; ++j) store(y + j, buf[j] * inv);
      for (int64_t j = limit; j < keys; ++j) store(y + j, 0.f);
    }
  });
}

// probs * (grad_probs - rowsum(probs * grad_probs)), from probabilities and their gradient, in their dtype
template <typename T>
void grad_scores_impl(const T* p, const T* g, T* res, int64_t rows, int64_t keys) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* pr = p + r * keys;
      const T* gr = g + r * keys;
      T* y = res + r * keys;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < keys; ++j) dot += load(pr[j]) * load(gr[j]);
#pragma omp simd
      for (int64_t j = 0; j < keys; ++j) store(y + j, load(pr[j]) * (load(gr[j]) - dot));
    }
  });
}

}  // namespace

// The attention's probabilities (bf16 or fp32 scores, the same dtype out); see probs_impl.
torch::Tensor probs(torch::Tensor scores, double scale, c10::optional<torch::Tensor> mask, int64_t queries,
                    int64_t kv_heads, int64_t offset, bool causal) {
  TORCH_CHECK(scores.is_contiguous() && scores.dim() == 3 && (causal || mask.has_value()));
  auto out = torch::empty_like(scores);
  const int64_t batches = scores.size(0), rows = scores.size(1), keys = scores.size(2);
  const bool* m = nullptr;
  int64_t mask_batches = 0, mask_queries = 0, mask_keys = 0;
  torch::Tensor mask_c;
  if (mask.has_value()) {
    mask_c = mask->contiguous();
    mask_queries = mask_c.size(-2), mask_keys = mask_c.size(-1);
    TORCH_CHECK(mask_c.scalar_type() == torch::kBool && mask_keys >= keys && mask_queries >= offset + queries);
    m = mask_c.data_ptr<bool>();
    mask_batches = mask_c.numel() / (mask_queries * mask_keys);
  }
  const float s = static_cast<float>(scale);
  if (scores.scalar_type() == torch::kBFloat16) {
    probs_impl(reinterpret_cast<const uint16_t*>(scores.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()), m,
               mask_batches, mask_queries, mask_keys, batches, rows, keys, queries, kv_heads, offset, causal, s);
  } else {
    TORCH_CHECK(scores.scalar_type() == torch::kFloat, "scores in bf16 or fp32");
    probs_impl(scores.data_ptr<float>(), out.data_ptr<float>(), m, mask_batches, mask_queries, mask_keys, batches,
               rows, keys, queries, kv_heads, offset, causal, s);
  }
  return out;
}

// The softmax's gradient (bf16 or fp32); see grad_scores_impl.
torch::Tensor grad_scores(torch::Tensor probs, torch::Tensor grad_probs) {
  TORCH_CHECK(probs.scalar_type() == grad_probs.scalar_type() && probs.sizes() == grad_probs.sizes());
  TORCH_CHECK(probs.is_contiguous() && grad_probs.is_contiguous());
  auto out = torch::empty_like(probs);
  const int64_t keys = probs.size(-1), rows = probs.numel() / keys;
  if (probs.scalar_type() == torch::kBFloat16) {
    grad_scores_impl(reinterpret_cast<const uint16_t*>(probs.data_ptr()),
                     reinterpret_cast<const uint16_t*>(grad_probs.data_ptr()),
                     reinterpret_cast<uint16_t*>(out.data_ptr()), rows, keys);
  } else {
    TORCH_CHECK(probs.scalar_type() == torch::kFloat, "probabilities in bf16 or fp32");
    grad_scores_impl(probs.data_ptr<float>(), grad_probs.data_ptr<float>(), out.data_ptr<float>(), rows, keys);
  }
  return out;
}


namespace {

template <typename T>
void cross_entropy_rows_impl(T* logits, const int64_t* targets, float* losses, int64_t rows, int64_t vocab,
                             bool write_grad) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> exps(vocab);
    for (int64_t r = begin; r < end; ++r) {
      T* x = logits + r * vocab;
      const int64_t target = targets[r];
      TORCH_CHECK(target >= 0 && target < vocab, "target ", target, " outside the vocabulary of ", vocab);
      float peak = -3.0e38f;
#pragma omp simd reduction(max : peak)
      for (int64_t j = 0; j < vocab; ++j) peak = load(x[j]) > peak ? load(x[j]) : peak;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < vocab; ++j) {
        const float e = exp_nonpositive(load(x[j]) - peak);
        exps[j] = e;
        sum += e;
      }
      losses[r] = peak + std::log(sum) - load(x[target]);
      if (!write_grad) continue;
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t j = 0; j < vocab; ++j) store(x + j, exps[j] * inv);
      store(x + target, exps[target] * inv - 1.f);
    }
  });
}

}  // namespace

// Softmax cross-entropy of each row of `logits` (rows x vocabulary, bf16 or fp32) against its target: the rows'
// losses (fp32); with write_grad, each row then holds softmax - one-hot (the loss's gradient), in its own dtype.
torch::Tensor cross_entropy_rows(torch::Tensor logits, torch::Tensor targets, bool write_grad) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && targets.scalar_type() == torch::kLong);
  TORCH_CHECK(targets.is_contiguous() && targets.numel() == logits.size(0));
  auto losses = torch::empty({logits.size(0)}, logits.options().dtype(torch::kFloat));
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (logits.scalar_type() == torch::kBFloat16) {
    cross_entropy_rows_impl(reinterpret_cast<uint16_t*>(logits.data_ptr()), targets.data_ptr<int64_t>(),
                            losses.data_ptr<float>(), rows, vocab, write_grad);
  } else {
    TORCH_CHECK(logits.scalar_type() == torch::kFloat, "logits in bf16 or fp32");
    cross_entropy_rows_impl(logits.data_ptr<float>(), targets.data_ptr<int64_t>(), losses.data_ptr<float>(), rows,
                            vocab, write_grad);
  }
  return losses;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("probs", &probs);
  m.def("grad_scores", &grad_scores);
  m.def("cross_entropy_rows", &cross_entropy_rows);
}
