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
// of 197 x 64 x 197 (ViT at 224 px) with the softmax as separate passes over memory and, under
// rematerialisation, a second forward. Here one (image, head) item runs start to finish in its
// worker's cache, its products in a register tile (docs/kernels.md).
//
// Instruction sets. The hot code is a template over a Config: the float vector (its lanes) and
// the register tile of the products, MR rows x NV vectors of accumulators. It is compiled three
// times, once per x86-64 level, each with a tile that fits that level's vector registers:
//   avx512    x86-64-v4, 16 lanes, 6 x 32 tile: 12 of the 32 zmm registers accumulate;
//   avx2      x86-64-v3, 8 lanes, 6 x 16 tile: 12 of the 16 ymm registers accumulate;
//   baseline  x86-64 (SSE2), 4 lanes, 4 x 8 tile: 8 of the 16 xmm registers (no FMA: a
//             product and a sum, so registers for temporaries are left free).
// The first call picks one with the tests that GCC's target_clones resolver makes for clones
// "arch=x86-64-v4", "arch=x86-64-v3", "default" (__builtin_cpu_supports("x86-64-v4"), then
// "x86-64-v3"); VitJaxAttentionIsa() names it. Defining VIT_JAX_ISA to 0 (baseline), 1 (avx2)
// or 2 (avx512) at compile time builds that one variant alone, for measurements
// (benchmarks/measure_attention.py); such a build runs only on a CPU that has the instruction set.
// Other compilers and architectures get the baseline variant (generic 4-lane vectors).
//
// Work is spread over the items with XLA's intra-op thread pool (the caller takes items too, so
// it never waits on a pool that is busy). Float32 only; Dh must be a multiple of 16.

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

#define VIT_JAX_INLINE inline __attribute__((always_inline))

namespace vit_jax_cpu_attention {

// Padding of a row of S (and of the transposes) to whole vectors of every variant.
constexpr int kPad = 16;
VIT_JAX_INLINE int padded(int n) { return (n + kPad - 1) / kPad * kPad; }

// W float32 lanes: one register of the variant's instruction set.
template <int W> struct Lanes;
template <> struct Lanes<4> {
  typedef float f __attribute__((vector_size(16)));
  typedef float fu __attribute__((vector_size(16), aligned(4)));
  typedef int32_t i __attribute__((vector_size(16)));
};
template <> struct Lanes<8> {
  typedef float f __attribute__((vector_size(32)));
  typedef float fu __attribute__((vector_size(32), aligned(4)));
  typedef int32_t i __attribute__((vector_size(32)));
};
template <> struct Lanes<16> {
  typedef float f __attribute__((vector_size(64)));
  typedef float fu __attribute__((vector_size(64), aligned(4)));
  typedef int32_t i __attribute__((vector_size(64)));
};

// A variant: W lanes per vector, products in tiles of MR rows x NV vectors.
template <int W_, int MR_, int NV_>
struct Config {
  static constexpr int W = W_, MR = MR_, NV = NV_;
  typedef typename Lanes<W>::f V;
  typedef typename Lanes<W>::fu VU;
  typedef typename Lanes<W>::i I;
  static_assert(kPad % W == 0, "rows are padded to whole vectors");
};
typedef Config<16, 6, 2> Avx512;
typedef Config<8, 6, 2> Avx2;
typedef Config<4, 4, 2> Baseline;

template <class C>
VIT_JAX_INLINE typename C::V load(const float* p) {
  return *reinterpret_cast<const typename C::VU*>(p);
}
template <class C>
VIT_JAX_INLINE void store(float* p, typename C::V x) {
  *reinterpret_cast<typename C::VU*>(p) = x;
}
template <class C>
VIT_JAX_INLINE typename C::V splat(float x) {
  return typename C::V{} + x;
}

// {*p, ..., *p}. For 8 lanes (AVX2), broadcast straight from memory by vbroadcastss: GCC
// otherwise loads into a register first, and the 6 x 16 tile's 12 accumulators, 2 B vectors
// and that register no longer fit in the 16 ymm registers (an accumulator spills; measured:
// the products ran at about half the speed). The other variants keep GCC's code.
template <class C>
VIT_JAX_INLINE typename C::V splat_load(const float* p) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (C::W == 8) {
    typename C::V v;
    asm("vbroadcastss %1, %0" : "=v"(v) : "m"(*p));
    return v;
  }
#endif
  return splat<C>(*p);
}

// exp(x) for the softmax's arguments (x <= 0 up to rounding, or -inf): 2^n * e^f with
// n = round(x / ln 2), f = x - n ln 2 (ln 2 split in two for exactness), e^f a degree-7
// polynomial (Cephes' expf coefficients); relative error about 1e-7. Exactly 0 below -87.
template <class C>
VIT_JAX_INLINE typename C::V vexp(typename C::V x) {
  typedef typename C::V V;
  typedef typename C::I I;
  auto underflow = x < splat<C>(-87.f);
  x = underflow ? splat<C>(-87.f) : x;
  V t = x * splat<C>(1.44269504088896341f);
  I ni = __builtin_convertvector(t + (t >= 0 ? splat<C>(0.5f) : splat<C>(-0.5f)), I);
  V n = __builtin_convertvector(ni, V);
  V f = x - n * splat<C>(0.693359375f) + n * splat<C>(2.12194440e-4f);
  V p = splat<C>(1.9875691500e-4f);
  p = p * f + splat<C>(1.3981999507e-3f);
  p = p * f + splat<C>(8.3334519073e-3f);
  p = p * f + splat<C>(4.1665795894e-2f);
  p = p * f + splat<C>(1.6666665459e-1f);
  p = p * f + splat<C>(5.0000001201e-1f);
  p = p * f * f + f + splat<C>(1.f);
  I bits = (ni + 127) << 23;
  V two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return underflow ? V{} : p * two_n;
}

// C[M x NV W] = A[M x K] B[K x NV W] for M <= MR: A(i, k) = A[i * sai + k * sak]; B and C
// row-major with leading dimensions ldb, ldc. M * NV accumulators stay in registers.
template <class C, int M, int NV>
VIT_JAX_INLINE void tile(int K, const float* A, int sai, int sak, const float* B, int ldb,
                         float* Cm, int ldc) {
  typedef typename C::V V;
  V acc[M][NV] = {};
  for (int k = 0; k < K; ++k) {
    V b[NV];
    for (int j = 0; j < NV; ++j) b[j] = load<C>(B + k * ldb + j * C::W);
    for (int i = 0; i < M; ++i) {
      const V a = splat_load<C>(A + i * sai + k * sak);
      for (int j = 0; j < NV; ++j) acc[i][j] += a * b[j];
    }
  }
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NV; ++j) store<C>(Cm + i * ldc + j * C::W, acc[i][j]);
}

// The rows left over after whole tiles of MR: M - i of them, 0 < M - i < MR.
template <class C, int NV, int R>
VIT_JAX_INLINE void tail_rows(int rows, int K, const float* A, int sai, int sak, const float* B,
                              int ldb, float* Cm, int ldc) {
  if constexpr (R > 0) {
    if (rows == R) return tile<C, R, NV>(K, A, sai, sak, B, ldb, Cm, ldc);
    tail_rows<C, NV, R - 1>(rows, K, A, sai, sak, B, ldb, Cm, ldc);
  }
}

template <class C, int NV>
VIT_JAX_INLINE void tile_rows(int M, int K, const float* A, int sai, int sak, const float* B,
                              int ldb, float* Cm, int ldc) {
  int i = 0;
  for (; i + C::MR <= M; i += C::MR)
    tile<C, C::MR, NV>(K, A + i * sai, sai, sak, B, ldb, Cm + i * ldc, ldc);
  tail_rows<C, NV, C::MR - 1>(M - i, K, A + i * sai, sai, sak, B, ldb, Cm + i * ldc, ldc);
}

// C[M x N] = A[M x K] B[K x N], N a multiple of W; A read through strides (see tile).
template <class C>
VIT_JAX_INLINE void gemm(int M, int N, int K, const float* A, int sai, int sak, const float* B,
                         int ldb, float* Cm, int ldc) {
  constexpr int wide = C::NV * C::W;
  int j = 0;
  for (; j + wide <= N; j += wide) tile_rows<C, C::NV>(M, K, A, sai, sak, B + j, ldb, Cm + j, ldc);
  for (; j < N; j += C::W) tile_rows<C, 1>(M, K, A, sai, sak, B + j, ldb, Cm + j, ldc);
}

// dst[d x ldd] = src[n x d]^T (src rows lds apart); columns n..ldd of dst set to 0. In blocks of
// 16 x 16, so that both sides touch whole cache lines.
VIT_JAX_INLINE void transpose(int n, int d, const float* src, int lds, float* dst, int ldd) {
  for (int r0 = 0; r0 < n; r0 += kPad) {
    const int rows = std::min(kPad, n - r0);
    for (int c0 = 0; c0 < d; c0 += kPad) {
      const int cols = std::min(kPad, d - c0);
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

// Scratch: S [n x np], K^T [d x np].
template <class C>
VIT_JAX_INLINE void forward_item(const Shape& s, const float* q, const float* k, const float* v,
                                 float* o, float* lse, float scale, float* scratch) {
  typedef typename C::V V;
  constexpr int W = C::W;
  const int n = s.n, d = s.d, np = s.np, ld = s.ld_qkv, ldo = s.ld;
  float* S = scratch;
  float* KT = S + size_t(n) * np;
  transpose(n, d, k, ld, KT, np);
  gemm<C>(n, np, d, q, ld, 1, KT, np, S, np);  // S = Q K^T (padding columns: 0).
  for (int i = 0; i < n; ++i) {
    float* row = S + size_t(i) * np;
    for (int j = n; j < np; ++j) row[j] = -INFINITY;
    V max = splat<C>(-INFINITY);
    for (int j = 0; j < np; j += W) {
      V x = load<C>(row + j) * scale;
      max = max > x ? max : x;
    }
    float m = max[0];
    for (int t = 1; t < W; ++t) m = std::max(m, max[t]);
    V sum = {};
    for (int j = 0; j < np; j += W) {
      V e = vexp<C>(load<C>(row + j) * scale - m);
      store<C>(row + j, e);
      sum += e;
    }
    float l = 0.f;
    for (int t = 0; t < W; ++t) l += sum[t];
    const V inv = splat<C>(1.f / l);
    for (int j = 0; j < np; j += W) store<C>(row + j, load<C>(row + j) * inv);
    lse[i] = m + std::log(l);
  }
  gemm<C>(n, d, n, S, np, 1, v, ld, o, ldo);  // O = P V.
}

// Scratch: P^T [n x np], dP^T then dS^T [n x np], Q^T and dO^T [d x np], lse and delta [np].
template <class C>
VIT_JAX_INLINE void backward_item(const Shape& s, const float* q, const float* k, const float* v,
                                  const float* o, const float* lse, const float* dout,
                                  float* dq, float* dk, float* dv, float scale,
                                  float* scratch) {
  typedef typename C::V V;
  constexpr int W = C::W;
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
  gemm<C>(n, np, d, k, ld, 1, QT, np, PT, np);      // S^T = K Q^T
  gemm<C>(n, np, d, v, ld, 1, dOT, np, dST, np);    // dP^T = V dO^T
  const V scale_v = splat<C>(scale);
  for (int j = 0; j < n; ++j) {
    float* p = PT + size_t(j) * np;
    float* ds = dST + size_t(j) * np;
    for (int i = 0; i < np; i += W) {
      const V pv = vexp<C>(load<C>(p + i) * scale_v - load<C>(lse_row + i));
      store<C>(p + i, pv);
      store<C>(ds + i, pv * (load<C>(ds + i) - load<C>(delta + i)) * scale_v);
    }
  }
  gemm<C>(n, d, n, PT, np, 1, dout, ldo, dv, ld);  // dV = P^T dO
  gemm<C>(n, d, n, dST, np, 1, q, ld, dk, ld);     // dK = dS^T Q
  gemm<C>(n, d, n, dST, 1, np, k, ld, dq, ld);     // dQ = dS K (dS read through strides)
}

namespace {

// One variant per instruction set: forward_item and backward_item with the whole template
// inlined (flatten), so that every vector operation is compiled for the variant's target.
typedef void (*ForwardItem)(const Shape&, const float*, const float*, const float*, float*,
                            float*, float, float*);
typedef void (*BackwardItem)(const Shape&, const float*, const float*, const float*,
                             const float*, const float*, const float*, float*, float*, float*,
                             float, float*);
struct Variant {
  const char* isa;
  ForwardItem forward;
  BackwardItem backward;
};

#define VIT_JAX_VARIANT(NAME, ATTRIBUTES, CONFIG)                                               \
  ATTRIBUTES __attribute__((flatten)) void forward_##NAME(                                     \
      const Shape& s, const float* q, const float* k, const float* v, float* o, float* lse,    \
      float scale, float* scratch) {                                                           \
    forward_item<CONFIG>(s, q, k, v, o, lse, scale, scratch);                                  \
  }                                                                                            \
  ATTRIBUTES __attribute__((flatten)) void backward_##NAME(                                    \
      const Shape& s, const float* q, const float* k, const float* v, const float* o,          \
      const float* lse, const float* dout, float* dq, float* dk, float* dv, float scale,       \
      float* scratch) {                                                                        \
    backward_item<CONFIG>(s, q, k, v, o, lse, dout, dq, dk, dv, scale, scratch);               \
  }                                                                                            \
  constexpr Variant k_##NAME = {#NAME, forward_##NAME, backward_##NAME};

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VIT_JAX_X86_LEVELS
#endif

#if !defined(VIT_JAX_ISA) || VIT_JAX_ISA == 0
VIT_JAX_VARIANT(baseline, , Baseline)
#endif
#if defined(VIT_JAX_X86_LEVELS) && (!defined(VIT_JAX_ISA) || VIT_JAX_ISA == 1)
VIT_JAX_VARIANT(avx2, __attribute__((target("arch=x86-64-v3"))), Avx2)
#endif
#if defined(VIT_JAX_X86_LEVELS) && (!defined(VIT_JAX_ISA) || VIT_JAX_ISA == 2)
VIT_JAX_VARIANT(avx512, __attribute__((target("arch=x86-64-v4"))), Avx512)
#endif

// The variant for this CPU, chosen once, by the tests that GCC's target_clones resolver makes
// for clones "arch=x86-64-v4", "arch=x86-64-v3", "default". A build with VIT_JAX_ISA defined
// holds only that variant and takes it on any CPU.
const Variant& variant() {
#if !defined(VIT_JAX_ISA)
#if defined(VIT_JAX_X86_LEVELS)
  static const Variant chosen = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return k_avx512;
    if (__builtin_cpu_supports("x86-64-v3")) return k_avx2;
    return k_baseline;
  }();
  return chosen;
#else
  return k_baseline;
#endif
#elif VIT_JAX_ISA == 0
  return k_baseline;
#elif VIT_JAX_ISA == 1 && defined(VIT_JAX_X86_LEVELS)
  return k_avx2;
#elif VIT_JAX_ISA == 2 && defined(VIT_JAX_X86_LEVELS)
  return k_avx512;
#else
#error "VIT_JAX_ISA must be 0 (baseline), 1 (avx2) or 2 (avx512), the last two with GCC on x86-64"
#endif
}


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
  if (s.d % kPad != 0) {
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
  const ForwardItem forward = variant().forward;
  parallel_for(pool, s.items, [=](int64_t item) {
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(s.n + s.d) * s.np);
    const float* q = QKV + s.qkv_offset(item);
    forward(s, q, q + s.ld, q + 2 * s.ld, O + s.offset(item), L + item * s.n, scale,
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
  const BackwardItem backward = variant().backward;
  parallel_for(pool, s.items, [=](int64_t item) {
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(2 * s.n + 2 * s.d + 2) * s.np);
    const size_t at = s.qkv_offset(item), at_o = s.offset(item);
    const float* q = QKV + at;
    float* dq = DQKV + at;
    backward(s, q, q + s.ld, q + 2 * s.ld, O + at_o, L + item * s.n, G + at_o, dq, dq + s.ld,
             dq + 2 * s.ld, scale, scratch.data());
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace vit_jax_cpu_attention

// The variant that runs on this CPU: "avx512", "avx2" or "baseline" (a static string).
extern "C" __attribute__((visibility("default"))) const char* VitJaxAttentionIsa() {
  return vit_jax_cpu_attention::variant().isa;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitJaxAttentionForward, vit_jax_cpu_attention::Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitJaxAttentionBackward, vit_jax_cpu_attention::Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv
                                  .Arg<ffi::Buffer<ffi::F32>>()  // o
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()  // do
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dqkv
                                  .Attr<float>("scale"));
