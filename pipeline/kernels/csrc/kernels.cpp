// The CPU kernels of pipeline/kernels/cpp.py: one pass where PyTorch's operators would make several over memory (the
// attention's softmax and its gradient, the loss's softmax cross-entropy, SwiGLU's product, RMSNorm). Plain loops for the compiler
// to vectorize (-O3 -march=native -fopenmp-simd).
// The headers used and no more (pybind11 with torch's tensor casters, two operators): with <torch/extension.h> (the
// whole C++ frontend, 27 s to parse) a build took about 40 s of one core, with these 17 (the tests build every path).
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as PyTorch's conversion (NaN stays NaN); branch-free
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t nan = (bits >> 16) | 0x40u, even = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : even);
}

// exp(x) to within 2 ulp for -87 <= x <= 88 (clamped outside): Cody-Waite reduction to |r| <= ln2/2, Taylor to
// r^7, the power of two set in the exponent bits; plain float arithmetic the compiler vectorizes
inline float exp_fast(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
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
        const float e = (!allow || allow[j]) ? exp_fast(buf[j] - peak) : 0.f;
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
at::Tensor probs(at::Tensor scores, double scale, c10::optional<at::Tensor> mask, int64_t queries,
                 int64_t kv_heads, int64_t offset, bool causal) {
  TORCH_CHECK(scores.is_contiguous() && scores.dim() == 3 && (causal || mask.has_value()));
  auto out = at::empty_like(scores);
  const int64_t batches = scores.size(0), rows = scores.size(1), keys = scores.size(2);
  const bool* m = nullptr;
  int64_t mask_batches = 0, mask_queries = 0, mask_keys = 0;
  at::Tensor mask_c;
  if (mask.has_value()) {
    mask_c = mask->contiguous();
    mask_queries = mask_c.size(-2), mask_keys = mask_c.size(-1);
    TORCH_CHECK(mask_c.scalar_type() == at::kBool && mask_keys >= keys && mask_queries >= offset + queries);
    m = mask_c.data_ptr<bool>();
    mask_batches = mask_c.numel() / (mask_queries * mask_keys);
  }
  const float s = static_cast<float>(scale);
  if (scores.scalar_type() == at::kBFloat16) {
    probs_impl(reinterpret_cast<const uint16_t*>(scores.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()), m,
               mask_batches, mask_queries, mask_keys, batches, rows, keys, queries, kv_heads, offset, causal, s);
  } else {
    TORCH_CHECK(scores.scalar_type() == at::kFloat, "scores in bf16 or fp32");
    probs_impl(scores.data_ptr<float>(), out.data_ptr<float>(), m, mask_batches, mask_queries, mask_keys, batches,
               rows, keys, queries, kv_heads, offset, causal, s);
  }
  return out;
}

// The softmax's gradient (bf16 or fp32); see grad_scores_impl.
at::Tensor grad_scores(at::Tensor probs, at::Tensor grad_probs) {
  TORCH_CHECK(probs.scalar_type() == grad_probs.scalar_type() && probs.sizes() == grad_probs.sizes());
  TORCH_CHECK(probs.is_contiguous() && grad_probs.is_contiguous());
  auto out = at::empty_like(probs);
  const int64_t keys = probs.size(-1), rows = probs.numel() / keys;
  if (probs.scalar_type() == at::kBFloat16) {
    grad_scores_impl(reinterpret_cast<const uint16_t*>(probs.data_ptr()),
                     reinterpret_cast<const uint16_t*>(grad_probs.data_ptr()),
                     reinterpret_cast<uint16_t*>(out.data_ptr()), rows, keys);
  } else {
    TORCH_CHECK(probs.scalar_type() == at::kFloat, "probabilities in bf16 or fp32");
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
        const float e = exp_fast(load(x[j]) - peak);
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
at::Tensor cross_entropy_rows(at::Tensor logits, at::Tensor targets, bool write_grad) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && targets.scalar_type() == at::kLong);
  TORCH_CHECK(targets.is_contiguous() && targets.numel() == logits.size(0));
  auto losses = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (logits.scalar_type() == at::kBFloat16) {
    cross_entropy_rows_impl(reinterpret_cast<uint16_t*>(logits.data_ptr()), targets.data_ptr<int64_t>(),
                            losses.data_ptr<float>(), rows, vocab, write_grad);
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kFloat, "logits in bf16 or fp32");
    cross_entropy_rows_impl(logits.data_ptr<float>(), targets.data_ptr<int64_t>(), losses.data_ptr<float>(), rows,
                            vocab, write_grad);
  }
  return losses;
}

namespace {

// bf16 results rounded where PyTorch's operators round them, each operator's output in the tensors' dtype
inline float rounded(float v, const uint16_t*) { return to_float(to_bf16(v)); }
inline float rounded(float v, const float*) { return v; }

constexpr int64_t kRun = 256;  // elements per run of the elementwise kernels: a float buffer on the stack

template <typename T>
void silu_mul_impl(const T* gate, const T* up, T* out, int64_t n) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    float silu[kRun];
    for (int64_t start = begin; start < end; start += kRun) {
      const int64_t m = std::min(kRun, end - start);
      const T *g = gate + start, *u = up + start;
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) silu[i] = load(g[i]) / (1.f + exp_fast(-load(g[i])));
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) store(out + start + i, rounded(silu[i], g) * load(u[i]));
    }
  });
}

template <typename T>
void silu_mul_backward_impl(const T* grad, const T* gate, const T* up, T* grad_gate, T* grad_up, int64_t n) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    float sigmoid[kRun];
    for (int64_t start = begin; start < end; start += kRun) {
      const int64_t m = std::min(kRun, end - start);
      const T *g = gate + start, *u = up + start, *dy = grad + start;
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) sigmoid[i] = 1.f / (1.f + exp_fast(-load(g[i])));
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) {
        const float x = load(g[i]), s = sigmoid[i];
        store(grad_up + start + i, load(dy[i]) * rounded(x * s, g));
        const float dsilu = rounded(load(dy[i]) * load(u[i]), g);  // autograd: (grad * up), then silu's backward
        store(grad_gate + start + i, dsilu * s * (1.f + x * (1.f - s)));
      }
    }
  });
}

template <typename T>
void rms_norm_impl(const T* x, const T* weight, T* out, float* rms, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * width;
      T* y = out + r * width;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t j = 0; j < width; ++j) squares += load(xr[j]) * load(xr[j]);
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
      rms[r] = inv;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) store(y + j, load(weight[j]) * rounded(load(xr[j]) * inv, x));
    }
  });
}

template <typename T>
void rms_norm_backward_impl(const T* grad, const T* x, const T* weight, const float* rms, T* grad_x, int64_t rows,
                            int64_t width) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gr = grad + r * width;
      const T* xr = x + r * width;
      T* dx = grad_x + r * width;
      const float inv = rms[r];
      float dot = 0.f;  // sum of (grad * weight) * x over the row: the gradient of the reciprocal RMS, over x
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < width; ++j) dot += rounded(load(gr[j]) * load(weight[j]), x) * load(xr[j]);
      const float coefficient = -dot * inv * inv * inv / static_cast<float>(width);
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        store(dx + j, rounded(load(gr[j]) * load(weight[j]), x) * inv + coefficient * load(xr[j]));
      }
    }
  });
}

template <typename F>
void by_dtype(const at::Tensor& t, F f) {
  if (t.scalar_type() == at::kBFloat16) {
    f(static_cast<uint16_t*>(nullptr));
  } else {
    TORCH_CHECK(t.scalar_type() == at::kFloat, "tensors in bf16 or fp32");
    f(static_cast<float*>(nullptr));
  }
}

template <typename T>
T* data(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

void check_same(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes());
}

}  // namespace

// silu(gate) * up (SwiGLU's product), in the tensors' dtype
at::Tensor silu_mul(at::Tensor gate, at::Tensor up) {
  check_same(gate, up);
  auto out = at::empty_like(gate);
  by_dtype(gate, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_impl(data<T>(gate), data<T>(up), data<T>(out), gate.numel());
  });
  return out;
}

// The gradients of silu(gate) * up for gate and up
std::vector<at::Tensor> silu_mul_backward(at::Tensor grad, at::Tensor gate, at::Tensor up) {
  check_same(gate, up);
  check_same(grad, gate);
  auto grad_gate = at::empty_like(gate), grad_up = at::empty_like(up);
  by_dtype(gate, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_backward_impl(data<T>(grad), data<T>(gate), data<T>(up), data<T>(grad_gate), data<T>(grad_up),
                           gate.numel());
  });
  return {grad_gate, grad_up};
}

// LLaMA's RMSNorm over the last dimension: weight * (x * rsqrt(mean(x^2) + eps)), and each row's reciprocal RMS
std::vector<at::Tensor> rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.scalar_type() == weight.scalar_type());
  const int64_t width = x.size(-1), rows = x.numel() / width;
  TORCH_CHECK(weight.numel() == width);
  auto out = at::empty_like(x);
  auto rms = at::empty({rows}, x.options().dtype(at::kFloat));
  by_dtype(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_impl(data<T>(x), data<T>(weight), data<T>(out), rms.data_ptr<float>(), rows, width,
                  static_cast<float>(eps));
  });
  return {out, rms};
}

// The gradient of rms_norm for x (the weight's, where trained, is the caller's)
at::Tensor rms_norm_backward(at::Tensor grad, at::Tensor x, at::Tensor weight, at::Tensor rms) {
  check_same(grad, x);
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() && rms.is_contiguous());
  const int64_t width = x.size(-1), rows = x.numel() / width;
  auto grad_x = at::empty_like(x);
  by_dtype(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_backward_impl(data<T>(grad), data<T>(x), data<T>(weight), rms.data_ptr<float>(), data<T>(grad_x), rows,
                           width);
  });
  return grad_x;
}

// What the compiler built this for: the widest vector instructions it could use, and "+fma" where a * b + c may be
// one fused operation (another rounding); pipeline/kernels/cpp.py's `path` reports it
std::string isa() {
  std::string widest =
#if defined(__AVX512F__)
      "avx512";
#elif defined(__AVX2__)
      "avx2";
#elif defined(__SSE2__)
      "sse2";
#elif defined(__ARM_NEON)
      "neon";
#else
      "generic";
#endif
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  widest += "+fma";
#endif
  return widest;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa);
  m.def("probs", &probs);
  m.def("grad_scores", &grad_scores);
  m.def("cross_entropy_rows", &cross_entropy_rows);
  m.def("silu_mul", &silu_mul);
  m.def("silu_mul_backward", &silu_mul_backward);
  m.def("rms_norm", &rms_norm);
  m.def("rms_norm_backward", &rms_norm_backward);
}
