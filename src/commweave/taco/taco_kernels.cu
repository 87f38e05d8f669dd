// TACO's quantizer as CUDA kernels. Layout: every lane holds 32 contiguous elements, a group of G
// elements spans LANES = G/32 neighbouring lanes, so a warp works on 1024 elements (32/LANES groups)
// at once. The Hadamard butterflies with a stride under 32 and most of each pairwise sum stay in
// registers; only the log2(LANES) strides of 32 and more cross lanes (warp shuffles, whose rate,
// one warp instruction a clock per SM, bounded the one-warp-per-group layout).
//
// Bit for bit `commweave.taco.quant` (the torch reference), like the Triton kernels: every
// division (per group: the scales' reciprocals, the RMS's mean) and square root is IEEE
// round-to-nearest (__frcp_rn, __fdiv_rn, __fsqrt_rn), every add and
// multiply is an explicit __fadd_rn / __fmul_rn (never contracted into an FMA), sums are pairwise in
// the reference's order (element i + element i + half, half = G/2, G/4, .., 1: lanes first, then
// registers), butterfly stage h pairs element i with i + h in the reference's order h = 1, 2, 4, ..
// (registers first, then lanes), and the FP8 / 16-bit casts round to nearest even after the
// reference's clamps.
//
// Specialised by the host (`taco/cuda.py`) with these macros, one cubin per combination:
//   TACO_G         group size (32..512, a power of two)
//   TACO_FMT       0: E4M3, 1: E5M2
//   TACO_HADAMARD  0: off, 1: on, 2: adaptive (per group the lower L2 error; flag: negative scale)
//   TACO_DUAL      1: RMS pre-scale stored after the post-scales
//   TACO_CAST      transform input rounded to 0: FP32 (no-op), 1: FP16, 2: BF16
//   TACO_IN        compress input  0: FP32, 1: FP16, 2: BF16
//   TACO_OUT       decompress output 0: FP32, 1: FP16, 2: BF16
//   TACO_NSRC      messages the summing decompress adds (1..8)
//   TACO_MIN_BLOCKS_COMPRESS, _GATHER, _SUM  blocks of 256 threads per SM each kernel's registers allow
//   TACO_FWHT_SCALE  1/sqrt(G) rounded to FP32 (a hex literal)
//   TACO_FETCH16   1: compress fetches 16-bit input's next item into shared memory (cp.async), as
//                  FP32's; 0: loads it into registers when it starts the item
//   TACO_TRANSPOSE 1: at G = 128, cross-lane butterflies and halvings in registers after an exchange
//                  through shared memory (see "Transposed layout" below)
//
// Packed layout of one message (`quant.pack`): FP8 payload [groups * G] bytes, FP32 post-scales
// [groups], FP32 pre-scales [groups] when TACO_DUAL. A work item is 1024 consecutive elements of one
// message; the first lane of each group stores / every lane loads its group's scales.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>
#include <type_traits>

#define G TACO_G
constexpr int E = 32;                        // elements per lane
constexpr int LANES = G / E;                 // lanes per group
constexpr int LOG_LANES = LANES >= 16 ? 4 : LANES >= 8 ? 3 : LANES >= 4 ? 2 : LANES >= 2 ? 1 : 0;
constexpr int ITEM = 32 * E;                 // elements per warp and work item
constexpr unsigned FULL = 0xffffffffu;
constexpr float FWHT_SCALE = TACO_FWHT_SCALE;  // 1/sqrt(G) rounded to FP32, as quant.fwht's
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

template <typename T> struct alignas(16) Chunk { T v[16 / sizeof(T)]; };  // one 16-byte access

// A 16-byte chunk's values as FP32, in order. BF16 is the upper half of an FP32, so a word's two
// values are a shift and a mask (two instructions; the compiler's per-value conversion takes three).
template <typename T>
__device__ __forceinline__ void chunk_to_float(const Chunk<T>& c, float* out) {
  if constexpr (sizeof(T) == 2 && !std::is_same_v<T, __half>) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&c);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[2 * k] = __uint_as_float(w[k] << 16);
      out[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int r = 0; r < 16 / (int)sizeof(T); ++r) out[r] = to_float(c.v[r]);
  }
}

// This lane's 32 elements starting at `first` of a message of `numel`: all 16-byte loads issued
// before any is used when the lane is whole and `vec` says aligned; else element by element.
template <typename T>
__device__ __forceinline__ void load_lane(const T* base, long long first, long long numel, bool vec, float (&v)[E]) {
  constexpr int N = 16 / sizeof(T);
  if (vec && first + E <= numel) {
    Chunk<T> raw[E / N];
#pragma unroll
    for (int k = 0; k < E / N; ++k) raw[k] = reinterpret_cast<const Chunk<T>*>(base)[k];
#pragma unroll
    for (int k = 0; k < E / N; ++k) chunk_to_float(raw[k], v + k * N);
  } else {
#pragma unroll
    for (int r = 0; r < E; ++r) v[r] = first + r < numel ? to_float(base[r]) : 0.0f;
  }
}

template <int CODE>
__device__ __forceinline__ void store_lane(typename Storage<CODE>::T* base, long long first, long long numel, bool vec,
                                           const float (&v)[E]) {
  using T = typename Storage<CODE>::T;
  constexpr int N = 16 / sizeof(T);
  if (vec && first + E <= numel) {
#pragma unroll
    for (int k = 0; k < E / N; ++k) {
      Chunk<T> c;
#pragma unroll
      for (int r = 0; r < N; ++r) c.v[r] = from_float<CODE>(v[k * N + r]);
      reinterpret_cast<Chunk<T>*>(base)[k] = c;
    }
  } else {
#pragma unroll
    for (int r = 0; r < E; ++r)
      if (first + r < numel) base[r] = from_float<CODE>(v[r]);
  }
}

// A lane's 32 payload bytes, byte r in word r / 4 (two 16-byte accesses: messages start 16-byte
// aligned, and a lane's bytes at a multiple of 32 from there).
struct Payload {
  uint32_t w[E / 4];
};

__device__ __forceinline__ uint8_t payload_byte(const Payload& p, int r) { return (p.w[r / 4] >> (8 * (r % 4))) & 0xff; }

// -- a warp's shared staging buffer: lane-contiguous data <-> coalesced 16-byte global accesses ----
// A lane's LANE_BYTES are P = LANE_BYTES / 16 pieces; piece j of lane l sits in slot (j + l) % P of
// the lane's stretch (a swizzle: coalesced reads and the lanes' writes hit few bank conflicts).
// Global chunk c (16 bytes, c = 32 k + lane in access k) is piece c % P of lane c / P.

template <int LANE_BYTES>
__device__ __forceinline__ int stage_slot(int lane, int piece) {
  constexpr int P = LANE_BYTES / 16;
  return lane * LANE_BYTES + 16 * ((piece + lane) % P);
}

// lane pieces -> stage -> global (the whole 32 * LANE_BYTES bytes from `dst`, coalesced)
template <int LANE_BYTES>
__device__ __forceinline__ void store_staged(uint8_t* stage, const uint4 (&pieces)[LANE_BYTES / 16], uint8_t* dst, int lane) {
  constexpr int P = LANE_BYTES / 16;
#pragma unroll
  for (int j = 0; j < P; ++j) *reinterpret_cast<uint4*>(stage + stage_slot<LANE_BYTES>(lane, j)) = pieces[j];
  __syncwarp();
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int c = 32 * k + lane;
    reinterpret_cast<uint4*>(dst)[c] = *reinterpret_cast<const uint4*>(stage + stage_slot<LANE_BYTES>(c / P, c % P));
  }
  __syncwarp();
}

// global chunks (already loaded coalesced: chunk 32 k + lane in raw[k]) -> stage -> lane pieces
template <int LANE_BYTES>
__device__ __forceinline__ void unstage(uint8_t* stage, const uint4 (&raw)[LANE_BYTES / 16], uint4 (&pieces)[LANE_BYTES / 16], int lane) {
  constexpr int P = LANE_BYTES / 16;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int c = 32 * k + lane;
    *reinterpret_cast<uint4*>(stage + stage_slot<LANE_BYTES>(c / P, c % P)) = raw[k];
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < P; ++j) pieces[j] = *reinterpret_cast<const uint4*>(stage + stage_slot<LANE_BYTES>(lane, j));
  __syncwarp();
}

// This lane's E values (elements item_first + 32 * lane .. of a message of numel) into out: a
// whole item through the warp's stage (coalesced 16-byte stores) when `staged` and `vec`, else lane
// by lane (16-byte stores where `vec` says out allows them). Partial items store nothing past numel.
template <int CODE>
__device__ __forceinline__ void store_item(typename Storage<CODE>::T* out, const float (&v)[E], uint8_t* stage,
                                           long long item_first, long long numel, bool vec, bool staged, int lane) {
  using T = typename Storage<CODE>::T;
  constexpr int N = 16 / sizeof(T), BYTES = E * sizeof(T);
  const long long first = item_first + lane * E;
  if (staged && vec && item_first + ITEM <= numel) {  // warp-uniform
    uint4 pieces[BYTES / 16];
#pragma unroll
    for (int k = 0; k < BYTES / 16; ++k) {
      Chunk<T> c;
#pragma unroll
      for (int r = 0; r < N; ++r) c.v[r] = from_float<CODE>(v[k * N + r]);
      pieces[k] = *reinterpret_cast<const uint4*>(&c);
    }
    store_staged<BYTES>(stage, pieces, reinterpret_cast<uint8_t*>(out + item_first), lane);
  } else if (first < numel) {
    store_lane<CODE>(out + first, first, numel, vec, v);
  }
}

// -- per-group math (the reference's order) ---------------------------------------------------------

// max |v| over the group: this lane's registers in 4 running maxima from 0 (10 dependent steps
// instead of 32, the same maximum in any order; few registers: sum-compress has none to spare), then
// its group's lanes.
__device__ __forceinline__ float group_absmax(const float (&v)[E]) {
  float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int r = 0; r < E; ++r) m[r % 4] = fmaxf(m[r % 4], fabsf(v[r]));
  float a = fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
#pragma unroll
  for (int k = LANES / 2; k >= 1; k >>= 1) a = fmaxf(a, __shfl_xor_sync(FULL, a, k));
  return a;
}

// quant._pairwise_sum of the group: element i + element i + half, half = G/2, .., 1 (IEEE addition
// commutes, so either lane of a pair may add). Halves of 32 and more pair lanes LANES/2, .., 1
// apart; each such pair splits the work: the lower lane keeps the sums of even (compact) indices,
// the upper the odd ones, each sending the other half (half the values a step, half the shuffles).
// Then the halves 16 .. LANES within a lane's remaining values, then the last log2(LANES) halves
// across the lanes that split them (both lanes of a pair end with the same sum).
__device__ __forceinline__ float group_pairwise_sum(float (&s)[E], int lane) {
#pragma unroll
  for (int j = 0; j < LOG_LANES; ++j) {
    const int m = LANES >> (j + 1);
    const bool upper = lane & m;
#pragma unroll
    for (int t = 0; t < E / 2; ++t)
      if (t < (E >> (j + 1))) {
        const float a = s[2 * t], b = s[2 * t + 1];
        s[t] = __fadd_rn(upper ? b : a, __shfl_xor_sync(FULL, upper ? a : b, m));
      }
  }
#pragma unroll
  for (int bit = 4; bit >= LOG_LANES; --bit)  // constant bounds: fully unrolled, s stays in registers
#pragma unroll
    for (int c = 0; c < E / 2; ++c)
      if (c < (1 << (bit - LOG_LANES))) s[c] = __fadd_rn(s[c], s[c + (1 << (bit - LOG_LANES))]);
  float v = s[0];
#pragma unroll
  for (int bit = LOG_LANES - 1; bit >= 0; --bit) v = __fadd_rn(v, __shfl_xor_sync(FULL, v, LANES >> (bit + 1)));
  return v;
}

// quant.fwht: stage h pairs i and i + h, h = 1, 2, ..: a + b and a - b; then one scaling by 1/sqrt(G).
__device__ __forceinline__ void group_fwht(float (&v)[E], int lane) {
#pragma unroll
  for (int h = 1; h < E; h <<= 1)
#pragma unroll
    for (int r = 0; r < E; ++r)
      if (!(r & h)) {
        const float a = v[r], b = v[r + h];
        v[r] = __fadd_rn(a, b);
        v[r + h] = __fsub_rn(a, b);
      }
#pragma unroll
  for (int k = 1; k < LANES; k <<= 1) {  // stage h = 32 k: lanes k apart
    // lower lane: a + b = other + own; upper lane: a - b = other - own. One FMA with sign = +-1: the
    // product is exact, so it rounds once, as the addition does (signed zeros alike)
    const float sign = (lane & k) ? -1.0f : 1.0f;
#pragma unroll
    for (int r = 0; r < E; ++r) {
      const float other = __shfl_xor_sync(FULL, v[r], k);
      v[r] = __fmaf_rn(sign, v[r], other);
    }
  }
#pragma unroll
  for (int r = 0; r < E; ++r) v[r] = __fmul_rn(v[r], FWHT_SCALE);
}

// -- Transposed layout (TACO_TRANSPOSE, G = 128 with the Hadamard transform on) -------------------
// Layout N (the default): lane j of a group (j = lane % 4) holds elements 32 j + r in register r.
// Layout T: register 16 h + 4 k + i holds element 32 k + 16 h + 4 j + i (k < 4, h < 2, i < 4), so
// the butterflies of strides 32 and 64 (k's bits) pair registers of one lane. N -> T and back go
// through XPOSE_BYTES of the warp's shared memory in two rounds (h), 4 16-byte stores and 4 16-byte
// loads a round: 16 instructions instead of 2 x 32 shuffles and 2 x 32 FMAs for the two cross-lane
// stages. A lane's chunks q sit at 16 q in its own 80-byte stretch (64 bytes and 16 of padding: with
// a 64-byte stretch one of the two phases conflicts two ways in every bank, with 80 neither does).
// Every value is only moved: the bits are the reference's.
constexpr int XPOSE_BYTES = 32 * 80;
#if TACO_TRANSPOSE && G == 128 && TACO_HADAMARD == 1
constexpr bool CAN_TRANSPOSE = true;
#else
constexpr bool CAN_TRANSPOSE = false;
#endif

__device__ __forceinline__ float* xpose_slot(float* scratch, int owner, int q) { return scratch + 20 * owner + 4 * q; }

// N -> T in place (round h: registers 16 h .. 16 h + 15 out, the same registers back).
__device__ __forceinline__ void to_transposed(float (&v)[E], float* scratch, int lane) {
  const int j = lane & 3, base = lane & ~3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int q = 0; q < 4; ++q)
      *reinterpret_cast<float4*>(xpose_slot(scratch, lane, q)) =
          make_float4(v[16 * h + 4 * q], v[16 * h + 4 * q + 1], v[16 * h + 4 * q + 2], v[16 * h + 4 * q + 3]);
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float4 f = *reinterpret_cast<const float4*>(xpose_slot(scratch, base + k, j));
      v[16 * h + 4 * k] = f.x;
      v[16 * h + 4 * k + 1] = f.y;
      v[16 * h + 4 * k + 2] = f.z;
      v[16 * h + 4 * k + 3] = f.w;
    }
    __syncwarp();
  }
}

// T -> N in place.
__device__ __forceinline__ void from_transposed(float (&v)[E], float* scratch, int lane) {
  const int j = lane & 3, base = lane & ~3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      *reinterpret_cast<float4*>(xpose_slot(scratch, base + k, j)) =
          make_float4(v[16 * h + 4 * k], v[16 * h + 4 * k + 1], v[16 * h + 4 * k + 2], v[16 * h + 4 * k + 3]);
    __syncwarp();
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 f = *reinterpret_cast<const float4*>(xpose_slot(scratch, lane, q));
      v[16 * h + 4 * q] = f.x;
      v[16 * h + 4 * q + 1] = f.y;
      v[16 * h + 4 * q + 2] = f.z;
      v[16 * h + 4 * q + 3] = f.w;
    }
    __syncwarp();
  }
}

// quant.fwht of a group in layout N, result in layout T: strides 1..16 in registers, the exchange,
// strides 32 and 64 in registers, the one scaling.
__device__ __forceinline__ void group_fwht_transposed(float (&v)[E], float* scratch, int lane) {
#pragma unroll
  for (int h = 1; h < E; h <<= 1)
#pragma unroll
    for (int r = 0; r < E; ++r)
      if (!(r & h)) {
        const float a = v[r], b = v[r + h];
        v[r] = __fadd_rn(a, b);
        v[r + h] = __fsub_rn(a, b);
      }
  to_transposed(v, scratch, lane);
#pragma unroll
  for (int kb = 1; kb < 4; kb <<= 1)  // stride 32 (k's bit 0), then 64 (k's bit 1)
#pragma unroll
    for (int r = 0; r < E; ++r)
      if (!((r >> 2) & kb)) {
        const float a = v[r], b = v[r + 4 * kb];
        v[r] = __fadd_rn(a, b);
        v[r + 4 * kb] = __fsub_rn(a, b);
      }
#pragma unroll
  for (int r = 0; r < E; ++r) v[r] = __fmul_rn(v[r], FWHT_SCALE);
}

// Element offset (from the item's first) of register r of this lane in layout T.
__device__ __forceinline__ int transposed_offset(int lane, int r) {
  return 128 * (lane >> 2) + 32 * ((r >> 2) & 3) + 16 * (r >> 4) + 4 * (lane & 3) + (r & 3);
}

// This lane's E values in layout T (an item's elements item_first ..) into out: a whole item through
// the warp's stage (runs of 4 values, run 8 k + 4 h + j of group row g at run slot (8 k + 4 h + j) ^
// 4 g: conflict-free stores; then coalesced 16-byte chunks) when `vec`, else run by run.
template <int CODE>
__device__ __forceinline__ void store_item_transposed(typename Storage<CODE>::T* out, const float (&v)[E],
                                                      uint8_t* stage, long long item_first, long long numel, bool vec,
                                                      int lane) {
  using T = typename Storage<CODE>::T;
  constexpr int RUN = 4 * sizeof(T), ROW = 32 * RUN, CHUNKS = ITEM * sizeof(T) / 16, ROW_CHUNKS = ROW / 16;
  const int g = lane >> 2;
  if (vec && item_first + ITEM <= numel) {  // warp-uniform
#pragma unroll
    for (int r = 0; r < E; r += 4) {
      const int u = 8 * ((r >> 2) & 3) + 4 * (r >> 4) + (lane & 3);
      uint8_t* dst = stage + g * ROW + RUN * (u ^ (g << 2));
      if constexpr (sizeof(T) == 4) {
        *reinterpret_cast<float4*>(dst) = make_float4(v[r], v[r + 1], v[r + 2], v[r + 3]);
      } else {
        Chunk<T> c;  // 8 of them; the first 4 used
#pragma unroll
        for (int t = 0; t < 4; ++t) c.v[t] = from_float<CODE>(v[r + t]);
        *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(&c);
      }
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < CHUNKS / 32; ++k) {
      const int c = 32 * k + lane, row = c / ROW_CHUNKS, m = c % ROW_CHUNKS;
      reinterpret_cast<uint4*>(out + item_first)[c] =
          *reinterpret_cast<const uint4*>(stage + row * ROW + 16 * (m ^ ((row << 2) * (int)sizeof(T) / 4)));
    }
    __syncwarp();
  } else {
#pragma unroll
    for (int r = 0; r < E; ++r) {
      const long long at = item_first + transposed_offset(lane, r);
      if (at < numel) out[at] = from_float<CODE>(v[r]);
    }
  }
}

// This lane's E values in layout T of an item of raw elements (a reduce-scatter's own chunk): runs of
// 4 (8- or 16-byte loads where `vec` allows), zero past numel.
template <typename T>
__device__ __forceinline__ void load_lane_transposed(const T* base, long long item_first, long long numel, bool vec,
                                                     float (&v)[E], int lane) {
#pragma unroll
  for (int r = 0; r < E; r += 4) {
    const long long at = item_first + transposed_offset(lane, r);
    if (vec && at + 4 <= numel) {
      if constexpr (sizeof(T) == 4) {
        const float4 f = *reinterpret_cast<const float4*>(base + at);
        v[r] = f.x;
        v[r + 1] = f.y;
        v[r + 2] = f.z;
        v[r + 3] = f.w;
      } else {
        const uint2 raw = *reinterpret_cast<const uint2*>(base + at);
        const T* t = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < 4; ++k) v[r + k] = to_float(t[k]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) v[r + k] = at + k < numel ? to_float(base[at + k]) : 0.0f;
    }
  }
}

// quant._pairwise_sum of the group, s in layout N, through layout T (X: CAN_TRANSPOSE): halves 64,
// 32 and 16 (k's bits, h) in registers, 8 and 4 (j's bits) across lanes on 4 values, 2 and 1 in
// registers; 8 shuffles instead of 26 and the 48 selects of the split cross-lane halvings.
__device__ __forceinline__ float group_pairwise_sum_transposed(float (&s)[E], float* scratch, int lane) {
  to_transposed(s, scratch, lane);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int r = 0; r < 8; ++r) s[16 * h + r] = __fadd_rn(s[16 * h + r], s[16 * h + r + 8]);  // half 64
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[16 * h + i] = __fadd_rn(s[16 * h + i], s[16 * h + 4 + i]);  // half 32
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] = __fadd_rn(s[i], s[16 + i]);  // half 16
#pragma unroll
  for (int m = 2; m >= 1; m >>= 1)  // halves 8 and 4: lanes 2, then 1 apart (both get the sum)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = __fadd_rn(s[i], __shfl_xor_sync(FULL, s[i], m));
  return __fadd_rn(__fadd_rn(s[0], s[2]), __fadd_rn(s[1], s[3]));  // halves 2, 1
}

// quant._rms: absmax-normalised sum of squares, correctly rounded sqrt; 0 -> absmax -> 1.
// Division by G (a power of two) is the exact multiplication by 1/G: the same real quotient,
// rounded once either way.
template <bool X = false>
__device__ __forceinline__ float group_rms(const float (&v)[E], int lane, float* scratch = nullptr) {
  const float absmax = group_absmax(v);
  const float safe = absmax > 0.0f ? fmaxf(absmax, TINY) : 1.0f;
  const float inv = __frcp_rn(safe);
  float s[E];
#pragma unroll
  for (int r = 0; r < E; ++r) {
    const float t = __fmul_rn(v[r], inv);
    s[r] = __fmul_rn(t, t);
  }
  float sum;
  if constexpr (X) sum = group_pairwise_sum_transposed(s, scratch, lane);
  else sum = group_pairwise_sum(s, lane);
  const float rms = __fmul_rn(safe, __fsqrt_rn(__fmul_rn(sum, 1.0f / G)));
  return rms > 0.0f ? fmaxf(rms, TINY) : safe;
}

__device__ __forceinline__ float fp8_value(uint8_t q) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(q, FP8_KIND))); }

// quant._quantize: absmax scale to the FP8 maximum (zero group: 1; floor: the smallest normal);
// payload = clamp(y / scale) rounded to nearest even.
__device__ __forceinline__ float group_quantize(const float (&y)[E], Payload& q) {
  const float absmax = group_absmax(y);
  const float scale = absmax > 0.0f ? fmaxf(__fdiv_rn(absmax, FP8_MAX), TINY) : 1.0f;
  const float inv = __frcp_rn(scale);
  // the reference clamps to +-FP8_MAX, then rounds: satfinite rounds and saturates to the same.
  // Two values a conversion, the first in the low byte.
#pragma unroll
  for (int k = 0; k < E / 4; ++k) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(y[4 * k], inv), __fmul_rn(y[4 * k + 1], inv)),
                                                 __NV_SATFINITE, FP8_KIND);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(y[4 * k + 2], inv), __fmul_rn(y[4 * k + 3], inv)),
                                                 __NV_SATFINITE, FP8_KIND);
    q.w[k] = lo | hi << 16;
  }
  return scale;
}

// quant's rounding of the transform input to TACO_CAST's type (after clamping to its range), two
// values a conversion. With the dual pre-scale |v| <= sqrt(G) (a group's absmax over its RMS), so
// the clamp can only act without it.
__device__ __forceinline__ void cast_transform_input(float (&v)[E]) {
#if TACO_CAST != 0
#pragma unroll
  for (int r = 0; r < E; r += 2) {
#if TACO_CAST == 1
    constexpr float LIMIT = 65504.0f;
#else
    constexpr float LIMIT = 3.38953139e38f;
#endif
    float a = v[r], b = v[r + 1];
#if !TACO_DUAL
    a = fminf(fmaxf(a, -LIMIT), LIMIT);
    b = fminf(fmaxf(b, -LIMIT), LIMIT);
#endif
#if TACO_CAST == 1
    const float2 f = __half22float2(__floats2half2_rn(a, b));
#else
    const float2 f = __bfloat1622float2(__floats2bfloat162_rn(a, b));
#endif
    v[r] = f.x;
    v[r + 1] = f.y;
  }
#endif
}

// One group (this lane's part): v (the input, FP32, layout N) -> payload bytes q, post-scale,
// pre-scale. X (CAN_TRANSPOSE only): the transform through `scratch`, q in layout T (word 4 h + k:
// elements 32 k + 16 h + 4 j ..).
// XR (with X): the RMS's pairwise sum through layout T too (off where it costs spills: sum-compress).
template <bool X = false, bool XR = X>
__device__ __forceinline__ void compress_group(float (&v)[E], int lane, Payload& q, float& scale, float& pre,
                                               float* scratch = nullptr) {
  pre = 1.0f;
#if TACO_DUAL
  pre = group_rms<X && XR>(v, lane, scratch);
  const float inv_pre = __frcp_rn(pre);
#pragma unroll
  for (int r = 0; r < E; ++r) v[r] = __fmul_rn(v[r], inv_pre);
#endif
#if TACO_HADAMARD == 0
  scale = group_quantize(v, q);
#elif TACO_HADAMARD == 1
  cast_transform_input(v);
  if constexpr (X) group_fwht_transposed(v, scratch, lane);
  else group_fwht(v, lane);  // in place: the untransformed values are not needed again
  scale = group_quantize(v, q);
#else
  float y[E];
#pragma unroll
  for (int r = 0; r < E; ++r) y[r] = v[r];
  cast_transform_input(y);
  group_fwht(y, lane);
  scale = group_quantize(y, q);
  // per group the lower L2 error of transformed / plain (quant.compress, hadamard="adaptive")
  Payload qp;
  const float sp = group_quantize(v, qp);
#pragma unroll
  for (int r = 0; r < E; ++r) y[r] = __fmul_rn(fp8_value(payload_byte(q, r)), scale);
  group_fwht(y, lane);
  float dp[E];
#pragma unroll
  for (int r = 0; r < E; ++r) {
    const float a = __fsub_rn(y[r], v[r]), b = __fsub_rn(__fmul_rn(fp8_value(payload_byte(qp, r)), sp), v[r]);
    y[r] = __fmul_rn(a, a);
    dp[r] = __fmul_rn(b, b);
  }
  const bool use_t = group_pairwise_sum(y, lane) < group_pairwise_sum(dp, lane);
  if (!use_t) q = qp;
  scale = use_t ? -scale : sp;
#endif
}

// One group (this lane's part) back to FP32: quant.decompress before its final cast. X
// (CAN_TRANSPOSE only): the transform through `scratch`, v in layout T; QT: p is in layout T (what
// compress_group<true> made), else N.
template <bool X = false, bool QT = false>
__device__ __forceinline__ void decompress_group(const Payload& p, float scale, float pre, int lane, float (&v)[E],
                                                 float* scratch = nullptr) {
  const float s = TACO_HADAMARD == 2 ? fabsf(scale) : scale;
#pragma unroll
  for (int r = 0; r < E; r += 2) {  // two FP8 values a conversion
    const __half2 h(__nv_cvt_fp8x2_to_halfraw2((p.w[r / 4] >> (8 * (r % 4))) & 0xffff, FP8_KIND));
    const float2 f = __half22float2(h);
    v[r] = __fmul_rn(f.x, s);
    v[r + 1] = __fmul_rn(f.y, s);
  }
#if TACO_HADAMARD == 1
  if constexpr (X) {
    if constexpr (QT) from_transposed(v, scratch, lane);
    group_fwht_transposed(v, scratch, lane);
  } else {
    group_fwht(v, lane);
  }
#elif TACO_HADAMARD == 2
  if (__any_sync(FULL, scale < 0.0f)) {  // warp-uniform: some group of this warp was transformed
    float t[E];
#pragma unroll
    for (int r = 0; r < E; ++r) t[r] = v[r];
    group_fwht(t, lane);  // every lane takes part in the shuffles; each keeps its group's choice
#pragma unroll
    for (int r = 0; r < E; ++r) v[r] = scale < 0.0f ? t[r] : v[r];
  }
#endif
#if TACO_DUAL
#pragma unroll
  for (int r = 0; r < E; ++r) v[r] = __fmul_rn(v[r], pre);
#endif
}

// Compress this lane's part of a work item (every lane takes part: shuffles) and store it into the
// packed message at `payload` (groups past the message's end are dropped): a whole item's payload
// through the warp's stage (coalesced), else lane by lane; the first lane of a group its scales.
// q, scale, pre: what was stored (for a caller that also decompresses it).
// X: compress_group<true> (scratch: XPOSE_BYTES of the warp's shared memory), q in layout T, its words
// staged at word slot (8 k + 4 h + j) ^ 4 g of group row g (conflict-free), read back as 16-byte
// chunks.
template <bool X = false, bool XR = X>
__device__ __forceinline__ void compress_store(float (&v)[E], int lane, uint8_t* stage, uint8_t* payload,
                                               long long groups, long long item_first, Payload& q, float& scale,
                                               float& pre, float* scratch = nullptr) {
  compress_group<X, XR>(v, lane, q, scale, pre, scratch);
  const long long first = item_first + lane * E, group = first / G;
  if constexpr (X) {
    const int g = lane >> 2, j = lane & 3;
    if (item_first + ITEM <= groups * G) {  // warp-uniform
#pragma unroll
      for (int w = 0; w < E / 4; ++w)  // word w = 4 h + k
        reinterpret_cast<uint32_t*>(stage + 128 * g)[(8 * (w & 3) + 4 * (w >> 2) + j) ^ (g << 2)] = q.w[w];
      __syncwarp();
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int c = 32 * k + lane, row = c >> 3;
        reinterpret_cast<uint4*>(payload + item_first)[c] =
            *reinterpret_cast<const uint4*>(stage + 128 * row + 16 * ((c & 7) ^ row));
      }
      __syncwarp();
    } else if (group < groups) {
#pragma unroll
      for (int w = 0; w < E / 4; ++w)
        *reinterpret_cast<uint32_t*>(payload + item_first + transposed_offset(lane, 4 * w)) = q.w[w];
    }
  } else {
    const uint4 pieces[2] = {make_uint4(q.w[0], q.w[1], q.w[2], q.w[3]), make_uint4(q.w[4], q.w[5], q.w[6], q.w[7])};
    if (item_first + ITEM <= groups * G) {  // warp-uniform
      store_staged<E>(stage, pieces, payload + item_first, lane);
    } else if (group < groups) {
      reinterpret_cast<uint4*>(payload + first)[0] = pieces[0];
      reinterpret_cast<uint4*>(payload + first)[1] = pieces[1];
    }
  }
  if (group < groups && lane % LANES == 0) {
    float* scales = reinterpret_cast<float*>(payload + groups * G);
    scales[group] = scale;
#if TACO_DUAL
    scales[groups + group] = pre;
#endif
  }
}

// a / b for the kernels' item arithmetic (a >= 0, b >= 1, warp-uniform): nothing for b = 1, 32-bit
// unsigned division while both fit (a 64-bit division is a ~60-instruction call, and compress and
// gather need one to three an item), else 64-bit.
__device__ __forceinline__ long long item_div(long long a, long long b) {
  if (b == 1) return a;
  if (a <= 0xffffffffLL && b <= 0xffffffffLL) return (unsigned)a / (unsigned)b;
  return a / b;
}

// -- kernels -------------------------------------------------------------------------------------

// This thread's warp in its block, broadcast from lane 0 so the compiler knows it is warp-uniform:
// loops bounded by it are then convergent, and the shuffles inside them need no collective
// fallback (WARPSYNC / ENDCOLLECTIVE around each one, which cost the compress ~1/3 of its issue slots).
__device__ __forceinline__ int warp_in_block() { return __shfl_sync(FULL, threadIdx.x / 32, 0); }

struct Sources {
  unsigned long long ptr[8];  // packed messages (payload, post-scales[, pre-scales]), any rank's window
};

// A barrier between the ranks' writes (the kernels before this one, on every rank) and this
// kernel's reads of them, done by the reading kernel itself instead of a barrier kernel before it
// (which cost a launch gap and ~3.5 us on 2 H200s). Every block's first threads write `epoch` to
// this rank's flag word in each rank's memory (idempotent: whichever block runs first signals),
// then wait until each source's flag word here holds `epoch` or later. epoch 0: no barrier.
struct Barrier {
  unsigned long long signal[8];  // this rank's flag word in rank d's memory (0: none)
  unsigned long long wait[8];    // rank s's flag word in this rank's memory (0: none)
  unsigned long long epoch;
};

__device__ __forceinline__ void fused_barrier(const Barrier& b) {
  if (b.epoch == 0) return;  // grid-uniform
  const int t = threadIdx.x;
  if (t < 8 && b.signal[t]) {
    __threadfence_system();  // the earlier kernels' writes, visible to every rank before the flag
    asm volatile("st.release.sys.global.u64 [%0], %1;\n" ::"l"(b.signal[t]), "l"(b.epoch) : "memory");
  }
  if (t < 8 && b.wait[t]) {
    unsigned long long seen;
    do {
      asm volatile("ld.acquire.sys.global.u64 %0, [%1];\n" : "=l"(seen) : "l"(b.wait[t]) : "memory");
    } while (seen < b.epoch);
  }
  __syncthreads();
}

// cp.async: 16 bytes global -> shared without passing through registers (L2 only: streamed once)
__device__ __forceinline__ void copy_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void copy_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Compress `segments` messages of `numel` elements each, message s at x + s * x_stride, into packed
// message s at buf + s * buf_stride (16-byte aligned), all but message `skip` (-1: none; a
// reduce-scatter's own chunk). vec: x and x_stride allow 16-byte loads.
// own_out (non-null, segments 1): the message also decompressed, from the values just quantized in
// registers, into own_out (the input's type; own_vec: 16-byte stores allowed): an all-gather's own
// part, bit for bit what taco_gather would make of the stored bytes, without reading them back.
// FP32 input (and 16-bit input with TACO_FETCH16 1): a warp's next whole item is fetched into its
// shared inbox (cp.async, coalesced, swizzled as the stage) while it compresses the current one, so
// the loads' latency hides behind the arithmetic without holding registers (the compression takes
// ~120 of its 128); partial items load straight into registers. Measurements: taco/NOTES.md.
extern "C" __global__ void __launch_bounds__(256, TACO_MIN_BLOCKS_COMPRESS)
taco_compress(const void* x_, long long numel, long long x_stride, int segments, uint8_t* buf, long long buf_stride,
              int vec, int skip, void* own_out_, int own_vec) {
  using T = typename Storage<TACO_IN>::T;
  constexpr bool FETCH = sizeof(T) == 4 || TACO_FETCH16;
  constexpr int LANE_BYTES = E * sizeof(T);  // a lane's input bytes
  constexpr int P = LANE_BYTES / 16;
  // 16-bit own_out goes out through a stage (coalesced); FP32's would not fit beside its inbox in
  // 48 KiB of static shared memory, so FP32 stores lane by lane (slower, still exact)
  constexpr bool STAGE_OUT = sizeof(T) == 2;
  // the transposed layout's exchange uses the own_out stage (16-bit input only: FP32's inbox leaves no room)
  constexpr bool X = CAN_TRANSPOSE && STAGE_OUT;
  __shared__ __align__(16) uint8_t stage[8][ITEM];  // a warp's payload bytes
  __shared__ __align__(16) uint8_t inbox[8][FETCH ? 32 * LANE_BYTES : 16];  // a warp's next item's input
  // a warp's own_out bytes, and the transposed layout's exchange
  __shared__ __align__(16) uint8_t out_stage[8][STAGE_OUT ? (X ? XPOSE_BYTES : 32 * LANE_BYTES) : 16];
  T* own_out = static_cast<T*>(own_out_);
  const T* x = static_cast<const T*>(x_);
  const int lane = threadIdx.x & 31, warp = warp_in_block();
  const long long groups = (numel + G - 1) / G;
  const long long per_segment = (numel + ITEM - 1) / ITEM;
  const long long items = per_segment * segments;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  // items of the skipped segment are never visited (warp-uniform)
  auto seg_of = [&](long long item) { return segments == 1 ? 0LL : item_div(item, per_segment); };
  auto skipped = [&](long long item) { return skip >= 0 && item < items && seg_of(item) == skip; };
  auto fetched = [&](long long item) {
    return FETCH && vec && (item - seg_of(item) * per_segment + 1) * ITEM <= numel;
  };
  auto prefetch = [&](long long item) {  // the item's input, chunk c = 32 k + lane to its stage slot
    const long long seg = seg_of(item);
    const uint8_t* src = reinterpret_cast<const uint8_t*>(x + seg * x_stride + (item - seg * per_segment) * ITEM);
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = 32 * k + lane;
      copy_async16(inbox[warp] + stage_slot<LANE_BYTES>(c / P, c % P), src + 16 * c);
    }
    copy_async_commit();
  };
  long long item = blockIdx.x * (long long)(blockDim.x / 32) + warp;
  while (skipped(item)) item += warps;
  if (item < items && fetched(item)) prefetch(item);
  while (item < items) {
    const long long seg = seg_of(item);
    const long long item_first = (item - seg * per_segment) * ITEM, first = item_first + lane * E;
    float v[E];
    if (fetched(item)) {  // warp-uniform
      copy_async_wait_all();
      __syncwarp();
      constexpr int N = 16 / sizeof(T);
#pragma unroll
      for (int j = 0; j < P; ++j)
        chunk_to_float(*reinterpret_cast<const Chunk<T>*>(inbox[warp] + stage_slot<LANE_BYTES>(lane, j)), v + j * N);
      __syncwarp();  // every lane has its values: the inbox may take the next item
    } else {
      load_lane(x + seg * x_stride + first, first, numel, vec, v);
    }
    long long next = item + warps;
    while (skipped(next)) next += warps;
    if (next < items && fetched(next)) prefetch(next);
    Payload q;
    float scale, pre;
    float* scratch = reinterpret_cast<float*>(out_stage[warp]);
    compress_store<X>(v, lane, stage[warp], buf + seg * buf_stride, groups, item_first, q, scale, pre, scratch);
    if (own_out != nullptr) {  // grid-uniform
      decompress_group<X, X>(q, scale, pre, lane, v, scratch);
      if constexpr (X) store_item_transposed<TACO_IN>(own_out, v, out_stage[warp], item_first, numel, own_vec, lane);
      else store_item<TACO_IN>(own_out, v, out_stage[warp], item_first, numel, own_vec, STAGE_OUT, lane);
    }
    item = next;
  }
}

// One message's share of a work item, as loaded: whole items as two coalesced 16-byte chunks per
// lane (unstaged later), a partial item as this lane's own 32 bytes (nothing past the message's last
// group is read); and this lane's group's scales.
struct LaneData {
  uint4 raw[2];
  float scale, pre;
};

__device__ __forceinline__ LaneData load_message(const uint8_t* payload, long long groups, long long item_first,
                                                 bool whole, int lane) {
  LaneData d{};
  const long long group = (item_first + lane * E) / G;
  d.scale = 1.0f;
  d.pre = 1.0f;
  if (whole) {
    const uint4* src = reinterpret_cast<const uint4*>(payload + item_first);
    d.raw[0] = src[lane];
    d.raw[1] = src[32 + lane];
  } else if (group < groups) {
    const uint4* src = reinterpret_cast<const uint4*>(payload + item_first + lane * E);
    d.raw[0] = src[0];
    d.raw[1] = src[1];
  }
  if (group < groups) {
    const float* scales = reinterpret_cast<const float*>(payload + groups * G);
    d.scale = scales[group];
#if TACO_DUAL
    d.pre = scales[groups + group];
#endif
  }
  return d;
}

// Decompress packed messages of `numel` elements each. SUM == false (gather): message p to
// out + p * out_stride for p < n_src, warps interleaving the messages (consecutive warps read
// different ranks: every link busy at once). SUM == true: out = the FP32 sum of the TACO_NSRC
// messages' decompressions in order (the first not added to zero, as the reference's), cast once;
// message `own` (-1: none) is raw elements of the output's type instead, added exactly (a
// reduce-scatter's own chunk). Without SUM, message `own` (-1: none) is skipped: its place in out is
// left as it is (an all-gather's own part, which the compression already wrote). A warp walks its (item, message) steps with the next step's bytes loaded while the current one
// is decompressed; whole items move through the warp's shared stage (coalesced loads and stores).
// vec: out and out_stride allow 16-byte stores.
// REQUANTIZE (with SUM): instead of storing the sum, round it to the output's type and compress it
// into the packed message at out_ (two-shot all-reduce's reduced chunk, bound for the all-gather);
// with own_out (non-null), also write that message's decompression there (this rank's part of the
// all-gather, from the values in registers: own_vec says 16-byte stores are allowed).
template <bool SUM, bool REQUANTIZE = false>
__device__ __forceinline__ void decompress_items(const Sources& src, int n_src, long long numel, void* out_,
                                                 long long out_stride, int vec, int own, void* own_out_ = nullptr,
                                                 int own_vec = 0) {
  using T = typename Storage<TACO_OUT>::T;
  constexpr int OUT_BYTES = E * sizeof(T);  // a lane's output bytes
  constexpr int STEPS = SUM ? TACO_NSRC : 1;  // messages per item
  constexpr int STAGE_BYTES = CAN_TRANSPOSE && XPOSE_BYTES > 32 * OUT_BYTES ? XPOSE_BYTES : 32 * OUT_BYTES;
  __shared__ __align__(16) uint8_t stage[8][STAGE_BYTES];
  T* out = static_cast<T*>(out_);
  const int lane = threadIdx.x & 31, warp = warp_in_block();
  uint8_t* my_stage = stage[warp];
  // layout T: the stage (>= XPOSE_BYTES a warp) is the exchange's scratch; every value (acc too) in layout T
  constexpr bool X = CAN_TRANSPOSE;
  float* scratch = reinterpret_cast<float*>(my_stage);
  const long long groups = (numel + G - 1) / G;
  const long long per_message = (numel + ITEM - 1) / ITEM;
  const int n_read = !SUM && own >= 0 ? n_src - 1 : n_src;  // messages read (gather: all but `own`)
  const long long items = SUM ? per_message : per_message * n_read;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  // step (item, i): message p = SUM ? i : message(item % n_read), elements from
  // (SUM ? item : item / n_read) * ITEM (item_div: no 64-bit division)
  auto message = [&](long long item) {
    const int k = (int)(item - item_div(item, n_read) * n_read);
    return own >= 0 && k >= own ? k + 1 : k;
  };
  auto fetch = [&](long long item, int i) {
    if (SUM && i == own) return LaneData{};  // raw elements: loaded where they are used
    const int p = SUM ? i : message(item);
    const long long item_first = (SUM ? item : item_div(item, n_read)) * ITEM;
    return load_message(reinterpret_cast<const uint8_t*>(src.ptr[p]), groups, item_first,
                        item_first + ITEM <= groups * G, lane);
  };
  long long item = blockIdx.x * (long long)(blockDim.x / 32) + warp;
  int i = 0;
  LaneData cur{};
  if (item < items) cur = fetch(item, 0);
  float acc[E];
#pragma unroll 1
  while (item < items) {
    const long long next_item = i + 1 < STEPS ? item : item + warps;
    const int next_i = i + 1 < STEPS ? i + 1 : 0;
    LaneData next{};
    if (next_item < items) next = fetch(next_item, next_i);
    const int p0 = SUM ? 0 : message(item);
    const long long item_first = (SUM ? item : item_div(item, n_read)) * ITEM;
    const long long first = item_first + lane * E;
    float v[E];
    if (SUM && i == own) {  // warp-uniform
      if constexpr (X) {
        load_lane_transposed(reinterpret_cast<const T*>(src.ptr[i]), item_first, numel, vec, v, lane);
      } else {
        load_lane(reinterpret_cast<const T*>(src.ptr[i]) + first, first, numel, vec, v);
      }
    } else {
      uint4 mine[2] = {cur.raw[0], cur.raw[1]};
      if (item_first + ITEM <= groups * G) unstage<E>(my_stage, cur.raw, mine, lane);  // warp-uniform
      const Payload p{{mine[0].x, mine[0].y, mine[0].z, mine[0].w, mine[1].x, mine[1].y, mine[1].z, mine[1].w}};
      decompress_group<X>(p, cur.scale, cur.pre, lane, v, scratch);
    }
#pragma unroll
    for (int r = 0; r < E; ++r) acc[r] = i == 0 ? v[r] : __fadd_rn(acc[r], v[r]);
    if (REQUANTIZE && i == STEPS - 1) {
      // quant: the sum cast to the dtype (padding past numel is zero, as compress pads), compressed
      if constexpr (X) from_transposed(acc, scratch, lane);  // compression starts from layout N
#pragma unroll
      for (int r = 0; r < E; ++r) v[r] = first + r < numel ? to_float(from_float<TACO_OUT>(acc[r])) : 0.0f;
      Payload q;
      float scale, pre;
      compress_store<X, false>(v, lane, my_stage, static_cast<uint8_t*>(out_), groups, item_first, q, scale, pre,
                               scratch);
      if (own_out_ != nullptr) {  // grid-uniform
        decompress_group<X, X>(q, scale, pre, lane, acc, scratch);
        if constexpr (X) {
          store_item_transposed<TACO_OUT>(static_cast<T*>(own_out_), acc, my_stage, item_first, numel, own_vec, lane);
        } else {
          store_item<TACO_OUT>(static_cast<T*>(own_out_), acc, my_stage, item_first, numel, own_vec, true, lane);
        }
      }
    } else if (i == STEPS - 1) {
      if constexpr (X) {
        store_item_transposed<TACO_OUT>(out + (SUM ? 0 : p0 * out_stride), acc, my_stage, item_first, numel, vec, lane);
      } else {
        store_item<TACO_OUT>(out + (SUM ? 0 : p0 * out_stride), acc, my_stage, item_first, numel, vec, true, lane);
      }
    }
    item = next_item;
    i = next_i;
    cur = next;
  }
}

// The reading kernels start with `bar` (epoch 0: none), then read every source.
extern "C" __global__ void __launch_bounds__(256, TACO_MIN_BLOCKS_GATHER)
taco_gather(const __grid_constant__ Sources src, int n_src, long long numel, void* out, long long out_stride, int vec,
            int skip, const __grid_constant__ Barrier bar) {
  fused_barrier(bar);
  decompress_items<false>(src, n_src, numel, out, out_stride, vec, skip);
}

extern "C" __global__ void __launch_bounds__(256, TACO_MIN_BLOCKS_SUM)
taco_sum(const __grid_constant__ Sources src, long long numel, void* out, int vec, int own,
         const __grid_constant__ Barrier bar) {
  fused_barrier(bar);
  decompress_items<true>(src, TACO_NSRC, numel, out, 0, vec, own);
}

// taco_sum, then the sum (in the output's type) compressed into the packed message at buf (and,
// with own_out, decompressed there: see decompress_items).
extern "C" __global__ void __launch_bounds__(256, TACO_MIN_BLOCKS_SUM)
taco_sum_compress(const __grid_constant__ Sources src, long long numel, uint8_t* buf, int vec, int own,
                  void* own_out, int own_vec, const __grid_constant__ Barrier bar) {
  fused_barrier(bar);
  decompress_items<true, true>(src, TACO_NSRC, numel, buf, 0, vec, own, own_out, own_vec);
}
