// Decode throughput of the colocated engine on one GPU, with a breakdown of the step time.
//
// For each (batch, context): B requests with random prompts of `context` tokens are prefilled,
// then decoded for --decode-tokens steps; decode tok/s = B × decode steps / decode time (steps
// that carry no prefill tokens). The same shapes are then timed piece by piece — the model's
// GEMMs alone (cuBLAS, bf16) and decode attention alone over a KV of B × context — so that
//   outside = 1 − (GEMM + attention) / step
// is the share of the step spent elsewhere (norms, RoPE, KV append, sampling, launch gaps, host).
//
// Usage: engine_decode_bench --model llama3-8b [--batches 1,8,32,64,128,256] [--contexts 1024,4096]
//                            [--decode-tokens 32] [--json PATH]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "colocated/engine.h"
#include "compute_node/weights.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"

namespace {

using tandem::ColocatedEngine;
using tandem::GenerationRequest;
using bf16 = __nv_bfloat16;

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> out;
  for (absl::string_view p : absl::StrSplit(s, ',')) {
    int64_t v = 0;
    if (absl::SimpleAtoi(p, &v) && v > 0) out.push_back(v);
  }
  return out;
}

// Median time in ms of `fn` over `iters` runs after 3 warm-ups, by CUDA events on `stream`.
template <typename Fn>
double TimeMs(cudaStream_t stream, int iters, Fn fn) {
  for (int i = 0; i < 3; ++i) fn();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(a, stream);
    fn();
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Fills a device bf16 buffer with random values in [-0.5, 0.5) (never time zeros).
void FillRandom(bf16* d, int64_t n, uint32_t seed) {
  std::vector<bf16> h(static_cast<size_t>(std::min<int64_t>(n, 1 << 24)));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  for (auto& v : h) v = __float2bfloat16(u(rng));
  for (int64_t off = 0; off < n; off += static_cast<int64_t>(h.size())) {
    const int64_t c = std::min<int64_t>(static_cast<int64_t>(h.size()), n - off);
    cudaMemcpy(d + off, h.data(), static_cast<size_t>(c) * 2, cudaMemcpyHostToDevice);
  }
}

// GEMM time of one decode step (all layers + LM head) at batch `b`.
double GemmStepMs(const tandem::ModelSpec& s, int64_t b, cudaStream_t stream) {
  auto gemm = tandem::kernels::cuda::CublasGemm::Create(stream);
  if (!gemm.ok()) return -1;
  struct Shape {
    int64_t n, k;
    bool fp32;
  };
  const std::vector<Shape> shapes = {{s.q_dim() + 2 * s.kv_dim(), s.hidden_size, false},
                                     {s.hidden_size, s.q_dim(), true},
                                     {2 * s.intermediate_size, s.hidden_size, false},
                                     {s.hidden_size, s.intermediate_size, true}};
  double total = 0;
  for (const Shape& sh : shapes) {
    bf16 *x, *w;
    void* y;
    cudaMalloc(&x, static_cast<size_t>(b * sh.k * 2));
    cudaMalloc(&w, static_cast<size_t>(sh.n * sh.k * 2));
    cudaMalloc(&y, static_cast<size_t>(b * sh.n * 4));
    FillRandom(x, b * sh.k, 1);
    FillRandom(w, sh.n * sh.k, 2);
    cudaMemset(y, 0, static_cast<size_t>(b * sh.n * 4));
    total += s.num_layers * TimeMs(stream, 10, [&] {
      (void)(*gemm)->Run({.x = x, .w = w, .y = y, .y_fp32 = sh.fp32, .accumulate = sh.fp32, .m = b, .n = sh.n, .k = sh.k});
    });
    cudaFree(x);
    cudaFree(w);
    cudaFree(y);
  }
  // LM head
  bf16 *x, *w;
  float* y;
  cudaMalloc(&x, static_cast<size_t>(b * s.hidden_size * 2));
  cudaMalloc(&w, static_cast<size_t>(s.vocab_size * s.hidden_size * 2));
  cudaMalloc(&y, static_cast<size_t>(b * s.vocab_size * 4));
  FillRandom(x, b * s.hidden_size, 3);
  FillRandom(w, s.vocab_size * s.hidden_size, 4);
  total += TimeMs(stream, 10, [&] {
    (void)(*gemm)->Run({.x = x, .w = w, .y = y, .y_fp32 = true, .m = b, .n = s.vocab_size, .k = s.hidden_size});
  });
  cudaFree(x);
  cudaFree(w);
  cudaFree(y);
  return total;
}

// Decode attention time of one step (all layers) at batch b, context c (random slot table).
double AttentionStepMs(const tandem::ModelSpec& s, int64_t b, int64_t c, int num_sms, cudaStream_t stream) {
  namespace kc = tandem::kernels::cuda;
  const int64_t slots = b * c;
  bf16 *k, *v, *q, *o;
  int32_t *indptr, *table;
  if (cudaMalloc(&k, static_cast<size_t>(slots * s.kv_dim() * 2)) != cudaSuccess) return -1;
  if (cudaMalloc(&v, static_cast<size_t>(slots * s.kv_dim() * 2)) != cudaSuccess) {
    cudaFree(k);
    return -1;
  }
  cudaMalloc(&q, static_cast<size_t>(b * s.q_dim() * 2));
  cudaMalloc(&o, static_cast<size_t>(b * s.q_dim() * 2));
  FillRandom(k, slots * s.kv_dim(), 5);
  FillRandom(v, slots * s.kv_dim(), 6);
  FillRandom(q, b * s.q_dim(), 7);
  std::vector<int32_t> h_indptr(static_cast<size_t>(b + 1)), h_table(static_cast<size_t>(slots));
  for (int64_t i = 0; i <= b; ++i) h_indptr[static_cast<size_t>(i)] = static_cast<int32_t>(i * c);
  for (int64_t i = 0; i < slots; ++i) h_table[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  std::shuffle(h_table.begin(), h_table.end(), std::mt19937(8));
  cudaMalloc(&indptr, h_indptr.size() * 4);
  cudaMalloc(&table, h_table.size() * 4);
  cudaMemcpy(indptr, h_indptr.data(), h_indptr.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(table, h_table.data(), h_table.size() * 4, cudaMemcpyHostToDevice);
  const kc::DecodePlan plan = kc::PlanDecodeAttention(b, s.num_heads, s.num_kv_heads, s.head_dim, c, num_sms);
  void* ws = nullptr;
  cudaMalloc(&ws, static_cast<size_t>(std::max<int64_t>(16, plan.workspace_bytes)));
  kc::AttentionParams p;
  p.q = q;
  p.k_cache = k;
  p.v_cache = v;
  p.out = o;
  p.kv_indptr = indptr;
  p.kv_slots = table;
  p.num_requests = b;
  p.num_slots = slots;
  p.num_heads = s.num_heads;
  p.num_kv_heads = s.num_kv_heads;
  p.head_dim = s.head_dim;
  p.scale = 0.088f;
  p.max_kv_len = c;
  p.max_q_len = 1;
  const double ms = s.num_layers * TimeMs(stream, 10, [&] { (void)kc::DecodeAttention(p, plan, ws, stream); });
  for (void* ptr : std::vector<void*>{k, v, q, o, indptr, table, ws}) cudaFree(ptr);
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "llama3-8b", json_path;
  std::vector<int64_t> batches = {1, 8, 32, 64, 128, 256}, contexts = {1024, 4096};
  int64_t decode_tokens = 32;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model = v;
    else if (k == "--batches") batches = ParseList(v);
    else if (k == "--contexts") contexts = ParseList(v);
    else if (k == "--decode-tokens") decode_tokens = std::max<int64_t>(2, std::stoll(v));
    else if (k == "--json") json_path = v;
    else {
      std::fprintf(stderr, "engine_decode_bench: unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  auto source = tandem::OpenModel(model, 0);
  if (!source.ok()) {
    std::fprintf(stderr, "engine_decode_bench: %s\n", std::string(source.status().message()).c_str());
    return 1;
  }
  const int64_t max_b = *std::max_element(batches.begin(), batches.end());
  tandem::EngineOptions opt;
  opt.device = "cuda";
  opt.max_batch_size = max_b;
  opt.max_tokens_per_step = std::max<int64_t>(8192, max_b);
  auto t0 = std::chrono::steady_clock::now();
  auto engine = ColocatedEngine::Create(**source, opt);
  if (!engine.ok()) {
    std::fprintf(stderr, "engine_decode_bench: %s\n", std::string(engine.status().message()).c_str());
    return 1;
  }
  std::fprintf(stderr, "loaded %s in %.1f s on %s; KV capacity %lld tokens\n", model.c_str(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), (*engine)->device().c_str(),
               static_cast<long long>((*engine)->kv_capacity_tokens()));
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  const tandem::ModelSpec spec = (*engine)->spec();
  std::printf("model %s on %s, decode %lld tokens per request\n", model.c_str(), prop.name,
              static_cast<long long>(decode_tokens));
  std::printf("%-6s %-6s %-10s %-11s %-9s %-9s %-9s %-8s\n", "batch", "ctx", "tok/s", "step_ms", "gemm_ms", "attn_ms",
              "outside", "prefill_s");
  std::ofstream json;
  if (!json_path.empty()) json.open(json_path), json << "[\n";
  bool first = true;
  std::mt19937 rng(11);
  for (int64_t c : contexts) {
    for (int64_t b : batches) {
      if (b * (c + decode_tokens) > (*engine)->kv_capacity_tokens()) {
        std::printf("%-6lld %-6lld does not fit in the KV cache\n", static_cast<long long>(b), static_cast<long long>(c));
        continue;
      }
      std::vector<GenerationRequest> reqs(static_cast<size_t>(b));
      for (auto& r : reqs) {
        r.prompt.resize(static_cast<size_t>(c));
        for (auto& t : r.prompt) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(spec.vocab_size));
        r.max_tokens = decode_tokens;
        r.ignore_eos = true;
      }
      bool refused = false;
      for (auto& r : reqs) {
        if (absl::StatusOr<int64_t> id = (*engine)->Submit(r); !id.ok()) {
          std::printf("%-6lld %-6lld refused: %s\n", static_cast<long long>(b), static_cast<long long>(c),
                      std::string(id.status().message()).c_str());
          refused = true;
          break;
        }
      }
      if (refused) {
        std::vector<std::pair<int64_t, tandem::GenerationResult>> drain;
        while (!(*engine)->Idle()) (void)(*engine)->Step(&drain);
        continue;
      }
      std::vector<std::pair<int64_t, tandem::GenerationResult>> done;
      double decode_s = 0, prefill_s = 0;
      int64_t decode_steps = 0;
      while (!(*engine)->Idle()) {
        const int64_t before = (*engine)->stats().prefill_tokens;
        const auto s0 = std::chrono::steady_clock::now();
        if (absl::Status st = (*engine)->Step(&done); !st.ok()) {
          std::fprintf(stderr, "step failed: %s\n", std::string(st.message()).c_str());
          return 1;
        }
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
        if ((*engine)->stats().prefill_tokens == before) {
          decode_s += dt;
          ++decode_steps;
        } else {
          prefill_s += dt;
        }
      }
      const double step_ms = decode_steps ? 1e3 * decode_s / static_cast<double>(decode_steps) : 0;
      const double tok_s = decode_s > 0 ? static_cast<double>(b * decode_steps) / decode_s : 0;
      const double gemm_ms = GemmStepMs(spec, b, stream);
      const double attn_ms = AttentionStepMs(spec, b, c + decode_tokens / 2, prop.multiProcessorCount, stream);
      const double outside = step_ms > 0 ? 1.0 - (gemm_ms + attn_ms) / step_ms : 0;
      std::printf("%-6lld %-6lld %-10.0f %-11.2f %-9.2f %-9.2f %-9.2f %-8.1f\n", static_cast<long long>(b),
                  static_cast<long long>(c), tok_s, step_ms, gemm_ms, attn_ms, outside, prefill_s);
      std::fflush(stdout);
      if (json.is_open()) {
        json << (first ? "" : ",\n") << "{\"model\":\"" << model << "\",\"device\":\"" << prop.name << "\",\"batch\":" << b
             << ",\"context\":" << c << ",\"decode_tok_s\":" << tok_s << ",\"step_ms\":" << step_ms
             << ",\"gemm_ms\":" << gemm_ms << ",\"attn_ms\":" << attn_ms << ",\"outside_share\":" << outside << "}";
        first = false;
      }
    }
  }
  if (json.is_open()) json << "\n]\n";
  return 0;
}
