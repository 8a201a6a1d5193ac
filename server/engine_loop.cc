#include "server/engine_loop.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace tandem::server {

std::optional<StreamEvent> RequestStream::Next(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) return std::nullopt;
  const auto until = absl::ToChronoTime(deadline);
  if (!cv_.wait_until(lock, until, [&] { return !events_.empty(); })) return std::nullopt;
  StreamEvent e = std::move(events_.front());
  events_.pop_front();
  if (e.done) closed_ = true;
  return e;
}

void RequestStream::Push(StreamEvent e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

EngineLoop::EngineLoop(Engine* engine, LoopOptions options, FinishHook on_finish)
    : engine_(engine), spec_(engine->spec()), options_(options), on_finish_(std::move(on_finish)) {
  stats_.kv = engine_->kv_usage();
  thread_ = std::thread([this] { Run(); });
}

EngineLoop::~EngineLoop() { Shutdown(absl::ZeroDuration()); }

absl::StatusOr<std::shared_ptr<RequestStream>> EngineLoop::Submit(GenerationRequest request) {
  auto p = std::make_shared<Pending>();
  p->request = std::move(request);
  p->stream = std::make_shared<RequestStream>();
  p->submitted = absl::Now();
  std::unique_lock<std::mutex> lock(mu_);
  if (!stats_.healthy) {
    return absl::UnavailableError(
        absl::StrCat("the engine failed: ", failure_.message(), "; the server takes no more requests"));
  }
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (stats_.waiting + static_cast<int64_t>(inbox_.size()) >= options_.max_waiting) {
    ++stats_.refused;
    return absl::ResourceExhaustedError(absl::StrCat(
        stats_.waiting, " requests are waiting already (api.max_waiting ", options_.max_waiting, ")"));
  }
  p->stream->key_ = next_key_++;
  inbox_.push_back(p);
  cv_.notify_all();
  decided_.wait(lock, [&] { return p->decided; });
  if (!p->verdict.ok()) return p->verdict;
  return p->stream;
}

void EngineLoop::Cancel(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  cancels_.push_back(key);
  cv_.notify_all();
}

void EngineLoop::Shutdown(absl::Duration grace) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      stopping_ = true;
      stop_by_ = absl::Now() + grace;
    } else if (stop_by_ && absl::Now() + grace < *stop_by_) {
      stop_by_ = absl::Now() + grace;
    }
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

LoopStats EngineLoop::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void EngineLoop::Admit(std::vector<std::shared_ptr<Pending>>& inbox) {
  for (const std::shared_ptr<Pending>& p : inbox) {
    absl::StatusOr<int64_t> id = engine_->Submit(p->request);
    if (id.ok()) {
      Live& live = live_[*id];
      live.stream = p->stream;
      live.times.submitted = p->submitted;
      live.times.admitted = absl::Now();
      by_key_[p->stream->key()] = *id;
    }
    std::lock_guard<std::mutex> lock(mu_);
    // ResourceExhausted from the engine means "could never fit", the caller's input: keep
    // ResourceExhausted for a full queue (retry later).
    p->verdict = absl::IsResourceExhausted(id.status()) ? absl::InvalidArgumentError(id.status().message())
                                                        : id.status();
    if (!id.ok()) ++stats_.refused;
    p->decided = true;
  }
  if (!inbox.empty()) decided_.notify_all();
}

void EngineLoop::Emit(Live& live, const GenerationResult& progress) {
  if (progress.token_ids.size() <= live.sent) return;
  StreamEvent e;
  e.tokens.assign(progress.token_ids.begin() + static_cast<std::ptrdiff_t>(live.sent),
                  progress.token_ids.end());
  e.logprobs.assign(progress.logprobs.begin() + static_cast<std::ptrdiff_t>(live.sent),
                    progress.logprobs.end());
  if (progress.top_logprobs.size() > live.sent) {
    e.top_logprobs.assign(progress.top_logprobs.begin() + static_cast<std::ptrdiff_t>(live.sent),
                          progress.top_logprobs.end());
  }
  if (live.sent == 0) live.times.first_token = absl::Now();
  live.sent = progress.token_ids.size();
  live.stream->Push(std::move(e));
}

void EngineLoop::Finish(int64_t id, GenerationResult result, absl::Status error, bool engine_failed) {
  auto it = live_.find(id);
  if (it == live_.end()) return;
  Live& live = it->second;
  if (error.ok()) Emit(live, result);
  live.times.finished = absl::Now();
  if (live.times.first_token == absl::Time()) live.times.first_token = live.times.finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error.ok()) {
      ++stats_.failed;
    } else if (result.finish_reason == "cancelled") {
      ++stats_.cancelled;
    } else {
      ++stats_.finished;
    }
    stats_.prompt_tokens += result.prompt_tokens;
    stats_.cached_tokens += result.cached_tokens;
    stats_.generation_tokens += static_cast<int64_t>(result.token_ids.size());
  }
  if (on_finish_) on_finish_(result, live.times);
  StreamEvent e;
  e.done = true;
  e.result = std::move(result);
  e.error = std::move(error);
  e.engine_failed = engine_failed;
  live.stream->Push(std::move(e));
  by_key_.erase(live.stream->key());
  live_.erase(it);
}

void EngineLoop::Run() {
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  bool failed = false;
  const absl::Duration beat = engine_->heartbeat_interval();
  while (true) {
    std::vector<std::shared_ptr<Pending>> inbox;
    std::vector<uint64_t> cancels;
    bool cancel_all = false, stop = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto work = [&] { return stopping_ || !inbox_.empty() || !cancels_.empty() || !live_.empty(); };
      if (beat == absl::InfiniteDuration() || failed) {
        cv_.wait(lock, work);
      } else {
        cv_.wait_for(lock, absl::ToChronoNanoseconds(beat), work);  // idle: wakes for the heartbeat
      }
      inbox.swap(inbox_);
      cancels.swap(cancels_);
      cancel_all = stopping_ && stop_by_ && absl::Now() >= *stop_by_;
      stop = stopping_ && live_.empty() && inbox.empty();
    }
    if (stop) break;
    if (failed) {
      std::lock_guard<std::mutex> lock(mu_);
      for (const std::shared_ptr<Pending>& p : inbox) {
        p->verdict = absl::UnavailableError(
            absl::StrCat("the engine failed: ", failure_.message(), "; the server takes no more requests"));
        p->decided = true;
      }
      decided_.notify_all();
      continue;
    }
    Admit(inbox);
    if (cancel_all) {
      for (const auto& [key, id] : by_key_) cancels.push_back(key);
    }
    for (uint64_t key : cancels) {
      auto it = by_key_.find(key);
      if (it == by_key_.end()) continue;  // already finished
      const int64_t id = it->second;
      absl::StatusOr<GenerationResult> r = engine_->Cancel(id);
      if (r.ok()) Finish(id, *std::move(r), absl::OkStatus());
    }
    if (engine_->Idle()) {
      const absl::Status beat_status =
          beat == absl::InfiniteDuration() ? absl::OkStatus() : engine_->Heartbeat();
      std::lock_guard<std::mutex> lock(mu_);
      if (!beat_status.ok()) {
        // A rank lost while idle that the engine cannot do without: as a failed step.
        TANDEM_LOG_ERROR("server",
                         "heartbeat failed, the engine takes no more requests: ", beat_status.message());
        failed = true;
        stats_.healthy = false;
        failure_ = beat_status;
      }
      stats_.running = stats_.waiting = 0;
      stats_.kv = engine_->kv_usage();
      stats_.recovery = RecoveryCounters(engine_->stats());  // a loss or rejoin found while idle
      continue;
    }
    finished.clear();
    const auto t0 = std::chrono::steady_clock::now();
    const absl::Status st = engine_->Step(&finished);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!st.ok()) {
      TANDEM_LOG_ERROR("server", "step failed, ending every request: ", st.message());
      failed = true;
      {
        std::lock_guard<std::mutex> lock(mu_);
        stats_.healthy = false;
        failure_ = st;
      }
      std::vector<int64_t> ids;
      for (const auto& [id, live] : live_) ids.push_back(id);
      for (int64_t id : ids)
        Finish(id, GenerationResult{.finish_reason = "error"}, st, /*engine_failed=*/true);
      continue;
    }
    for (auto& [id, live] : live_) {
      if (const GenerationResult* p = engine_->Progress(id)) Emit(live, *p);
    }
    for (auto& [id, result] : finished) {
      const absl::Status error = result.error;  // OK, or the request's own (it could not be served)
      Finish(id, std::move(result), error);
    }
    // The pipeline's totals, about once a second (a stats request per memory rank between steps).
    std::optional<PipelineTotals> pipeline;
    if (const auto now = std::chrono::steady_clock::now(); now - last_pipeline_ > std::chrono::seconds(1)) {
      last_pipeline_ = now;
      absl::StatusOr<std::optional<PipelineTotals>> snap = engine_->PipelineSnapshot();
      if (!snap.ok()) {
        TANDEM_LOG_WARN("server", "pipeline report: ", snap.status().message());
      } else {
        pipeline = *std::move(snap);
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.steps;
    stats_.step_seconds += dt;
    stats_.running = engine_->num_running();
    stats_.waiting = engine_->num_waiting();
    stats_.kv = engine_->kv_usage();
    const EngineStats engine_stats = engine_->stats();
    stats_.tiers = engine_stats.tiers;
    stats_.recovery = RecoveryCounters(engine_stats);
    if (pipeline) {
      if (stats_.pipeline) stats_.pipeline_window = MakePipelineReport(*pipeline, *stats_.pipeline);
      stats_.pipeline = std::move(pipeline);
    }
  }
}

}  // namespace tandem::server
