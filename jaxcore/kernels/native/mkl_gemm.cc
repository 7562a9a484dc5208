// Dense matrix products and stride-1 2-D convolutions on CPU in Intel oneMKL's GEMM, called from
// XLA as custom calls (FFI).
//
// Why: XLA CPU's own float32 dot runs the Wan projections at 270-310 GFLOP/s on this 2-core
// AVX-512 host; MKL, which PyTorch uses, at 310-350 on the same shapes. The two halves of the
// product run on XLA's own intra-op pool, each in MKL's sequential (single-threaded) layer: MKL's
// or OpenBLAS's own threads inside an XLA program compete with XLA's pool threads for the cores
// (OpenBLAS's threaded GEMM ran 229 GFLOP/s in a chain of layers where XLA ran 269, and XLA's own
// dots after it slowed down; OpenBLAS single-threaded per half only matched XLA).
//
// C [m, n] = op(A) op(B) in float32 (cblas_sgemm), row-major, A [m, k] or (transpose_a)
// [k, m], B [k, n] or (transpose_b) [n, k]. float32 only: MKL's bf16 GEMM
// (cblas_gemm_bf16bf16f32) ran the Wan S bf16 forward and mixed-precision train step no faster
// than XLA's YNNPACK products (118.6 vs 114.5 ms, 485 vs 472 ms).
//
// Linked directly against MKL's LP64 interface, sequential layer and core (no headers needed:
// the one prototype is below), not through libmkl_rt: libmkl_rt loads those libraries into the
// process's global symbol scope on its first call, where PyTorch's own statically linked MKL,
// imported later, resolved its threading calls to them and ran single-threaded (its float32
// GEMM 336 -> 175 GFLOP/s). Linked, they are this library's dependencies, which
// jaxcore.kernels.cpu_gemm loads with RTLD_LOCAL | RTLD_DEEPBIND: out of the global scope, and
// looked up before it (so they never bind to a PyTorch loaded first either).

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <optional>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" void cblas_sgemm(int layout, int transa, int transb, int m, int n, int k, float alpha,
                            const float* a, int lda, const float* b, int ldb, float beta, float* c,
                            int ldc);

namespace {

// CBLAS constants (mkl_cblas.h)
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// Products under this many multiply-adds run on the calling thread alone: handing half of a
// small product to a pool thread costs more than it saves.
constexpr int64_t kSplitFloor = int64_t{1} << 20;

// One product's geometry: C [m, n] of op(A) op(B) with the leading dimensions of the stored
// (row-major) operands.
struct Product {
  int64_t m, n, k;
  bool ta, tb;
  int64_t lda() const { return ta ? m : k; }
  int64_t ldb() const { return tb ? k : n; }
};

std::optional<Product> Geometry(const ffi::Buffer<ffi::F32>& a, const ffi::Buffer<ffi::F32>& b,
                                bool ta, bool tb) {
  const auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2) return std::nullopt;
  Product p{ta ? ad[1] : ad[0], tb ? bd[0] : bd[1], ta ? ad[0] : ad[1], ta, tb};
  if ((tb ? bd[1] : bd[0]) != p.k) return std::nullopt;
  return p;
}

// Runs `gemm(rows_or_cols_begin, end, by_rows)` over C cut into one slab per pool thread: by
// rows when C has at least as many rows as columns, else by columns.
template <typename Fn>
void Split(ffi::ThreadPool& pool, const Product& p, Fn gemm) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const bool by_rows = p.m >= p.n;
  const int64_t extent = by_rows ? p.m : p.n;
  if (threads == 1 || p.m * p.n * p.k < kSplitFloor || extent < 32) {
    gemm(0, extent, by_rows);
    return;
  }
  const int64_t slab = ((extent + threads - 1) / threads + 15) / 16 * 16;  // whole 16s
  const int64_t items = (extent + slab - 1) / slab;
  ParallelFor(pool, items, [&](int64_t i) {
    gemm(i * slab, std::min(extent, (i + 1) * slab), by_rows);
  });
}

ffi::Error Gemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                ffi::Result<ffi::Buffer<ffi::F32>> c, bool ta, bool tb) {
  const auto p = Geometry(a, b, ta, tb);
  const auto cd = c->dimensions();
  if (!p || cd.size() != 2 || cd[0] != p->m || cd[1] != p->n)
    return ffi::Error::InvalidArgument("difforge mkl_gemm: operand shapes do not multiply");
  if (std::max({p->m, p->n, p->k}) > INT32_MAX)  // MKL's LP64 interface: 32-bit sizes
    return ffi::Error::InvalidArgument("difforge mkl_gemm: a dimension over 2^31 - 1");
  if (p->m == 0 || p->n == 0) return ffi::Error::Success();
  float* cp = c->typed_data();
  if (p->k == 0) {  // MKL rejects a zero leading dimension; the product is all zeros
    std::memset(cp, 0, sizeof(float) * p->m * p->n);
    return ffi::Error::Success();
  }
  const float* ap = a.typed_data();
  const float* bp = b.typed_data();
  const int lda = p->lda(), ldb = p->ldb(), ldc = p->n;
  const int op_a = ta ? kTrans : kNoTrans, op_b = tb ? kTrans : kNoTrans;
  Split(pool, *p, [&](int64_t lo, int64_t hi, bool by_rows) {
    if (by_rows) {  // rows lo..hi of C: rows of A (columns of a stored A^T)
      const float* a0 = ta ? ap + lo : ap + lo * lda;
      cblas_sgemm(kRowMajor, op_a, op_b, hi - lo, p->n, p->k, 1.0f, a0, lda, bp, ldb, 0.0f,
                  cp + lo * ldc, ldc);
    } else {  // columns lo..hi of C: columns of B (rows of a stored B^T)
      const float* b0 = tb ? bp + lo * ldb : bp + lo;
      cblas_sgemm(kRowMajor, op_a, op_b, p->m, hi - lo, p->k, 1.0f, ap, lda, b0, ldb, 0.0f,
                  cp + lo, ldc);
    }
  });
  return ffi::Error::Success();
}

// Output rows (positions of the wide output, below) per work item of a convolution at most: the
// item's [rows, O] block of the output stays in cache across the KH x KW accumulating GEMMs. 128
// and 256 ran the SD UNet's 3 x 3 convolutions at 275-310 GFLOP/s, 512 and 1024 at 190-300.
constexpr int64_t kConvRows = 128;

// A stride-1 convolution of a zero-padded image as KH x KW accumulating GEMMs, no im2col copy.
//
// x [B, Hp, Wp, C] (padded already), kernel [KH, KW, C, O], y [B, Hp - KH + 1, Wp, O]: the
// output is computed "wide", over all Wp columns of each output row, so that position
// r = h * Wp + w reads input position r + i * Wp + j for tap (i, j), and the input rows a tap
// reads are contiguous ([rows, C], leading dimension C): one GEMM per tap and block of rows.
// The last KW - 1 columns of each output row mix in the next row's pixels; the caller drops
// them. The last KW - 1 positions of an image would read past its end: they are zeroed instead.
ffi::Error Conv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> kernel,
                ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto xd = x.dimensions(), kd = kernel.dimensions(), yd = y->dimensions();
  if (xd.size() != 4 || kd.size() != 4 || yd.size() != 4)
    return ffi::Error::InvalidArgument("difforge mkl_conv: operands must be 4-D");
  const int64_t batch = xd[0], hp = xd[1], wp = xd[2], c = xd[3];
  const int64_t kh = kd[0], kw = kd[1], o = kd[3];
  if (kd[2] != c || kh > hp || kw > wp || yd[0] != batch || yd[1] != hp - kh + 1 ||
      yd[2] != wp || yd[3] != o)
    return ffi::Error::InvalidArgument("difforge mkl_conv: operand shapes do not convolve");
  if (std::max({c, o, hp * wp}) > INT32_MAX)
    return ffi::Error::InvalidArgument("difforge mkl_conv: a dimension over 2^31 - 1");
  const int64_t positions = yd[1] * wp;  // of one image's wide output
  const int64_t computed = positions - (kw - 1);
  float* yp = y->typed_data();
  if (o == 0 || positions == 0) return ffi::Error::Success();
  for (int64_t b = 0; b < batch; ++b)
    std::memset(yp + (b * positions + computed) * o, 0, sizeof(float) * (kw - 1) * o);
  if (c == 0) {
    std::memset(yp, 0, sizeof(float) * batch * positions * o);
    return ffi::Error::Success();
  }
  const float* xp = x.typed_data();
  const float* kp = kernel.typed_data();
  // blocks of at most kConvRows rows, as many per image as make the items a multiple of the
  // pool's threads (equal shares), each a whole number of 16 rows where it can be
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t blocks = (computed + kConvRows - 1) / kConvRows;
  while ((batch * blocks) % threads) ++blocks;
  const int64_t per_block = std::min(computed, ((computed + blocks - 1) / blocks + 15) / 16 * 16);
  blocks = (computed + per_block - 1) / per_block;
  auto block = [&](int64_t item) {
    const int64_t b = item / blocks, lo = item % blocks * per_block;
    const int64_t rows = std::min(per_block, computed - lo);
    const float* image = xp + b * hp * wp * c;
    float* out = yp + (b * positions + lo) * o;
    for (int64_t tap = 0; tap < kh * kw; ++tap) {
      const int64_t shift = tap / kw * wp + tap % kw;
      cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, rows, o, c, 1.0f, image + (lo + shift) * c, c,
                  kp + tap * c * o, o, tap == 0 ? 0.0f : 1.0f, out, o);
    }
  };
  const int64_t items = batch * blocks;
  if (pool.num_threads() <= 1 || items == 1 || computed * o * c * kh * kw < kSplitFloor) {
    for (int64_t i = 0; i < items; ++i) block(i);
  } else {
    ParallelFor(pool, items, block);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DifforgeMklConv, Conv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DifforgeMklGemm, Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));
