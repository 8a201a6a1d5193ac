// RequestsFromPrompts (cli/prompts.h): apart from the parsers, since it needs compute_node/.
#include "cli/prompts.h"
#include "compute_node/controller.h"

namespace tandem::cli {

std::vector<GenerationRequest> RequestsFromPrompts(const std::vector<PromptSpec>& specs,
                                                   const GenerationRequest& d) {
  std::vector<GenerationRequest> requests;
  for (const PromptSpec& p : specs) {
    GenerationRequest r;
    r.prompt = p.prompt_ids;
    r.max_tokens = p.max_tokens.value_or(d.max_tokens);
    r.sampling.temperature = static_cast<float>(p.temperature.value_or(d.sampling.temperature));
    r.sampling.top_k = static_cast<int32_t>(p.top_k.value_or(d.sampling.top_k));
    r.sampling.top_p = static_cast<float>(p.top_p.value_or(d.sampling.top_p));
    r.sampling.seed = p.seed.value_or(d.sampling.seed);
    r.ignore_eos = p.ignore_eos.value_or(d.ignore_eos);
    r.top_logprobs = static_cast<int32_t>(p.top_logprobs.value_or(d.top_logprobs));
    requests.push_back(std::move(r));
  }
  return requests;
}

}  // namespace tandem::cli
