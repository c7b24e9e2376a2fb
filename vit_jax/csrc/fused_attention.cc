// Fused softmax attention for XLA:CPU (an XLA FFI custom call), forward and backward.
//
// What it computes is vit_jax.models.attention.dot_product_attention's core,
//   O = softmax(scale * Q K^T) V,
// for every (image, head). Q, K and V come in one [B, N, 3, heads, Dh] array, the output of a
// fused QKV projection, and O goes out as [B, N, heads, Dh], so that the projections on either
// side are plain matrix products without transposes. The forward also returns the log-sum-exp
// of each row, lse = log(sum_j exp(scale * q_i . k_j)), [B, heads, N]; the backward returns
// dQKV in the layout of QKV.
//
// The backward is FlashAttention-2's (Dao, 2023, Algorithm 2) for one block holding the whole
// sequence: it recomputes P = exp(scale * Q K^T - lse) from the saved lse instead of keeping P,
// and with delta_i = dO_i . O_i,
//   dV = P^T dO,  dS = P * (dO V^T - delta) * scale,  dQ = dS K,  dK = dS^T Q.
// It works on the transposes S^T = K Q^T and dP^T = V dO^T, so that every product streams
// contiguous rows, and reads dS through strides for dQ instead of transposing it.
//
// Why it exists: XLA:CPU has no fused attention. It lowers the core to batched matrix products
// of 197 x 64 x 197 (ViT at 224 px) that ran at 45-70 GFLOP/s on a 2-core Zen 4, with the
// softmax as separate passes over memory and, under rematerialisation, a second forward. Here
// one (image, head) item runs start to finish in its worker's cache; the 6 x 32 register tile
// below reaches about 85% of a core's float32 FMA peak at these sizes (README "Benchmarks").
//
// Work is spread over the items with XLA's intra-op thread pool (the caller takes items too, so
// it never waits on a pool that is busy). Float32 only; Dh must be a multiple of 16. The hot
// functions are compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2) and the baseline, chosen
// when the library loads, so one build runs on any x86-64 CPU.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VIT_JAX_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VIT_JAX_CLONES
#endif
#define VIT_JAX_INLINE inline __attribute__((always_inline))

namespace {

// 16 float32 lanes (one AVX-512 register; two AVX2 registers; scalar code otherwise).
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));
constexpr int kLanes = 16;

VIT_JAX_INLINE v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
VIT_JAX_INLINE void store(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
VIT_JAX_INLINE v16 splat(float x) { return v16{} + x; }
VIT_JAX_INLINE int padded(int n) { return (n + kLanes - 1) / kLanes * kLanes; }

// exp(x) for the softmax's arguments (x <= 0 up to rounding, or -inf): 2^n * e^f with
// n = round(x / ln 2), f = x - n ln 2 (ln 2 split in two for exactness), e^f a degree-7
// polynomial (Cephes' expf coefficients); relative error about 1e-7. Exactly 0 below -87.
VIT_JAX_INLINE v16 vexp(v16 x) {
  auto underflow = x < splat(-87.f);
  x = underflow ? splat(-87.f) : x;
  v16 t = x * splat(1.44269504088896341f);
  v16 n = __builtin_convertvector(
      __builtin_convertvector(t + (t >= 0 ? splat(0.5f) : splat(-0.5f)), i16), v16);
  v16 f = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
  v16 p = splat(1.9875691500e-4f);
  p = p * f + splat(1.3981999507e-3f);
  p = p * f + splat(8.3334519073e-3f);
  p = p * f + splat(4.1665795894e-2f);
  p = p * f + splat(1.6666665459e-1f);
  p = p * f + splat(5.0000001201e-1f);
  p = p * f * f + f + splat(1.f);
  i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
  v16 two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return underflow ? v16{} : p * two_n;
}

// C[MR x 16 NV] = A[MR x K] B[K x 16 NV]: A(i, k) = A[i * sai + k * sak]; B and C row-major
// with leading dimensions ldb, ldc. MR * NV accumulators stay in registers over the K loop.
template <int MR, int NV>
VIT_JAX_INLINE void tile(int K, const float* A, int sai, int sak, const float* B, int ldb,
                         float* C, int ldc) {
  v16 acc[MR][NV] = {};
  for (int k = 0; k < K; ++k) {
    v16 b[NV];
    for (int j = 0; j < NV; ++j) b[j] = load(B + k * ldb + j * kLanes);
    for (int i = 0; i < MR; ++i) {
      v16 a = splat(A[i * sai + k * sak]);
      for (int j = 0; j < NV; ++j) acc[i][j] += a * b[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) store(C + i * ldc + j * kLanes, acc[i][j]);
}

template <int NV>
VIT_JAX_INLINE void tile_rows(int M, int K, const float* A, int sai, int sak, const float* B,
                              int ldb, float* C, int ldc) {
  int i = 0;
  for (; i + 6 <= M; i += 6) tile<6, NV>(K, A + i * sai, sai, sak, B, ldb, C + i * ldc, ldc);
  const float* a = A + i * sai;
  float* c = C + i * ldc;
  switch (M - i) {
    case 5: tile<5, NV>(K, a, sai, sak, B, ldb, c, ldc); break;
    case 4: tile<4, NV>(K, a, sai, sak, B, ldb, c, ldc); break;
    case 3: tile<3, NV>(K, a, sai, sak, B, ldb, c, ldc); break;
    case 2: tile<2, NV>(K, a, sai, sak, B, ldb, c, ldc); break;
    case 1: tile<1, NV>(K, a, sai, sak, B, ldb, c, ldc); break;
    default: break;
  }
}

// C[M x N] = A[M x K] B[K x N], N a multiple of 16; A read through strides (see tile).
VIT_JAX_INLINE void gemm(int M, int N, int K, const float* A, int sai, int sak, const float* B,
                         int ldb, float* C, int ldc) {
  int j = 0;
  for (; j + 32 <= N; j += 32) tile_rows<2>(M, K, A, sai, sak, B + j, ldb, C + j, ldc);
  for (; j < N; j += 16) tile_rows<1>(M, K, A, sai, sak, B + j, ldb, C + j, ldc);
}

// dst[d x ldd] = src[n x d]^T (src rows lds apart); columns n..ldd of dst set to 0. In blocks of
// 16 x 16, so that both sides touch whole cache lines.
VIT_JAX_INLINE void transpose(int n, int d, const float* src, int lds, float* dst, int ldd) {
  for (int r0 = 0; r0 < n; r0 += kLanes) {
    const int rows = std::min(kLanes, n - r0);
    for (int c0 = 0; c0 < d; c0 += kLanes) {
      const int cols = std::min(kLanes, d - c0);
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) dst[(c0 + c) * ldd + r0 + r] = src[(r0 + r) * lds + c0 + c];
    }
  }
  for (int c = 0; c < d; ++c)
    for (int r = n; r < ldd; ++r) dst[c * ldd + r] = 0.f;
}

// Shapes: qkv [B, N, 3, heads, Dh]; o [B, N, heads, Dh]; lse [B, heads, N]. An item is one
// (image, head); its q, k and v rows are ld_qkv floats apart, its o rows ld floats apart.
struct Shape {
  int64_t items;
  int n, heads, d, np, ld, ld_qkv;
  size_t qkv_offset(int64_t item) const {  // Of the item's token 0 in qkv (its q; k, v follow).
    return size_t(item / heads) * n * ld_qkv + size_t(item % heads) * d;
  }
  size_t offset(int64_t item) const {  // Of the item's token 0 in o.
    return size_t(item / heads) * n * ld + size_t(item % heads) * d;
  }
};

// Runs body(item) for item in [0, items) on the calling thread and the pool's other threads.
template <typename Body>
void parallel_for(ffi::ThreadPool& pool, int64_t items, Body body) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();  // Outlives this call for helpers that start late.
  auto work = [state, items, body]() {
    int64_t finished = 0;
    for (int64_t i; (i = state->next.fetch_add(1)) < items; ++finished) body(i);
    state->done.fetch_add(finished);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  while (state->done.load() < items) std::this_thread::yield();
}

// Scratch: S [n x np], K^T [d x np].
VIT_JAX_CLONES void forward_item(const Shape& s, const float* q, const float* k, const float* v,
                                 float* o, float* lse, float scale, float* scratch) {
  const int n = s.n, d = s.d, np = s.np, ld = s.ld_qkv, ldo = s.ld;
  float* S = scratch;
  float* KT = S + size_t(n) * np;
  transpose(n, d, k, ld, KT, np);
  gemm(n, np, d, q, ld, 1, KT, np, S, np);  // S = Q K^T (padding columns: 0).
  for (int i = 0; i < n; ++i) {
    float* row = S + size_t(i) * np;
    for (int j = n; j < np; ++j) row[j] = -INFINITY;
    v16 max = splat(-INFINITY);
    for (int j = 0; j < np; j += kLanes) {
      v16 x = load(row + j) * scale;
      max = max > x ? max : x;
    }
    float m = max[0];
    for (int t = 1; t < kLanes; ++t) m = std::max(m, max[t]);
    v16 sum = {};
    for (int j = 0; j < np; j += kLanes) {
      v16 e = vexp(load(row + j) * scale - m);
      store(row + j, e);
      sum += e;
    }
    float l = 0.f;
    for (int t = 0; t < kLanes; ++t) l += sum[t];
    const v16 inv = splat(1.f / l);
    for (int j = 0; j < np; j += kLanes) store(row + j, load(row + j) * inv);
    lse[i] = m + std::log(l);
  }
  gemm(n, d, n, S, np, 1, v, ld, o, ldo);  // O = P V.
}

// Scratch: P^T [n x np], dP^T then dS^T [n x np], Q^T and dO^T [d x np], lse and delta [np].
VIT_JAX_CLONES void backward_item(const Shape& s, const float* q, const float* k, const float* v,
                                  const float* o, const float* lse, const float* dout,
                                  float* dq, float* dk, float* dv, float scale,
                                  float* scratch) {
  const int n = s.n, d = s.d, np = s.np, ld = s.ld_qkv, ldo = s.ld;
  float* PT = scratch;
  float* dST = PT + size_t(n) * np;
  float* QT = dST + size_t(n) * np;
  float* dOT = QT + size_t(d) * np;
  float* lse_row = dOT + size_t(d) * np;
  float* delta = lse_row + np;
  for (int i = 0; i < np; ++i) {
    lse_row[i] = i < n ? lse[i] : INFINITY;  // Padding columns of P^T come out 0.
    float dot = 0.f;
    for (int c = 0; i < n && c < d; ++c) dot += dout[i * ldo + c] * o[i * ldo + c];
    delta[i] = dot;
  }
  transpose(n, d, q, ld, QT, np);
  transpose(n, d, dout, ldo, dOT, np);
  gemm(n, np, d, k, ld, 1, QT, np, PT, np);      // S^T = K Q^T
  gemm(n, np, d, v, ld, 1, dOT, np, dST, np);    // dP^T = V dO^T
  for (int j = 0; j < n; ++j) {
    float* p = PT + size_t(j) * np;
    float* ds = dST + size_t(j) * np;
    for (int i = 0; i < np; i += kLanes) {
      const v16 pv = vexp(load(p + i) * scale - load(lse_row + i));
      store(p + i, pv);
      store(ds + i, pv * (load(ds + i) - load(delta + i)) * scale);
    }
  }
  gemm(n, d, n, PT, np, 1, dout, ldo, dv, ld);  // dV = P^T dO
  gemm(n, d, n, dST, np, 1, q, ld, dk, ld);     // dK = dS^T Q
  gemm(n, d, n, dST, 1, np, k, ld, dq, ld);     // dQ = dS K (dS read through strides)
}

ffi::ErrorOr<Shape> shape_of(const ffi::Buffer<ffi::F32>& qkv) {
  auto dims = qkv.dimensions();
  if (dims.size() != 5 || dims[2] != 3) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "vit_jax fused attention: qkv must be [B, N, 3, heads, Dh]"));
  }
  Shape s;
  s.n = int(dims[1]);
  s.heads = int(dims[3]);
  s.d = int(dims[4]);
  s.items = dims[0] * dims[3];
  s.np = padded(s.n);
  s.ld = s.heads * s.d;
  s.ld_qkv = 3 * s.ld;
  if (s.d % kLanes != 0) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "vit_jax fused attention: the head size Dh must be a multiple of 16"));
  }
  return s;
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                   ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> lse, float scale) {
  auto shape = shape_of(qkv);
  if (shape.has_error()) return shape.error();
  const Shape s = shape.value();
  const float* QKV = qkv.typed_data();
  float *O = o->typed_data(), *L = lse->typed_data();
  parallel_for(pool, s.items, [=](int64_t item) {
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(s.n + s.d) * s.np);
    const float* q = QKV + s.qkv_offset(item);
    forward_item(s, q, q + s.ld, q + 2 * s.ld, O + s.offset(item), L + item * s.n, scale,
                 scratch.data());
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> o,
                    ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                    ffi::ResultBuffer<ffi::F32> dqkv, float scale) {
  auto shape = shape_of(qkv);
  if (shape.has_error()) return shape.error();
  const Shape s = shape.value();
  const float *QKV = qkv.typed_data(), *O = o.typed_data(), *L = lse.typed_data();
  const float* G = dout.typed_data();
  float* DQKV = dqkv->typed_data();
  parallel_for(pool, s.items, [=](int64_t item) {
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(2 * s.n + 2 * s.d + 2) * s.np);
    const size_t at = s.qkv_offset(item), at_o = s.offset(item);
    const float* q = QKV + at;
    float* dq = DQKV + at;
    backward_item(s, q, q + s.ld, q + 2 * s.ld, O + at_o, L + item * s.n, G + at_o, dq,
                  dq + s.ld, dq + 2 * s.ld, scale, scratch.data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitJaxAttentionForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitJaxAttentionBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv
                                  .Arg<ffi::Buffer<ffi::F32>>()  // o
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()  // do
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dqkv
                                  .Attr<float>("scale"));
