// The linear layers alone: every GEMM shape of a decode step (QKV, W_o, gate/up, down, LM head) of
// llama3-8b, llama-13b and llama3-70b at 1–1024 rows, through each path the runtime can take, against
// the roofline max(FLOPs / bf16 GEMM peak, bytes / read bandwidth), both ceilings measured in this
// run (bench/ceilings.h). Not a test: prints tables (and JSON with --json).
//
// Paths, each a CUDA graph of repeated calls over rotating weight copies (never served from L2):
//   cublas   cublasGemmEx, the default algorithm (what CublasGemm::RunCublas calls)
//   gemv     tandem's one-row kernel (kernels/cuda/gemv.cu), m = 1
//   lt-top1  cuBLASLt's first heuristic choice, 32 MiB workspace
//   lt-best  the fastest of cuBLASLt's first 16 heuristic choices, timed here (a per-shape tuned
//            choice, what "chosen once per shape" could buy)
//   tandem   what CublasGemm::Run does now (gemv at one row, cublas otherwise)
// bytes = weights + x + y (y twice where the residual is accumulated); per-step figures sum the
// model's layers and its LM head at the same rows (decode samples every row).
//
// Usage: gemm_bench [--models llama3-8b,llama-13b,llama3-70b] [--rows 1,2,4,8,16,32,64,128,256,512,1024]
//                   [--iters 10] [--no-lt] [--json PATH]
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench_cuda.h"
#include "ceilings.h"
#include "common/model_spec.h"
#include "kernels/cuda/gemm.h"

namespace {

namespace kc = ::tandem::kernels::cuda;

#define LT_CHECK(expr)                                                            \
  do {                                                                            \
    const cublasStatus_t lt_s_ = (expr);                                          \
    if (lt_s_ != CUBLAS_STATUS_SUCCESS) {                                         \
      std::fprintf(stderr, "%s failed at %s:%d: %s\n", #expr, __FILE__, __LINE__, \
                   cublasGetStatusString(lt_s_));                                 \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

struct Options {
  std::vector<std::string> models = {"llama3-8b", "llama-13b", "llama3-70b"};
  std::vector<int64_t> rows = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
  int iters = 10;
  bool lt = true;
  std::string json;
};

Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--models" && i + 1 < argc) {
      o.models = absl::StrSplit(argv[++i], ',', absl::SkipEmpty());
    } else if (a == "--rows" && i + 1 < argc) {
      o.rows.clear();
      for (absl::string_view p : absl::StrSplit(argv[++i], ',', absl::SkipEmpty())) {
        int64_t v = 0;
        if (!absl::SimpleAtoi(p, &v) || v < 1) {
          std::fprintf(stderr, "--rows: '%s' is not a positive integer\n", std::string(p).c_str());
          std::exit(2);
        }
        o.rows.push_back(v);
      }
    } else if (a == "--iters" && i + 1 < argc) {
      o.iters = std::max(3, std::atoi(argv[++i]));
    } else if (a == "--no-lt") {
      o.lt = false;

    } else if (a == "--json" && i + 1 < argc) {
      o.json = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: %s [--models a,b] [--rows 1,8,64] [--iters N] [--no-lt] [--json PATH]\n"
                   "Times every decode GEMM shape per path against the measured roofline.\n",
                   argv[0]);
      std::exit(a == "--help" || a == "-h" ? 0 : 2);
    }
  }
  if (o.models.empty() || o.rows.empty()) {
    std::fprintf(stderr, "--models and --rows must not be empty\n");
    std::exit(2);
  }
  return o;
}

struct Shape {
  std::string name;
  int64_t n = 0, k = 0;
  bool y_fp32 = false, accumulate = false;
  int64_t per_step = 1;  // how many times a decode step runs it (layers; 1 for the LM head)
};

std::vector<Shape> ShapesOf(const tandem::ModelSpec& s) {
  const int64_t L = s.num_layers, h = s.hidden_size, inter = s.intermediate_size;
  return {{"qkv", s.q_dim() + 2 * s.kv_dim(), h, false, false, L},
          {"o", h, s.q_dim(), true, true, L},
          {"gate_up", 2 * inter, h, false, false, L},
          {"down", h, inter, true, true, L},
          {"lm_head", s.vocab_size, h, true, false, 1}};
}

struct Timing {
  double us = 0;  // per call; 0: not run
  std::string note;
};

// One cuBLASLt problem: w (n, k) row-major is column-major (k, n), transposed; x (m, k) row-major
// is column-major (k, m); y (m, n) row-major is column-major (n, m).
struct LtProblem {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  LtProblem(const Shape& sh, int64_t m) {
    LT_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt)));
    LT_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, sh.k, sh.n, sh.k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, sh.k, m, sh.k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&c, sh.y_fp32 ? CUDA_R_32F : CUDA_R_16BF, sh.n, m, sh.n));
  }
  ~LtProblem() {
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatmulDescDestroy(op);
  }
};

class Bench {
 public:
  Bench(cudaStream_t s, int iters) : s_(s), iters_(iters) {
    auto g = kc::CublasGemm::Create(s);
    if (!g.ok()) {
      std::fprintf(stderr, "%s\n", std::string(g.status().message()).c_str());
      std::exit(1);
    }
    gemm_ = std::move(*g);
    LT_CHECK(cublasLtCreate(&lt_));
    BENCH_CUDA(cudaMalloc(&lt_ws_, kLtWorkspace));
    BENCH_CUDA(cudaDeviceGetAttribute(&l2_, cudaDevAttrL2CacheSize, 0));
    BENCH_CUDA(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, 0));
    helpers_ = tandem::bench::LoadHelpers();
  }
  ~Bench() {
    cublasLtDestroy(lt_);
    cudaFree(lt_ws_);
  }

  // Allocates the shape's weight copies and activations (max rows), filled with random bf16.
  void Prepare(const Shape& sh, int64_t max_rows) {
    Release();
    const size_t wbytes = 2 * static_cast<size_t>(sh.n * sh.k);
    copies_ = static_cast<int>(std::max<size_t>(1, (3 * static_cast<size_t>(l2_) + wbytes - 1) / wbytes));
    BENCH_CUDA(cudaMalloc(&w_, wbytes * copies_));
    BENCH_CUDA(cudaMalloc(&x_, 2 * static_cast<size_t>(max_rows * sh.k)));
    BENCH_CUDA(cudaMalloc(&y_, 4 * static_cast<size_t>(max_rows * sh.n)));
    tandem::bench::FillBf16(helpers_, w_, wbytes / 2 * copies_, 7, sms_, s_);
    tandem::bench::FillBf16(helpers_, x_, static_cast<size_t>(max_rows * sh.k), 8, sms_, s_);
    tandem::bench::FillBf16(helpers_, y_, static_cast<size_t>(2 * max_rows * sh.n), 9, sms_, s_);
    BENCH_CUDA(cudaStreamSynchronize(s_));
  }
  void Release() {
    cudaFree(w_);
    cudaFree(x_);
    cudaFree(y_);
    w_ = x_ = nullptr;
    y_ = nullptr;
  }

  kc::GemmParams Params(const Shape& sh, int64_t m, int copy) const {
    return {.x = x_,
            .w = w_ + static_cast<size_t>(copy) * sh.n * sh.k,
            .y = y_,
            .y_fp32 = sh.y_fp32,
            .accumulate = sh.accumulate,
            .m = m,
            .n = sh.n,
            .k = sh.k};
  }

  // Per-call µs of `call(copy)` over a graph of `calls` calls rotating the weight copies.
  template <typename Call>
  double TimeCalls(const Shape& sh, int64_t m, Call call) {
    const double flops = 2.0 * m * sh.n * sh.k;
    const int calls = std::max(copies_, flops > 2e11 ? 4 : 16);
    for (int i = 0; i < copies_; ++i) call(i);  // warm-up (and cuBLAS's lazy set-up) outside the graph
    BENCH_CUDA(cudaStreamSynchronize(s_));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    BENCH_CUDA(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; ++i) call(i % copies_);
    BENCH_CUDA(cudaStreamEndCapture(s_, &graph));
    BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t e0, e1;
    BENCH_CUDA(cudaEventCreate(&e0));
    BENCH_CUDA(cudaEventCreate(&e1));
    std::vector<double> t;
    for (int i = 0; i < iters_ + 2; ++i) {
      BENCH_CUDA(cudaEventRecord(e0, s_));
      BENCH_CUDA(cudaGraphLaunch(exec, s_));
      BENCH_CUDA(cudaEventRecord(e1, s_));
      BENCH_CUDA(cudaEventSynchronize(e1));
      float ms = 0;
      BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 2) t.push_back(ms * 1e3 / calls);
    }
    BENCH_CUDA(cudaEventDestroy(e0));
    BENCH_CUDA(cudaEventDestroy(e1));
    BENCH_CUDA(cudaGraphExecDestroy(exec));
    BENCH_CUDA(cudaGraphDestroy(graph));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }

  void Check(const absl::Status& st) {
    if (!st.ok()) {
      std::fprintf(stderr, "gemm: %s\n", std::string(st.message()).c_str());
      std::exit(1);
    }
  }

  double Cublas(const Shape& sh, int64_t m) {
    return TimeCalls(sh, m, [&](int c) { Check(gemm_->RunCublas(Params(sh, m, c))); });
  }
  double Gemv(const Shape& sh, int64_t m) {
    if (!kc::GemvSupports(Params(sh, m, 0))) return 0;
    return TimeCalls(sh, m, [&](int c) { Check(kc::Gemv(Params(sh, m, c), s_)); });
  }
  double Tandem(const Shape& sh, int64_t m) {
    return TimeCalls(sh, m, [&](int c) { Check(gemm_->Run(Params(sh, m, c))); });
  }
  // {first heuristic's µs, best µs over the first 16}.
  std::pair<double, double> Lt(const Shape& sh, int64_t m) {
    LtProblem prob(sh, m);
    cublasLtMatmulPreference_t pref = nullptr;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = kLtWorkspace;
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                  sizeof(ws)));
    cublasLtMatmulHeuristicResult_t results[16] = {};
    int found = 0;
    LT_CHECK(cublasLtMatmulAlgoGetHeuristic(lt_, prob.op, prob.a, prob.b, prob.c, prob.c, pref, 16, results,
                                            &found));
    cublasLtMatmulPreferenceDestroy(pref);
    const float alpha = 1, beta = sh.accumulate ? 1 : 0;
    double first = 0, best = 0;
    for (int i = 0; i < found; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      const double us = TimeCalls(sh, m, [&](int c) {
        const kc::GemmParams p = Params(sh, m, c);
        LT_CHECK(cublasLtMatmul(lt_, prob.op, &alpha, p.w, prob.a, p.x, prob.b, &beta, p.y, prob.c, p.y,
                                prob.c, &results[i].algo, lt_ws_, kLtWorkspace, s_));
      });
      if (first == 0) first = us;
      if (best == 0 || us < best) best = us;
    }
    return {first, best};
  }

 private:
  static constexpr size_t kLtWorkspace = size_t{32} << 20;
  cudaStream_t s_;
  int iters_;
  std::unique_ptr<kc::CublasGemm> gemm_;
  cublasLtHandle_t lt_ = nullptr;
  void* lt_ws_ = nullptr;
  int l2_ = 0, sms_ = 0, copies_ = 1;
  tandem::bench::Helpers helpers_;
  __nv_bfloat16* w_ = nullptr;
  __nv_bfloat16* x_ = nullptr;
  void* y_ = nullptr;
};

struct Row {
  std::string model, shape;
  int64_t m = 0, n = 0, k = 0, per_step = 1;
  double flops = 0, bytes = 0, roof_us = 0;
  std::map<std::string, double> us;  // path → µs (0: not applicable)
};

double Best(const Row& r) {
  double b = 0;
  for (const auto& [path, us] : r.us)
    if (us > 0 && (b == 0 || us < b)) b = us;
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = ParseArgs(argc, argv);
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const tandem::bench::ReadCeiling read = tandem::bench::MeasureReadCeiling(size_t{4} << 30, 20, s);
  const double peak = tandem::bench::MeasureGemmPeak(8192, 20, s);
  std::printf("device: %s, %d SMs, L2 %d MiB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  for (const auto& v : read.variants)
    std::printf("  read %-28s %7.0f GB/s\n", v.name.c_str(), v.bytes_per_s * 1e-9);
  std::printf("read ceiling: %.0f GB/s (%s); bf16 GEMM peak (cuBLAS 8192^3): %.1f TFLOP/s\n\n",
              read.bytes_per_s * 1e-9, read.best.c_str(), peak * 1e-12);

  Bench bench(s, opt.iters);
  const int64_t max_rows = *std::max_element(opt.rows.begin(), opt.rows.end());
  std::vector<Row> rows;
  for (const std::string& name : opt.models) {
    auto spec = tandem::PresetSpec(name);
    if (!spec.ok()) {
      std::fprintf(stderr, "%s\n", std::string(spec.status().message()).c_str());
      return 2;
    }
    std::printf("%s\n%-8s %5s %6s %6s | %9s %9s %9s %9s %9s | %8s %8s %7s %6s\n", spec->Summary().c_str(),
                "shape", "m", "n", "k", "cublas", "gemv", "lt-top1", "lt-best", "tandem", "TFLOP/s", "GB/s",
                "roof", "%");
    for (const Shape& sh : ShapesOf(*spec)) {
      bench.Prepare(sh, max_rows);
      for (int64_t m : opt.rows) {
        Row r{name, sh.name, m, sh.n, sh.k, sh.per_step};
        r.flops = 2.0 * m * sh.n * sh.k;
        r.bytes =
            2.0 * sh.n * sh.k + 2.0 * m * sh.k + (sh.y_fp32 ? 4.0 : 2.0) * m * sh.n * (sh.accumulate ? 2 : 1);
        r.roof_us = 1e6 * std::max(r.flops / peak, r.bytes / read.bytes_per_s);
        r.us["cublas"] = bench.Cublas(sh, m);
        r.us["gemv"] = bench.Gemv(sh, m);
        if (opt.lt) std::tie(r.us["lt-top1"], r.us["lt-best"]) = bench.Lt(sh, m);
        r.us["tandem"] = bench.Tandem(sh, m);

        const double t = r.us["tandem"];
        auto cell = [&](const std::string& p) {
          const auto it = r.us.find(p);
          return it == r.us.end() || it->second == 0 ? std::string("-") : absl::StrFormat("%.1f", it->second);
        };
        std::printf("%-8s %5lld %6lld %6lld | %9s %9s %9s %9s %9s | %8.1f %8.0f %7.1f %5.0f%%\n",
                    sh.name.c_str(), static_cast<long long>(m), static_cast<long long>(sh.n),
                    static_cast<long long>(sh.k), cell("cublas").c_str(), cell("gemv").c_str(),
                    cell("lt-top1").c_str(), cell("lt-best").c_str(), cell("tandem").c_str(),
                    r.flops / t * 1e-6, r.bytes / t * 1e-3, r.roof_us, 100 * r.roof_us / t);
        rows.push_back(std::move(r));
      }
      bench.Release();
    }
    // The decode step's linear layers: Σ over the model's GEMMs at the same rows.
    std::printf("\n%s, one decode step's GEMMs (ms): roofline, per path, and %% of roofline\n", name.c_str());
    std::printf("%5s %8s %8s %8s %8s %8s %8s | %7s %7s %7s\n", "rows", "roof", "cublas", "gemv*", "lt-best",
                "tandem", "best", "cublas%", "tandem%", "best%");
    for (int64_t m : opt.rows) {
      double roof = 0, best = 0;
      std::map<std::string, double> sum;
      for (const Row& r : rows) {
        if (r.model != name || r.m != m) continue;
        roof += r.roof_us * r.per_step;
        best += Best(r) * r.per_step;
        for (const auto& [p, us] : r.us) {
          // gemv* falls back to cuBLAS where the kernel does not apply.
          const double v = p == "gemv" && us == 0 ? r.us.at("cublas") : us;
          sum[p] += v * r.per_step;
        }
      }
      std::printf("%5lld %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f | %6.0f%% %6.0f%% %6.0f%%\n",
                  static_cast<long long>(m), roof * 1e-3, sum["cublas"] * 1e-3, sum["gemv"] * 1e-3,
                  sum["lt-best"] * 1e-3, sum["tandem"] * 1e-3, best * 1e-3, 100 * roof / sum["cublas"],
                  100 * roof / sum["tandem"], 100 * roof / best);
    }
    std::printf("\n");
  }

  if (!opt.json.empty()) {
    std::ofstream f(opt.json);
    f << absl::StrFormat(
        "{\n  \"device\": \"%s\",\n  \"read_GBps\": %.1f,\n  \"gemm_peak_TFLOPs\": %.1f,\n  \"rows\": [\n",
        prop.name, read.bytes_per_s * 1e-9, peak * 1e-12);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::vector<std::string> paths_json;
      for (const auto& [p, us] : r.us) paths_json.push_back(absl::StrFormat("\"%s\": %.3f", p, us));
      f << absl::StrFormat(
          "    {\"model\": \"%s\", \"shape\": \"%s\", \"m\": %d, \"n\": %d, \"k\": %d, \"roof_us\": %.3f, "
          "%s}%s\n",
          r.model, r.shape, r.m, r.n, r.k, r.roof_us, absl::StrJoin(paths_json, ", "),
          i + 1 < rows.size() ? "," : "");
    }
    f << "  ]\n}\n";
  }
  return 0;
}
