// TACO's quantizer as CUDA kernels: one warp per group of G elements, G/32 contiguous elements per
// lane, the fast Walsh-Hadamard transform as in-register butterflies then warp shuffles.
//
// Bit for bit `commweave.taco.quant` (the torch reference), like the Triton kernels: every
// division and square root is IEEE round-to-nearest (__fdiv_rn, __fsqrt_rn), every add and
// multiply is an explicit __fadd_rn / __fmul_rn (never contracted into an FMA), sums are pairwise in
// the reference's order (first half + second half: lanes 16, 8, .., 1 apart, then registers),
// butterfly stage h pairs element i with i + h in the reference's order h = 1, 2, 4, .., and the
// FP8 / 16-bit casts round to nearest even after the reference's clamps.
//
// Specialised by the host (`taco/cuda.py`) with these macros, one cubin per combination:
//   TACO_G         group size (32..512, a power of two)
//   TACO_FMT       0: E4M3, 1: E5M2
//   TACO_HADAMARD  0: off, 1: on, 2: adaptive (per group the lower L2 error; flag: negative scale)
//   TACO_DUAL      1: RMS pre-scale stored after the post-scales
//   TACO_CAST      transform input rounded to 0: FP32 (no-op), 1: FP16, 2: BF16
//   TACO_IN        compress input  0: FP32, 1: FP16, 2: BF16
//   TACO_OUT       decompress output 0: FP32, 1: FP16, 2: BF16
//   TACO_NSRC      sources the summing decompress adds (1..8)
//   TACO_MIN_BLOCKS  blocks of 256 threads per SM the register budget must allow
//
// Packed layout of one message (`quant.pack`): FP8 payload [groups * G] bytes, FP32 post-scales
// [groups], FP32 pre-scales [groups] when TACO_DUAL. A work item is a run of U consecutive groups
// of one message: lane j loads/stores group j's scales (one coalesced access for the run).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

#define G TACO_G
constexpr int E = G / 32;                    // elements per lane
constexpr int U = (1024 / G) < 8 ? (1024 / G) : 8;  // groups per work item: 8 (one 32-byte sector of scales), at most 32 elements a lane
constexpr unsigned FULL = 0xffffffffu;
constexpr float SQRT_HALF = 0.7071067811865476f;
constexpr float TINY = 1.17549435e-38f;      // FP32's smallest normal
#if TACO_FMT == 0
constexpr float FP8_MAX = 448.0f;
constexpr __nv_fp8_interpretation_t FP8_KIND = __NV_E4M3;
#else
constexpr float FP8_MAX = 57344.0f;
constexpr __nv_fp8_interpretation_t FP8_KIND = __NV_E5M2;
#endif

template <int CODE> struct Storage;
template <> struct Storage<0> { using T = float; };
template <> struct Storage<1> { using T = __half; };
template <> struct Storage<2> { using T = __nv_bfloat16; };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <int CODE> __device__ __forceinline__ typename Storage<CODE>::T from_float(float v);
template <> __device__ __forceinline__ float from_float<0>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<1>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<2>(float v) { return __float2bfloat16_rn(v); }

template <int N, typename T> struct alignas(N * sizeof(T)) Vec { T v[N]; };

// E contiguous elements of lane `lane` of a group at `base` (element index `first` of a message of
// `numel` elements): a vector access when the whole group is in range and `vec` says aligned.
template <typename T>
__device__ __forceinline__ void load_lane(const T* base, long long first, long long numel, bool vec, float (&v)[E]) {
  if (vec && first + E <= numel) {
    constexpr int N = (E * sizeof(T) <= 16) ? E : 16 / sizeof(T);
#pragma unroll
    for (int k = 0; k < E; k += N) {
      Vec<N, T> w = *reinterpret_cast<const Vec<N, T>*>(base + k);
#pragma unroll
      for (int r = 0; r < N; ++r) v[k + r] = to_float(w.v[r]);
    }
  } else {
#pragma unroll
    for (int r = 0; r < E; ++r) v[r] = first + r < numel ? to_float(base[r]) : 0.0f;
  }
}

template <int CODE>
__device__ __forceinline__ void store_lane(typename Storage<CODE>::T* base, long long first, long long numel, bool vec,
                                           const float (&v)[E]) {
  using T = typename Storage<CODE>::T;
  if (vec && first + E <= numel) {
    constexpr int N = (E * sizeof(T) <= 16) ? E : 16 / sizeof(T);
#pragma unroll
    for (int k = 0; k < E; k += N) {
      Vec<N, T> w;
#pragma unroll
      for (int r = 0; r < N; ++r) w.v[r] = from_float<CODE>(v[k + r]);
      *reinterpret_cast<Vec<N, T>*>(base + k) = w;
    }
  } else {
#pragma unroll
    for (int r = 0; r < E; ++r)
      if (first + r < numel) base[r] = from_float<CODE>(v[r]);
  }
}

// Payload bytes of one lane, kept packed in 32-bit words (byte r in word r / 4): E bytes at a
// 4-byte-aligned offset when E >= 4, else 1 or 2 bytes.
constexpr int WORDS = E >= 4 ? E / 4 : 1;

__device__ __forceinline__ uint8_t payload_byte(const uint32_t (&w)[WORDS], int r) { return (w[r / 4] >> (8 * (r % 4))) & 0xff; }

__device__ __forceinline__ void load_payload(const uint8_t* p, uint32_t (&w)[WORDS]) {
  if constexpr (E >= 4) {
#pragma unroll
    for (int k = 0; k < WORDS; ++k) w[k] = *reinterpret_cast<const uint32_t*>(p + 4 * k);
  } else if constexpr (E == 2) {
    w[0] = *reinterpret_cast<const uint16_t*>(p);
  } else {
    w[0] = *p;
  }
}

__device__ __forceinline__ void store_payload(uint8_t* p, const uint8_t (&q)[E]) {
  if constexpr (E >= 4) {
#pragma unroll
    for (int k = 0; k < E; k += 4)
      *reinterpret_cast<uint32_t*>(p + k) = q[k] | (q[k + 1] << 8) | (q[k + 2] << 16) | ((uint32_t)q[k + 3] << 24);
  } else if constexpr (E == 2) {
    *reinterpret_cast<uint16_t*>(p) = q[0] | (q[1] << 8);
  } else {
    *p = q[0];
  }
}

// -- per-group math (the reference's order) ---------------------------------------------------------

__device__ __forceinline__ float warp_absmax(const float (&v)[E]) {
  float m = 0.0f;
#pragma unroll
  for (int r = 0; r < E; ++r) m = fmaxf(m, fabsf(v[r]));
#pragma unroll
  for (int k = 16; k >= 1; k >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, k));
  return m;
}

// quant._pairwise_sum of the group: element i + element i + half, half = G/2, G/4, .., 1.
__device__ __forceinline__ float warp_pairwise_sum(float (&s)[E]) {
#pragma unroll
  for (int k = 16; k >= 1; k >>= 1)
#pragma unroll
    for (int r = 0; r < E; ++r) s[r] = __fadd_rn(s[r], __shfl_xor_sync(FULL, s[r], k));
#pragma unroll
  for (int half = E / 2; half >= 1; half >>= 1)
#pragma unroll
    for (int r = 0; r < half; ++r) s[r] = __fadd_rn(s[r], s[r + half]);
  return s[0];
}

// quant.fwht: stage h pairs i and i + h, h = 1, 2, ..; (a + b) * c and (a - b) * c, c = sqrt(1/2).
__device__ __forceinline__ void warp_fwht(float (&v)[E], int lane) {
#pragma unroll
  for (int h = 1; h < E; h <<= 1)
#pragma unroll
    for (int r = 0; r < E; ++r)
      if (!(r & h)) {
        const float a = v[r], b = v[r + h];
        v[r] = __fmul_rn(__fadd_rn(a, b), SQRT_HALF);
        v[r + h] = __fmul_rn(__fsub_rn(a, b), SQRT_HALF);
      }
#pragma unroll
  for (int k = 1; k < 32; k <<= 1) {  // stage h = k * E: lanes k apart
    const bool upper = lane & k;
#pragma unroll
    for (int r = 0; r < E; ++r) {
      const float other = __shfl_xor_sync(FULL, v[r], k);
      v[r] = upper ? __fmul_rn(__fsub_rn(other, v[r]), SQRT_HALF) : __fmul_rn(__fadd_rn(v[r], other), SQRT_HALF);
    }
  }
}

// quant._rms: absmax-normalised sum of squares, correctly rounded sqrt; 0 -> absmax -> 1.
__device__ __forceinline__ float group_rms(const float (&v)[E]) {
  const float absmax = warp_absmax(v);
  const float safe = absmax > 0.0f ? absmax : 1.0f;
  float s[E];
#pragma unroll
  for (int r = 0; r < E; ++r) {
    const float t = __fdiv_rn(v[r], safe);
    s[r] = __fmul_rn(t, t);
  }
  const float rms = __fmul_rn(safe, __fsqrt_rn(__fdiv_rn(warp_pairwise_sum(s), (float)G)));
  return rms > 0.0f ? rms : safe;
}

// quant._quantize: absmax scale to the FP8 maximum (zero group: 1; floor: the smallest normal);
// payload = clamp(y / scale) rounded to nearest even (q: the FP8 values, as FP32, for adaptive).
__device__ __forceinline__ float group_quantize(const float (&y)[E], uint8_t (&q)[E], float (&qf)[E]) {
  const float absmax = warp_absmax(y);
  const float scale = absmax > 0.0f ? fmaxf(__fdiv_rn(absmax, FP8_MAX), TINY) : 1.0f;
#pragma unroll
  for (int r = 0; r < E; ++r) {
    const float c = fminf(fmaxf(__fdiv_rn(y[r], scale), -FP8_MAX), FP8_MAX);
    q[r] = __nv_cvt_float_to_fp8(c, __NV_SATFINITE, FP8_KIND);
    qf[r] = __half2float(__half(__nv_cvt_fp8_to_halfraw(q[r], FP8_KIND)));
  }
  return scale;
}

__device__ __forceinline__ float cast_transform_input(float v) {
#if TACO_CAST == 1
  return __half2float(__float2half_rn(fminf(fmaxf(v, -65504.0f), 65504.0f)));
#elif TACO_CAST == 2
  return __bfloat162float(__float2bfloat16_rn(fminf(fmaxf(v, -3.38953139e38f), 3.38953139e38f)));
#else
  return v;
#endif
}

// One group: v (the input, FP32) -> payload bytes q, post-scale, pre-scale.
__device__ __forceinline__ void compress_group(float (&v)[E], int lane, uint8_t (&q)[E], float& scale, float& pre) {
  pre = 1.0f;
#if TACO_DUAL
  pre = group_rms(v);
#pragma unroll
  for (int r = 0; r < E; ++r) v[r] = __fdiv_rn(v[r], pre);
#endif
  float qf[E];
#if TACO_HADAMARD == 0
  scale = group_quantize(v, q, qf);
#else
  float y[E];
#pragma unroll
  for (int r = 0; r < E; ++r) y[r] = cast_transform_input(v[r]);
  warp_fwht(y, lane);
  scale = group_quantize(y, q, qf);
#if TACO_HADAMARD == 2
  uint8_t qp[E];
  float qpf[E];
  const float sp = group_quantize(v, qp, qpf);
  float dt[E], dp[E];
#pragma unroll
  for (int r = 0; r < E; ++r) dt[r] = __fmul_rn(qf[r], scale);
  warp_fwht(dt, lane);
#pragma unroll
  for (int r = 0; r < E; ++r) {
    const float a = __fsub_rn(dt[r], v[r]), b = __fsub_rn(__fmul_rn(qpf[r], sp), v[r]);
    dt[r] = __fmul_rn(a, a);
    dp[r] = __fmul_rn(b, b);
  }
  const bool use_t = warp_pairwise_sum(dt) < warp_pairwise_sum(dp);
  if (!use_t) {
#pragma unroll
    for (int r = 0; r < E; ++r) q[r] = qp[r];
  }
  scale = use_t ? -scale : sp;
#endif
#endif
}

// One group back to FP32 (quant.decompress before its final cast).
__device__ __forceinline__ void decompress_group(const uint32_t (&q)[WORDS], float scale, float pre, int lane, float (&v)[E]) {
#pragma unroll
  for (int r = 0; r < E; ++r)
    v[r] = __fmul_rn(__half2float(__half(__nv_cvt_fp8_to_halfraw(payload_byte(q, r), FP8_KIND))),
                     TACO_HADAMARD == 2 ? fabsf(scale) : scale);
#if TACO_HADAMARD == 1
  warp_fwht(v, lane);
#elif TACO_HADAMARD == 2
  if (scale < 0.0f) warp_fwht(v, lane);
#endif
#if TACO_DUAL
#pragma unroll
  for (int r = 0; r < E; ++r) v[r] = __fmul_rn(v[r], pre);
#endif
}

// -- kernels -------------------------------------------------------------------------------------

struct Sources {
  unsigned long long ptr[8];  // packed messages (payload, post-scales[, pre-scales]), any rank's window
};

// Compress `segments` messages of `numel` elements each, message s at x + s * x_stride, into packed
// message s at buf + s * buf_stride. vec: x and x_stride allow vector loads.
extern "C" __global__ void __launch_bounds__(256, TACO_MIN_BLOCKS) taco_compress(const void* x_, long long numel, long long x_stride,
                                                                int segments, uint8_t* buf, long long buf_stride, int vec) {
  using T = typename Storage<TACO_IN>::T;
  const T* x = static_cast<const T*>(x_);
  const int lane = threadIdx.x & 31;
  const long long groups = (numel + G - 1) / G;
  const long long runs = (groups + U - 1) / U;
  const long long items = runs * segments;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  for (long long item = blockIdx.x * (long long)(blockDim.x / 32) + threadIdx.x / 32; item < items; item += warps) {
    const long long seg = item / runs, g0 = (item % runs) * U;
    const T* xs = x + seg * x_stride;
    uint8_t* payload = buf + seg * buf_stride;
    float* scales = reinterpret_cast<float*>(payload + groups * G);
    float v[U][E];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long first = (g0 + u) * G + lane * E;
      if (g0 + u < groups) load_lane(xs + first, first, numel, vec, v[u]);
    }
    float my_scale = 0.0f;
    [[maybe_unused]] float my_pre = 0.0f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (g0 + u >= groups) break;  // uniform over the warp
      uint8_t q[E];
      float scale, pre;
      compress_group(v[u], lane, q, scale, pre);
      store_payload(payload + (g0 + u) * G + lane * E, q);
      if (lane == u) { my_scale = scale; my_pre = pre; }
    }
    if (lane < U && g0 + lane < groups) {
      scales[g0 + lane] = my_scale;
#if TACO_DUAL
      scales[groups + g0 + lane] = my_pre;
#endif
    }
  }
}

// Decompress packed messages of `numel` elements each. SUM == false (gather): message p to
// out + p * out_stride for p < n_src, warps interleaving the messages (consecutive warps read
// different ranks: every link busy at once). SUM == true: out = the FP32 sum of the TACO_NSRC
// messages' decompressions in source order (the first not added to zero, as the reference's), cast
// once. vec: out and out_stride allow vector stores.
template <bool SUM>
__device__ __forceinline__ void decompress_items(const Sources& src, int n_src, long long numel, void* out_,
                                                 long long out_stride, int vec) {
  using T = typename Storage<TACO_OUT>::T;
  T* out = static_cast<T*>(out_);
  const int lane = threadIdx.x & 31;
  const long long groups = (numel + G - 1) / G;
  const long long runs = (groups + U - 1) / U;
  const long long items = SUM ? runs : runs * n_src;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  for (long long item = blockIdx.x * (long long)(blockDim.x / 32) + threadIdx.x / 32; item < items; item += warps) {
    const int p0 = SUM ? 0 : (int)(item % n_src);
    const long long g0 = (SUM ? item : item / n_src) * U;
    float acc[U][E];
#pragma unroll 1
    for (int i = 0; i < (SUM ? TACO_NSRC : 1); ++i) {
      const uint8_t* payload = reinterpret_cast<const uint8_t*>(src.ptr[p0 + i]);
      const float* scales = reinterpret_cast<const float*>(payload + groups * G);
      const bool mine = lane < U && g0 + lane < groups;
      const float my_scale = mine ? scales[g0 + lane] : 1.0f;
      const float my_pre = (TACO_DUAL && mine) ? scales[groups + g0 + lane] : 1.0f;
      uint32_t q[U][WORDS];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (g0 + u < groups) load_payload(payload + (g0 + u) * G + lane * E, q[u]);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (g0 + u >= groups) break;
        const float scale = __shfl_sync(FULL, my_scale, u), pre = __shfl_sync(FULL, my_pre, u);
        float v[E];
        decompress_group(q[u], scale, pre, lane, v);
#pragma unroll
        for (int r = 0; r < E; ++r) acc[u][r] = i == 0 ? v[r] : __fadd_rn(acc[u][r], v[r]);
      }
    }
    T* dst = out + (SUM ? 0 : p0 * out_stride);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (g0 + u >= groups) break;
      const long long first = (g0 + u) * G + lane * E;
      store_lane<TACO_OUT>(dst + first, first, numel, vec, acc[u]);
    }
  }
}

extern "C" __global__ void __launch_bounds__(256, TACO_MIN_BLOCKS) taco_gather(const __grid_constant__ Sources src, int n_src,
                                                              long long numel, void* out, long long out_stride, int vec) {
  decompress_items<false>(src, n_src, numel, out, out_stride, vec);
}

extern "C" __global__ void __launch_bounds__(256, TACO_MIN_BLOCKS) taco_sum(const __grid_constant__ Sources src, long long numel,
                                                           void* out, int vec) {
  decompress_items<true>(src, TACO_NSRC, numel, out, 0, vec);
}
