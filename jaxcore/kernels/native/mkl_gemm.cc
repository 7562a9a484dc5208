// Dense matrix products on CPU in Intel oneMKL's GEMM, called from XLA as a custom call (FFI).
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DifforgeMklGemm, Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));
