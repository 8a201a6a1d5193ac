#include "loadgen/runner.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/status.h"
#include "httplib.h"
#include "nlohmann/json.hpp"

namespace tandem::loadgen {

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Releases requests when they are due: first turns at their arrival times, later turns of a
// session when the previous turn ends (loadgen/runner.h).
class Dispatcher {
 public:
  Dispatcher(const Workload& w, const RunOptions& o, std::vector<RequestTiming>* timings)
      : w_(w), o_(o), timings_(timings) {
    timings_->resize(w.requests.size());
    for (size_t i = 0; i < w.requests.size(); ++i) {
      RequestTiming& t = (*timings_)[i];
      const BenchRequest& r = w.requests[i];
      t.index = static_cast<int64_t>(i);
      t.session = r.session;
      t.turn = r.turn;
      if (r.session >= 0) sessions_[r.session].push_back(i);
      if (o.arrivals[i] != std::numeric_limits<double>::infinity()) {
        pending_.push({o.arrivals[i], i});
        t.arrival = o.arrivals[i];
      }
    }
    for (auto& [s, turns] : sessions_)
      std::sort(turns.begin(), turns.end(),
                [&](size_t a, size_t b) { return w.requests[a].turn < w.requests[b].turn; });
    open_ = static_cast<int64_t>(w.requests.size());
  }

  // The next due request at `now`, or -1.
  int64_t PopDue(double now) {
    if (pending_.empty() || pending_.top().first > now) return -1;
    const size_t i = pending_.top().second;
    pending_.pop();
    return static_cast<int64_t>(i);
  }
  // Seconds until the next release (infinity when none is scheduled).
  double NextDue(double now) const {
    return pending_.empty() ? std::numeric_limits<double>::infinity()
                            : std::max(0.0, pending_.top().first - now);
  }
  bool Done() const { return open_ == 0; }
  int64_t finished() const { return static_cast<int64_t>(w_.requests.size()) - open_; }
  int64_t skipped_turns() const { return skipped_; }

  // The full prompt of request i (a later turn: the session's history first).
  std::vector<int32_t> Prompt(size_t i) const {
    const BenchRequest& r = w_.requests[i];
    if (r.session < 0 || r.turn == 0) return r.prompt;
    std::vector<int32_t> p = history_.at(r.session);
    p.insert(p.end(), r.prompt.begin(), r.prompt.end());
    return p;
  }

  // Request i ended at `now` with `generated` tokens (ok: not failed or cancelled).
  void Finished(size_t i, const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated,
                double now, bool ok) {
    --open_;
    const BenchRequest& r = w_.requests[i];
    if (r.session < 0) return;
    const std::vector<size_t>& turns = sessions_.at(r.session);
    const auto it = std::find(turns.begin(), turns.end(), i);
    if (it == turns.end() || it + 1 == turns.end()) return;
    std::vector<int32_t>& h = history_[r.session];
    h = prompt;
    h.insert(h.end(), generated.begin(), generated.end());
    const size_t next = *(it + 1);
    const int64_t need =
        static_cast<int64_t>(h.size() + w_.requests[next].prompt.size()) + w_.requests[next].max_tokens;
    if (!ok || (o_.max_context > 0 && need > o_.max_context)) {
      // The rest of the session is never sent.
      const int64_t rest = static_cast<int64_t>(turns.end() - it - 1);
      skipped_ += ok ? rest : 0;
      open_ -= rest;
      for (auto j = it + 1; j != turns.end(); ++j) {
        (*timings_)[*j].finish_reason = ok ? "skipped" : "";
        if (!ok) (*timings_)[*j].error = "an earlier turn of its session failed";
      }
      return;
    }
    const double at = now + w_.requests[next].think_s;
    (*timings_)[next].arrival = at;
    pending_.push({at, next});
  }

 private:
  using Item = std::pair<double, size_t>;
  const Workload& w_;
  const RunOptions& o_;
  std::vector<RequestTiming>* timings_;
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> pending_;
  std::map<int64_t, std::vector<size_t>> sessions_;
  std::map<int64_t, std::vector<int32_t>> history_;
  int64_t open_ = 0;
  int64_t skipped_ = 0;
};

KvSample SampleKv(const std::vector<KvUsage>& kv, double t) {
  KvSample s;
  s.t = t;
  double cap = 0, used = 0, cached = 0;
  for (const KvUsage& k : kv) {
    cap += static_cast<double>(k.capacity);
    used += static_cast<double>(k.reserved);
    cached += static_cast<double>(k.cached);
  }
  if (cap > 0) {
    s.used = used / cap;
    s.cached = cached / cap;
  }
  return s;
}

}  // namespace

absl::StatusOr<RunResult> RunOnEngine(Engine& engine, const Workload& w, const RunOptions& o) {
  if (o.arrivals.size() != w.requests.size())
    return absl::InvalidArgumentError("RunOnEngine: one arrival time per request is needed");
  RunResult result;
  result.target = absl::StrCat("engine on ", engine.device());
  Dispatcher d(w, o, &result.timings);
  std::vector<RequestTiming>& timings = result.timings;
  struct Live {
    size_t index;
    std::vector<int32_t> prompt;
  };
  std::map<int64_t, Live> live;
  const EngineStats before = engine.stats();
  const Clock::time_point t0 = Clock::now();
  double last_progress = -1;
  int64_t out_tokens = 0;
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  auto record_tokens = [&](RequestTiming& t, size_t n, double now) {
    while (t.token_times.size() < n) {
      t.token_times.push_back(now);
      ++out_tokens;
    }
  };
  while (!d.Done()) {
    if (o.stop_requested && o.stop_requested()) {
      result.interrupted = true;
      break;
    }
    double now = Since(t0);
    for (;;) {
      if (o.max_concurrency > 0 && static_cast<int64_t>(live.size()) >= o.max_concurrency) break;
      const int64_t i = d.PopDue(now);
      if (i < 0) break;
      GenerationRequest req;
      req.prompt = d.Prompt(static_cast<size_t>(i));
      req.max_tokens = w.requests[static_cast<size_t>(i)].max_tokens;
      req.sampling.temperature = static_cast<float>(o.temperature);
      req.sampling.seed = o.seed + static_cast<uint64_t>(i);
      req.ignore_eos = o.ignore_eos;
      RequestTiming& t = timings[static_cast<size_t>(i)];
      t.prompt_tokens = static_cast<int64_t>(req.prompt.size());
      t.sent = now;
      absl::Status check = engine.Check(req);
      absl::StatusOr<int64_t> id =
          check.ok() ? engine.Submit(std::move(req)) : absl::StatusOr<int64_t>(check);
      if (!id.ok()) {
        t.error = std::string(id.status().message());
        t.finish_reason = "error";
        t.end = now;
        d.Finished(static_cast<size_t>(i), {}, {}, now, false);
        continue;
      }
      live.emplace(*id, Live{static_cast<size_t>(i), d.Prompt(static_cast<size_t>(i))});
    }
    if (engine.Idle()) {
      if (d.Done()) break;
      const double wait = std::min(d.NextDue(now), 0.05);
      if (wait == std::numeric_limits<double>::infinity()) break;  // nothing left that can come
      std::this_thread::sleep_for(std::chrono::duration<double>(wait));
      continue;
    }
    finished.clear();
    const absl::Status st = engine.Step(&finished);
    if (!st.ok()) return Annotate(st, "tandem bench: the engine failed");
    now = Since(t0);
    result.kv.push_back(SampleKv(engine.kv_usage(), now));
    for (auto& [id, r] : finished) {
      const auto it = live.find(id);
      if (it == live.end()) continue;
      RequestTiming& t = timings[it->second.index];
      record_tokens(t, r.token_ids.size(), now);
      t.output_tokens = static_cast<int64_t>(r.token_ids.size());
      t.prompt_tokens = r.prompt_tokens;
      t.cached_tokens = r.cached_tokens;
      t.finish_reason = r.finish_reason;
      if (!r.error.ok()) t.error = std::string(r.error.message());
      t.end = now;
      d.Finished(it->second.index, it->second.prompt, r.token_ids, now, true);
      live.erase(it);
    }
    for (auto& [id, l] : live) {
      const GenerationResult* p = engine.Progress(id);
      if (p != nullptr) record_tokens(timings[l.index], p->token_ids.size(), now);
    }
    if (o.on_progress && now - last_progress >= 0.5) {
      last_progress = now;
      o.on_progress({d.finished(), static_cast<int64_t>(w.requests.size()), static_cast<int64_t>(live.size()),
                     out_tokens, now});
    }
  }
  // Interrupted: cancel what is in flight; it keeps the tokens it got (unfinished).
  for (auto& [id, l] : live) {
    absl::StatusOr<GenerationResult> r = engine.Cancel(id);
    RequestTiming& t = timings[l.index];
    t.finish_reason = "cancelled";
    if (r.ok()) t.output_tokens = static_cast<int64_t>(r->token_ids.size());
  }
  const EngineStats after = engine.stats();
  result.steps = after.steps - before.steps;
  result.busy_seconds = after.busy_seconds - before.busy_seconds;
  result.skipped_turns = d.skipped_turns();
  if (o.on_progress)
    o.on_progress({d.finished(), static_cast<int64_t>(w.requests.size()), 0, out_tokens, Since(t0)});
  return result;
}

namespace {

struct ParsedUrl {
  std::string base;    // scheme://host:port
  std::string prefix;  // "/v1"
};

absl::StatusOr<ParsedUrl> ParseUrl(const std::string& url) {
  absl::string_view u = absl::StripAsciiWhitespace(url);
  if (!absl::StartsWith(u, "http://") && !absl::StartsWith(u, "https://"))
    return absl::InvalidArgumentError(
        absl::StrCat("--url: expected http://host:port[/v1], got \"", url, "\""));
  const size_t scheme_end = u.find("://") + 3;
  const size_t slash = u.find('/', scheme_end);
  ParsedUrl p;
  p.base = std::string(slash == absl::string_view::npos ? u : u.substr(0, slash));
  std::string path = slash == absl::string_view::npos ? "" : std::string(u.substr(slash));
  while (!path.empty() && path.back() == '/') path.pop_back();
  p.prefix = path.empty() ? "/v1" : path;
  return p;
}

std::unique_ptr<httplib::Client> MakeClient(const ParsedUrl& u, const HttpTarget& t) {
  auto c = std::make_unique<httplib::Client>(u.base);
  c->set_connection_timeout(10);
  c->set_read_timeout(static_cast<time_t>(t.timeout_s));
  c->set_write_timeout(60);
  if (!t.api_key.empty()) c->set_bearer_token_auth(t.api_key);
  return c;
}

// KV gauges of a /metrics page (tandem's, or vLLM's), as one sample; false when there are none.
bool ParseKvMetrics(const std::string& body, double t, KvSample* out) {
  double used_sum = 0, cap = 0, reserved = 0, cached = 0;
  int used_n = 0;
  bool any = false;
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    if (sp == absl::string_view::npos) continue;
    double v;
    if (!absl::SimpleAtod(line.substr(sp + 1), &v)) continue;
    const absl::string_view name = line.substr(0, line.find_first_of("{ "));
    if (name == "tandem:kv_cache_capacity_tokens") {
      cap += v;
    } else if (name == "tandem:kv_cache_reserved_tokens") {
      reserved += v;
      any = true;
    } else if (name == "tandem:prefix_cache_tokens") {
      cached += v;
    } else if (name == "vllm:gpu_cache_usage_perc" || name == "vllm:kv_cache_usage_perc") {
      used_sum += v;
      ++used_n;
    }
  }
  out->t = t;
  if (any && cap > 0) {
    out->used = reserved / cap;
    out->cached = cached / cap;
    return true;
  }
  if (used_n > 0) {
    out->used = used_sum / used_n;
    return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<RunResult> RunOnHttp(const HttpTarget& target, const Workload& w, const RunOptions& o) {
  if (o.arrivals.size() != w.requests.size())
    return absl::InvalidArgumentError("RunOnHttp: one arrival time per request is needed");
  ASSIGN_OR_RETURN(const ParsedUrl url, ParseUrl(target.url));
  RunResult result;
  result.target = url.base + url.prefix;
  std::string model = target.model;
  {
    std::unique_ptr<httplib::Client> c = MakeClient(url, target);
    httplib::Result r = c->Get(url.prefix + "/models");
    if (!r) {
      return absl::UnavailableError(
          absl::StrCat(result.target, ": cannot reach the server (", httplib::to_string(r.error()), ")"));
    }
    if (model.empty()) {
      nlohmann::json j = nlohmann::json::parse(r->body, nullptr, false);
      if (r->status != 200 || j.is_discarded() || !j.contains("data") || !j["data"].is_array() ||
          j["data"].empty() || !j["data"][0].contains("id"))
        return absl::UnavailableError(absl::StrCat(result.target, "/models: HTTP ", r->status,
                                                   ", no model listed; give --served-model"));
      model = j["data"][0]["id"].get<std::string>();
    }
  }
  Dispatcher d(w, o, &result.timings);
  std::mutex mu;
  std::condition_variable cv;
  struct Done {
    size_t index;
    std::vector<int32_t> prompt, generated;
    bool ok;
  };
  std::deque<Done> done;
  std::atomic<bool> abort{false};
  std::atomic<int64_t> out_tokens{0};
  std::map<size_t, std::thread> workers;  // in flight or done and not yet joined
  int64_t in_flight = 0;
  const Clock::time_point t0 = Clock::now();

  // /metrics sampler.
  std::atomic<bool> sampler_stop{false};
  std::vector<KvSample> kv;
  std::mutex kv_mu;
  std::thread sampler([&] {
    std::unique_ptr<httplib::Client> c = MakeClient(url, target);
    c->set_read_timeout(5);
    while (!sampler_stop.load()) {
      httplib::Result r = c->Get("/metrics");
      KvSample s;
      if (r && r->status == 200 && ParseKvMetrics(r->body, Since(t0), &s)) {
        std::lock_guard<std::mutex> l(kv_mu);
        kv.push_back(s);
      } else if (!r || r->status == 404) {
        break;  // no metrics here
      }
      for (int i = 0; i < 5 && !sampler_stop.load(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });

  auto worker = [&, model](size_t i, std::vector<int32_t> prompt) {
    RequestTiming& t = result.timings[i];  // this thread's own until it reports Done
    std::vector<int32_t> generated;
    nlohmann::json body = {{"model", model},
                           {"prompt", prompt},
                           {"max_tokens", w.requests[i].max_tokens},
                           {"temperature", o.temperature},
                           {"seed", o.seed + i},
                           {"stream", true},
                           {"stream_options", {{"include_usage", true}}},
                           {"ignore_eos", o.ignore_eos}};
    std::unique_ptr<httplib::Client> c = MakeClient(url, target);
    httplib::Request req;
    req.method = "POST";
    req.path = url.prefix + "/completions";
    req.headers.emplace("Content-Type", "application/json");
    req.headers.emplace("Accept", "text/event-stream");
    if (!target.api_key.empty()) req.headers.emplace("Authorization", "Bearer " + target.api_key);
    req.body = body.dump();
    std::string buf, raw;
    int64_t counted = 0;
    bool saw_done = false;
    std::string finish;
    auto handle_event = [&](absl::string_view data) {
      if (data == "[DONE]") {
        saw_done = true;
        return;
      }
      nlohmann::json j = nlohmann::json::parse(data, nullptr, false);
      if (j.is_discarded()) return;
      const double now = Since(t0);
      if (j.contains("error")) {
        const nlohmann::json& e = j["error"];
        t.error = e.is_object() && e.contains("message") ? e["message"].dump() : e.dump();
        return;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        const nlohmann::json& u = j["usage"];
        if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer())
          t.prompt_tokens = u["prompt_tokens"].get<int64_t>();
        if (u.contains("completion_tokens") && u["completion_tokens"].is_number_integer())
          t.output_tokens = u["completion_tokens"].get<int64_t>();
        if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object() &&
            u["prompt_tokens_details"].contains("cached_tokens") &&
            u["prompt_tokens_details"]["cached_tokens"].is_number_integer())
          t.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
      }
      if (!j.contains("choices") || !j["choices"].is_array()) return;
      for (const nlohmann::json& ch : j["choices"]) {
        int64_t n = 0;
        if (ch.contains("token_ids") && ch["token_ids"].is_array()) {
          for (const nlohmann::json& id : ch["token_ids"])
            if (id.is_number_integer()) generated.push_back(id.get<int32_t>());
          n = static_cast<int64_t>(ch["token_ids"].size());
        } else if (ch.contains("text") && ch["text"].is_string() && !ch["text"].get<std::string>().empty()) {
          n = 1;
        }
        for (int64_t k = 0; k < n; ++k) t.token_times.push_back(now);
        counted += n;
        out_tokens += n;
        if (ch.contains("finish_reason") && ch["finish_reason"].is_string())
          finish = ch["finish_reason"].get<std::string>();
      }
    };
    req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
      if (abort.load()) return false;
      buf.append(data, len);
      if (raw.size() < 4096) raw.append(data, std::min<size_t>(len, 4096));
      size_t pos;
      while ((pos = buf.find('\n')) != std::string::npos) {
        std::string line = buf.substr(0, pos);
        buf.erase(0, pos + 1);
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (absl::StartsWith(line, "data:"))
          handle_event(absl::StripLeadingAsciiWhitespace(absl::string_view(line).substr(5)));
      }
      return true;
    };
    httplib::Response res;
    httplib::Error err = httplib::Error::Success;
    const bool sent = c->send(req, res, err);
    const double now = Since(t0);
    t.end = now;
    if (abort.load()) {
      t.finish_reason = "cancelled";
      t.end = -1;
    } else if (!sent && err != httplib::Error::Success) {
      t.error = absl::StrCat("HTTP request failed: ", httplib::to_string(err));
    } else if (res.status != 200) {
      t.error = absl::StrCat("HTTP ", res.status, ": ", raw.substr(0, 300));
    } else if (t.error.empty() && !saw_done) {
      t.error = "the stream ended without [DONE]";
    }
    if (t.output_tokens < counted) t.output_tokens = counted;
    if (t.prompt_tokens == 0) t.prompt_tokens = static_cast<int64_t>(prompt.size());
    if (!t.error.empty()) t.finish_reason = "error";
    if (t.finish_reason.empty()) t.finish_reason = finish;
    {
      std::lock_guard<std::mutex> l(mu);
      done.push_back({i, std::move(prompt), std::move(generated), t.error.empty() && !abort.load()});
    }
    cv.notify_one();
  };

  double last_progress = -1;
  while (!d.Done()) {
    if (o.stop_requested && o.stop_requested()) {
      result.interrupted = true;
      abort = true;
      break;
    }
    double now = Since(t0);
    for (;;) {
      if (o.max_concurrency > 0 && in_flight >= o.max_concurrency) break;
      const int64_t i = d.PopDue(now);
      if (i < 0) break;
      RequestTiming& t = result.timings[static_cast<size_t>(i)];
      t.sent = now;
      ++in_flight;
      workers.emplace(static_cast<size_t>(i),
                      std::thread(worker, static_cast<size_t>(i), d.Prompt(static_cast<size_t>(i))));
    }
    {
      std::unique_lock<std::mutex> l(mu);
      const double wait = std::min({d.NextDue(now), 0.25});
      if (done.empty() && in_flight == 0 && wait == std::numeric_limits<double>::infinity()) break;
      cv.wait_for(l, std::chrono::duration<double>(wait), [&] { return !done.empty(); });
      while (!done.empty()) {
        Done x = std::move(done.front());
        done.pop_front();
        --in_flight;
        l.unlock();
        // The worker has reported: join it now, so a long run holds no finished threads.
        if (auto it = workers.find(x.index); it != workers.end()) {
          it->second.join();
          workers.erase(it);
        }
        d.Finished(x.index, x.prompt, x.generated, Since(t0), x.ok);
        l.lock();
      }
    }
    now = Since(t0);
    if (o.on_progress && now - last_progress >= 0.5) {
      last_progress = now;
      o.on_progress(
          {d.finished(), static_cast<int64_t>(w.requests.size()), in_flight, out_tokens.load(), now});
    }
  }
  for (auto& [i, th] : workers) th.join();
  sampler_stop = true;
  sampler.join();
  result.kv = std::move(kv);
  result.skipped_turns = d.skipped_turns();
  if (o.on_progress)
    o.on_progress({d.finished(), static_cast<int64_t>(w.requests.size()), 0, out_tokens.load(), Since(t0)});
  return result;
}

}  // namespace tandem::loadgen
