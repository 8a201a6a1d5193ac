#include "cli/run_files.h"

#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "compute_node/controller.h"
#include "nlohmann/json.hpp"

namespace tandem::cli {

std::string TierSummary(const EngineStats& s) {
  if (s.demoted_tokens == 0 && s.restored_tokens == 0 && s.restore_failed_tokens == 0) return "";
  const KvTierCounters& t = s.tiers;
  std::string out = absl::StrCat("demoted ", s.demoted_tokens, " tokens to lower tiers, restored ",
                                 s.restored_tokens, ", failed ", s.restore_failed_tokens, " (recomputed); ",
                                 t.pool_bytes_out, " bytes out of the KV pool, ", t.pool_bytes_in, " in");
  if (s.prefetched_tokens > 0 || t.prefetch_wasted_blocks > 0) {
    absl::StrAppend(&out, "; prefetched ", s.prefetched_tokens, " tokens (", t.prefetched_blocks, " blocks, ",
                    t.prefetch_used_blocks, " used, ", t.prefetch_wasted_blocks, " wasted)");
  }
  if (t.shifted_blocks > 0 || t.shifted_failed_blocks > 0) {
    absl::StrAppend(&out, "; kv.store_pre_rope: ", t.shifted_blocks, " blocks reused at new positions, ",
                    t.shifted_failed_blocks, " failed");
  }
  if (t.per_tier) {
    absl::StrAppend(
        &out, "; hits host ", t.host_hits, ", disk ", t.disk_hits, ", misses ", t.misses, ", discarded ",
        t.discarded, "; bytes to host ", t.bytes_to_host, ", from host ", t.bytes_from_host, ", to disk ",
        t.bytes_to_disk, ", from disk ", t.bytes_from_disk, "; evictions host ", t.host_evictions, ", disk ",
        t.disk_evictions,
        absl::StrFormat("; restore time %.3f ms (%.3f ms before a step's layers); save time %.3f ms",
                        t.restore_seconds * 1e3, t.restore_stall_seconds * 1e3, t.save_seconds * 1e3));
    if (t.disk_write_errors > 0) absl::StrAppend(&out, "; disk write errors ", t.disk_write_errors);
  }
  return out;
}

nlohmann::json TopLogprobsJson(const std::vector<std::vector<TopLogprob>>& top) {
  nlohmann::json out = nlohmann::json::array();
  for (const std::vector<TopLogprob>& alts : top) {
    nlohmann::json token = nlohmann::json::array();
    for (const TopLogprob& a : alts) token.push_back({{"token", a.token}, {"logprob", a.logprob}});
    out.push_back(std::move(token));
  }
  return out;
}

absl::Status WriteRequestsFile(const std::string& path, const std::vector<GenerationRequest>& requests) {
  std::ofstream out(path, std::ios::trunc);
  for (const GenerationRequest& r : requests) {
    nlohmann::json j;
    j["prompt_ids"] = r.prompt;
    j["max_tokens"] = r.max_tokens;
    // Floats go through double exactly; parsing back as double and narrowing gives the same float.
    j["temperature"] = static_cast<double>(r.sampling.temperature);
    j["top_k"] = r.sampling.top_k;
    j["top_p"] = static_cast<double>(r.sampling.top_p);
    j["seed"] = r.sampling.seed;
    j["ignore_eos"] = r.ignore_eos;
    if (r.top_logprobs > 0) j["top_logprobs"] = r.top_logprobs;
    out << j.dump() << "\n";
  }
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::Status WriteResultsFile(const std::string& path, const std::vector<GenerationResult>& results,
                              const RunStats& stats) {
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::trunc);
  for (const GenerationResult& r : results) {
    nlohmann::json j;
    j["token_ids"] = r.token_ids;
    j["logprobs"] = r.logprobs;
    if (!r.top_logprobs.empty()) j["top_logprobs"] = TopLogprobsJson(r.top_logprobs);
    j["finish_reason"] = r.finish_reason;
    if (!r.error.ok()) {
      j["error"] = {{"code", static_cast<int>(r.error.code())}, {"message", std::string(r.error.message())}};
    }
    j["prompt_tokens"] = r.prompt_tokens;
    j["cached_tokens"] = r.cached_tokens;
    out << j.dump() << "\n";
  }
  out << nlohmann::json{{"stats",
                         {{"seconds", stats.seconds},
                          {"steps", stats.steps},
                          {"device", stats.device},
                          {"pipeline", stats.pipeline},
                          {"tiers", stats.tiers},
                          {"recovery", stats.recovery}}}}
             .dump()
      << "\n";
  out.close();
  if (!out || std::rename(tmp.c_str(), path.c_str()) != 0)
    return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::Status ReadResultsFile(const std::string& path, std::vector<GenerationResult>* results,
                             RunStats* stats) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the results file ", path));
  std::string line;
  int n = 0;
  bool have_stats = false;
  while (std::getline(in, line)) {
    ++n;
    try {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("stats")) {
        stats->seconds = j["stats"].at("seconds").get<double>();
        stats->steps = j["stats"].at("steps").get<int64_t>();
        stats->device = j["stats"].at("device").get<std::string>();
        stats->pipeline = j["stats"].value("pipeline", "");
        stats->tiers = j["stats"].value("tiers", "");
        stats->recovery = j["stats"].value("recovery", "");
        have_stats = true;
        continue;
      }
      GenerationResult r;
      r.token_ids = j.at("token_ids").get<std::vector<int32_t>>();
      r.logprobs = j.at("logprobs").get<std::vector<float>>();
      if (j.contains("top_logprobs")) {
        for (const nlohmann::json& token : j.at("top_logprobs")) {
          std::vector<TopLogprob>& alts = r.top_logprobs.emplace_back();
          for (const nlohmann::json& a : token)
            alts.push_back({a.at("token").get<int32_t>(), a.at("logprob").get<float>()});
        }
      }
      r.finish_reason = j.at("finish_reason").get<std::string>();
      if (j.contains("error")) {
        const int code = j.at("error").at("code").get<int>();
        if (code < 1 || code > 16) {
          return absl::DataLossError(absl::StrCat(path, ":", n, ": error code ", code, " is not in [1, 16]"));
        }
        r.error =
            absl::Status(static_cast<absl::StatusCode>(code), j.at("error").at("message").get<std::string>());
      }
      r.prompt_tokens = j.at("prompt_tokens").get<int64_t>();
      r.cached_tokens = j.at("cached_tokens").get<int64_t>();
      results->push_back(std::move(r));
    } catch (const nlohmann::json::exception& e) {
      return absl::DataLossError(absl::StrCat(path, ":", n, ": ", e.what()));
    }
  }
  if (!have_stats)
    return absl::DataLossError(absl::StrCat(path, ": no stats line (the compute rank did not finish)"));
  return absl::OkStatus();
}

}  // namespace tandem::cli
