// The elementwise steps of a decoder layer on the CPU, each fused into one pass over its rows:
// RMSNorm (optionally after adding the sublayer's output into the residual stream), the per-head
// RMSNorm of q and k (Qwen3) followed by rotary embedding, and SwiGLU's silu(gate) * up.
//
// Part of the CPU kernel library that nanoserve/native.py builds at first use (see there). Each
// entry point replaces a chain of 5-15 small torch calls, each of which costs microseconds of
// dispatch whatever the size of its tensor. Numerics follow the torch path (nanoserve/model/
// layers.py, itself the Hugging Face reference): statistics in fp32, and wherever torch holds a T
// (the model's dtype) between two ops, the value is rounded to T here as well; results differ from
// torch's only by the order of fp32 sums and the last bits of exp.
//
// Layouts (all contiguous, row-major): x, residual and out [rows, dim]; qkv [rows, row_stride] with
// the q heads then the k heads at the start of each row; cos and sin [rows, head_dim] (halves
// repeated, as nanoserve.model.layers.rope_cos_sin gives them); gate_up [rows, 2 * inter] (gate
// then up) and its out [rows, inter]. Rows are shared among `num_threads` OpenMP threads when there
// are enough elements to pay for waking them; each thread writes only its own rows.

#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "simd.h"

namespace {

using namespace nanoserve;

constexpr int64_t kParallelElems = 1 << 15;  // below this many elements one thread does the work

template <typename T>
float sum_squares(const T* x, int64_t n) {
  vec8 acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vec8 v = load8(x + i);
    acc += v * v;
  }
  float s = hsum(acc);
  for (; i < n; ++i) s += to_float(x[i]) * to_float(x[i]);
  return s;
}

// out = w * T(x / sqrt(mean(x^2) + eps)), the product rounded to T. out may be x.
template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float r = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store8(load8(w + i) * round8(load8(x + i) * r, x), out + i);
  for (; i < n; ++i) from_float(to_float(w[i]) * round_to(to_float(x[i]) * r, x), out + i);
}

// residual = T(residual + x), row by row.
template <typename T>
void add_into(const T* x, T* residual, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store8(load8(residual + i) + load8(x + i), residual + i);
  for (; i < n; ++i) from_float(to_float(residual[i]) + to_float(x[i]), residual + i);
}

template <typename T>
void rms_norm(const T* x, T* residual, const T* w, T* out, int64_t rows, int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows * dim >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = x + r * dim;
    if (residual != nullptr) {
      add_into(src, residual + r * dim, dim);
      src = residual + r * dim;
    }
    norm_row(src, w, out + r * dim, dim, eps);
  }
}

// One head in place: RMSNorm with weight w (skipped when w is null), then rotation by the
// "rotate half" convention, x * cos + cat(-x2, x1) * sin, each product and the sum rounded to T.
template <typename T>
void norm_rope_head(T* x, const T* w, const T* cos, const T* sin, int64_t head_dim, float eps) {
  if (w != nullptr) norm_row(x, w, x, head_dim, eps);
  const int64_t half = head_dim / 2;
  T* x2 = x + half;
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    const vec8 a = load8(x + i), b = load8(x2 + i);
    store8(round8(a * load8(cos + i), x) + round8(-b * load8(sin + i), x), x + i);
    store8(round8(b * load8(cos + half + i), x) + round8(a * load8(sin + half + i), x), x2 + i);
  }
  for (; i < half; ++i) {
    const float a = to_float(x[i]), b = to_float(x2[i]);
    from_float(round_to(a * to_float(cos[i]), x) + round_to(-b * to_float(sin[i]), x), x + i);
    from_float(round_to(b * to_float(cos[half + i]), x) + round_to(a * to_float(sin[half + i]), x), x2 + i);
  }
}

template <typename T>
void qk_norm_rope(T* qkv, int64_t rows, int64_t row_stride, int64_t num_heads, int64_t num_kv_heads,
                  int64_t head_dim, const T* cos, const T* sin, const T* q_weight, const T* k_weight, float eps,
                  int num_threads) {
#pragma omp parallel for num_threads(num_threads) \
    if (num_threads > 1 && rows * (num_heads + num_kv_heads) * head_dim >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    T* row = qkv + r * row_stride;
    const T* c = cos + r * head_dim;
    const T* s = sin + r * head_dim;
    for (int64_t h = 0; h < num_heads; ++h) norm_rope_head(row + h * head_dim, q_weight, c, s, head_dim, eps);
    for (int64_t h = num_heads; h < num_heads + num_kv_heads; ++h)
      norm_rope_head(row + h * head_dim, k_weight, c, s, head_dim, eps);
  }
}

// silu(x) = x * sigmoid(x) from t = e^-|x| <= 1, which cannot overflow: x / (1 + t) for x >= 0,
// x * t / (1 + t) below.
inline vec8 silu8(vec8 x) {
  const vec8 t = exp_nonpositive(x < 0.0f ? x : -x);
  return (x < 0.0f ? x * t : x) / (t + 1.0f);
}

// out = T(T(silu(gate)) * up), as torch's F.silu(gate) * up. A row's last partial vector goes
// through a zero-padded copy, so every element gets the same arithmetic.
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows * inter >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * inter;
    const T* up = gate + inter;
    T* dst = out + r * inter;
    int64_t i = 0;
    for (; i + kLanes <= inter; i += kLanes) store8(round8(silu8(load8(gate + i)), gate) * load8(up + i), dst + i);
    if (i < inter) {
      T g[kLanes] = {}, u[kLanes] = {}, o[kLanes];
      for (int64_t j = i; j < inter; ++j) g[j - i] = gate[j], u[j - i] = up[j];
      store8(round8(silu8(load8(g)), gate) * load8(u), o);
      for (int64_t j = i; j < inter; ++j) dst[j] = o[j - i];
    }
  }
}

}  // namespace

extern "C" {

// out = RMSNorm(x) with weight w; when residual is not null, first residual += x and out =
// RMSNorm(residual) (the pre-norm block's "add, then norm the sum"). out may be x.
void nanoserve_rms_norm_f32(const float* x, float* residual, const float* w, float* out, int64_t rows, int64_t dim,
                            float eps, int num_threads) {
  rms_norm(x, residual, w, out, rows, dim, eps, num_threads);
}
void nanoserve_rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* w, uint16_t* out, int64_t rows,
                             int64_t dim, float eps, int num_threads) {
  rms_norm(x, residual, w, out, rows, dim, eps, num_threads);
}

// In place on the q and k heads of each qkv row: per-head RMSNorm when q_weight and k_weight are
// not null, then rotary embedding with that row's cos and sin.
void nanoserve_qk_norm_rope_f32(float* qkv, int64_t rows, int64_t row_stride, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, const float* cos, const float* sin,
                                const float* q_weight, const float* k_weight, float eps, int num_threads) {
  qk_norm_rope(qkv, rows, row_stride, num_heads, num_kv_heads, head_dim, cos, sin, q_weight, k_weight, eps,
               num_threads);
}
void nanoserve_qk_norm_rope_bf16(uint16_t* qkv, int64_t rows, int64_t row_stride, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, const uint16_t* cos, const uint16_t* sin,
                                 const uint16_t* q_weight, const uint16_t* k_weight, float eps, int num_threads) {
  qk_norm_rope(qkv, rows, row_stride, num_heads, num_kv_heads, head_dim, cos, sin, q_weight, k_weight, eps,
               num_threads);
}

// out = silu(gate) * up for the two halves of each gate_up row.
void nanoserve_silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t inter, int num_threads) {
  silu_mul(gate_up, out, rows, inter, num_threads);
}
void nanoserve_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter,
                             int num_threads) {
  silu_mul(gate_up, out, rows, inter, num_threads);
}

}  // extern "C"
