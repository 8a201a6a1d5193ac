// The floor that the linear layers of one decode step are compared with: the same matrix products
// (every layer's QKV, Wo, gate/up and down, then the LM head) as bare CublasGemm::Run calls (the
// engine's GEMM kernels: tandem's GEMV at one row unless `gemv` is false, cuBLAS otherwise) in one CUDA
// graph, bf16 in and out, on random weights laid out as the model's (one copy per layer, so nothing is served
// from L2). Median of `iters` graph launches timed with CUDA events. No norms, RoPE or SiLU: the engine's
// "linear" time (gemm + other) has those on top.
//
// Needs the model's weights once more in free device memory; call it before an engine takes the
// device (it frees everything it allocated).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "bench_cuda.h"
#include "common/model_spec.h"
#include "kernels/cuda/gemm.h"

namespace tandem::bench {

// ms per step for each of `rows`, or an empty vector (with a note on stderr) when the weights do
// not fit.
inline std::vector<double> LinearFloorMs(const ModelSpec& s, const std::vector<int64_t>& rows, int iters = 20,
                                         bool gemv = true) {
  const int64_t h = s.hidden_size, qkv = s.q_dim() + 2 * s.kv_dim(), inter = s.intermediate_size;
  const int64_t layer_elems = qkv * h + h * s.q_dim() + 2 * inter * h + h * inter;
  const int64_t max_rows = *std::max_element(rows.begin(), rows.end());
  const int64_t act_elems = max_rows * std::max({h, s.q_dim(), inter, qkv, 2 * inter, s.vocab_size});
  const size_t bytes = 2 * static_cast<size_t>(s.num_layers * layer_elems + s.vocab_size * h + 2 * act_elems);
  size_t free_b = 0, total_b = 0;
  BENCH_CUDA(cudaMemGetInfo(&free_b, &total_b));
  if (bytes + (size_t{2} << 30) > free_b) {
    std::fprintf(stderr, "linear floor: %.1f GiB of weights do not fit in %.1f GiB free; skipped\n",
                 bytes / 1073741824.0, free_b / 1073741824.0);
    return {};
  }
  int sms = 0;
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  __nv_bfloat16* base = nullptr;
  BENCH_CUDA(cudaMalloc(&base, bytes));
  const Helpers helpers = LoadHelpers();
  FillBf16(helpers, base, bytes / 2, 17, sms, stream);
  auto gemm = kernels::cuda::CublasGemm::Create(stream);
  if (!gemm.ok()) {
    std::fprintf(stderr, "linear floor: %s\n", std::string(gemm.status().message()).c_str());
    std::exit(1);
  }
  (*gemm)->set_gemv(gemv);
  __nv_bfloat16* head = base + s.num_layers * layer_elems;
  __nv_bfloat16* in = head + s.vocab_size * h;
  __nv_bfloat16* out = in + act_elems;
  std::vector<double> result;
  for (int64_t m : rows) {
    auto enqueue = [&] {
      for (int64_t l = 0; l < s.num_layers; ++l) {
        __nv_bfloat16* w = base + l * layer_elems;
        const int64_t shapes[4][2] = {{qkv, h}, {h, s.q_dim()}, {2 * inter, h}, {h, inter}};
        for (const auto& [n, k] : shapes) {
          if (!(*gemm)->Run({.x = in, .w = w, .y = out, .m = m, .n = n, .k = k}).ok()) std::exit(1);
          w += n * k;
        }
      }
      if (!(*gemm)->Run({.x = in, .w = head, .y = out, .m = m, .n = s.vocab_size, .k = h}).ok()) std::exit(1);
    };
    enqueue();  // warm-up, outside the graph
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    enqueue();
    BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
    BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t e0, e1;
    BENCH_CUDA(cudaEventCreate(&e0));
    BENCH_CUDA(cudaEventCreate(&e1));
    std::vector<double> ms;
    for (int i = 0; i < iters + 2; ++i) {
      BENCH_CUDA(cudaEventRecord(e0, stream));
      BENCH_CUDA(cudaGraphLaunch(exec, stream));
      BENCH_CUDA(cudaEventRecord(e1, stream));
      BENCH_CUDA(cudaEventSynchronize(e1));
      float t = 0;
      BENCH_CUDA(cudaEventElapsedTime(&t, e0, e1));
      if (i >= 2) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    result.push_back(ms[ms.size() / 2]);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  gemm->reset();
  BENCH_CUDA(cudaFree(base));
  BENCH_CUDA(cudaStreamDestroy(stream));
  return result;
}

}  // namespace tandem::bench
