#include "server/api_server.h"

#include <httplib.h>

#include <chrono>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "nlohmann/json.hpp"

#ifndef TANDEM_VERSION
#define TANDEM_VERSION "unknown"
#endif

namespace tandem::server {

namespace {

using json = nlohmann::json;

const char* ErrorType(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 404:
      return "not_found_error";
    case 429:
      return "rate_limit_error";
    case 500:
      return "server_error";
    case 503:
      return "service_unavailable";
    default:
      return "invalid_request_error";
  }
}

void SendError(httplib::Response& res, int status, const std::string& message,
               const std::string& param = "") {
  json e = {{"message", message}, {"type", ErrorType(status)}, {"code", status}};
  e["param"] = param.empty() ? json(nullptr) : json(param);
  res.status = status;
  res.set_content(json{{"error", e}}.dump(), "application/json");
}

// A request field that is wrong: 400 naming it.
struct FieldError {
  std::string param, message;
};

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

struct Completion {
  std::vector<std::vector<int32_t>> prompts;
  int64_t max_tokens = 16, top_k = 0, n = 1;
  double temperature = 1.0, top_p = 1.0;
  std::optional<uint64_t> seed;
  bool stream = false, include_usage = false, ignore_eos = false, logprobs = false;
};

// Reads an integer field in [lo, hi].
std::optional<FieldError> Int(const json& body, const char* key, int64_t lo, int64_t hi, int64_t* out) {
  if (!body.contains(key) || body[key].is_null()) return std::nullopt;
  const json& v = body[key];
  if (!v.is_number_integer()) return FieldError{key, absl::StrCat(key, " must be an integer")};
  if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(hi)
                             : (v.get<int64_t>() < lo || v.get<int64_t>() > hi))
    return FieldError{key, absl::StrCat(key, " must be in [", lo, ", ", hi, "]")};
  *out = v.get<int64_t>();
  return std::nullopt;
}

std::optional<FieldError> Real(const json& body, const char* key, double lo, double hi, double* out) {
  if (!body.contains(key) || body[key].is_null()) return std::nullopt;
  const json& v = body[key];
  if (!v.is_number()) return FieldError{key, absl::StrCat(key, " must be a number")};
  const double d = v.get<double>();
  if (!(d >= lo && d <= hi)) return FieldError{key, absl::StrCat(key, " must be in [", lo, ", ", hi, "]")};
  *out = d;
  return std::nullopt;
}

std::optional<FieldError> Bool(const json& body, const char* key, bool* out) {
  if (!body.contains(key) || body[key].is_null()) return std::nullopt;
  if (!body[key].is_boolean()) return FieldError{key, absl::StrCat(key, " must be true or false")};
  *out = body[key].get<bool>();
  return std::nullopt;
}

std::optional<FieldError> TokenList(const json& v, int64_t vocab, std::vector<int32_t>* out) {
  if (v.empty()) return FieldError{"prompt", "prompt: a token list is empty"};
  for (const json& t : v) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab)
      return FieldError{"prompt", absl::StrCat("prompt: token ids must be integers in [0, ", vocab, ")")};
    out->push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return std::nullopt;
}

std::optional<FieldError> ParseCompletion(const json& body, const ApiOptions& o, const ModelSpec& spec,
                                          Completion* c) {
  static const std::set<std::string> kKnown = {
      "model", "prompt", "max_tokens", "temperature",       "top_p",           "top_k",
      "seed",  "n",      "stream",     "stream_options",    "ignore_eos",      "logprobs",
      "echo",  "stop",   "user",       "frequency_penalty", "presence_penalty"};
  if (!body.is_object()) return FieldError{"", "the body must be a JSON object"};
  for (const auto& [k, v] : body.items()) {
    if (!kKnown.contains(k)) return FieldError{k, absl::StrCat("unknown field \"", k, "\"")};
  }
  for (const char* k : {"frequency_penalty", "presence_penalty"}) {
    if (body.contains(k) && !(body[k].is_number() && body[k].get<double>() == 0.0))
      return FieldError{k, absl::StrCat(k, " is not supported (only 0)")};
  }
  if (body.contains("echo") && body["echo"] != json(false))
    return FieldError{"echo", "echo is not supported yet"};
  if (body.contains("stop") && !body["stop"].is_null() && !(body["stop"].is_array() && body["stop"].empty()))
    return FieldError{"stop", "stop strings need a tokenizer; this server has none yet"};
  if (!body.contains("prompt")) return FieldError{"prompt", "prompt is required"};
  const json& p = body["prompt"];
  if (p.is_string() || (p.is_array() && !p.empty() && p[0].is_string()))
    return FieldError{"prompt", "text prompts need a tokenizer; this server has none yet: send token ids"};
  if (!p.is_array() || p.empty())
    return FieldError{"prompt", "prompt must be a list of token ids or of such lists"};
  if (p[0].is_array()) {
    for (const json& one : p) {
      if (!one.is_array()) return FieldError{"prompt", "prompt: mixes token ids and lists"};
      c->prompts.emplace_back();
      if (auto e = TokenList(one, spec.vocab_size, &c->prompts.back())) return e;
    }
  } else {
    c->prompts.emplace_back();
    if (auto e = TokenList(p, spec.vocab_size, &c->prompts.back())) return e;
  }
  if (auto e = Int(body, "max_tokens", 1, spec.max_position, &c->max_tokens)) return e;
  if (auto e = Int(body, "top_k", 0, spec.vocab_size, &c->top_k)) return e;
  if (auto e = Int(body, "n", 1, o.max_n, &c->n)) return e;
  if (auto e = Real(body, "temperature", 0, 2, &c->temperature)) return e;
  if (auto e = Real(body, "top_p", 1e-9, 1, &c->top_p)) return e;
  if (body.contains("seed") && !body["seed"].is_null()) {
    int64_t s = 0;
    if (auto e = Int(body, "seed", 0, INT64_MAX, &s)) return e;
    c->seed = static_cast<uint64_t>(s);
  }
  if (auto e = Bool(body, "stream", &c->stream)) return e;
  if (auto e = Bool(body, "ignore_eos", &c->ignore_eos)) return e;
  if (body.contains("logprobs") && !body["logprobs"].is_null()) {
    int64_t k = 0;
    if (auto e = Int(body, "logprobs", 0, 1, &k))
      return FieldError{"logprobs",
                        "logprobs must be 0 or 1 (the chosen token's log-probability; no alternatives)"};
    c->logprobs = k > 0;
  }
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    const json& so = body["stream_options"];
    if (!so.is_object()) return FieldError{"stream_options", "stream_options must be an object"};
    if (auto e = Bool(so, "include_usage", &c->include_usage))
      return FieldError{"stream_options.include_usage", e->message};
  }
  if (body.contains("user") && !body["user"].is_string()) return FieldError{"user", "user must be a string"};
  return std::nullopt;
}

int64_t NowUnix() { return absl::ToUnixSeconds(absl::Now()); }

json LogprobsJson(const std::vector<int32_t>& tokens, const std::vector<float>& lp) {
  json ts = json::array(), ls = json::array();
  for (size_t i = 0; i < tokens.size(); ++i) {
    ts.push_back(absl::StrCat(tokens[i]));
    ls.push_back(lp[i]);
  }
  return {{"tokens", ts}, {"token_logprobs", ls}, {"top_logprobs", nullptr}, {"text_offset", json::array()}};
}

json Usage(int64_t prompt, int64_t completion, int64_t cached) {
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

// The requests of one API call, as submitted to the loop; cancelled together.
struct Call {
  EngineLoop* loop = nullptr;
  std::vector<std::shared_ptr<RequestStream>> streams;
  std::vector<bool> done;
  std::vector<GenerationResult> results;
  std::string id;
  int64_t created = 0;
  void CancelAll() {
    for (size_t i = 0; i < streams.size(); ++i)
      if (!done[i]) loop->Cancel(streams[i]->key());
  }
};

}  // namespace

void AddApiKnobs(ConfigSchema* schema) {
  const ApiOptions d;
  schema->String("api.host", d.host, "address the HTTP API listens on")
      .Int("api.port", d.port, "TCP port of the HTTP API (0: any free port, printed at start)", 0, 65535)
      .String("api.key", "", "bearer token the API requires on /v1/* and /metrics (empty: none)")
      .Int("api.max_waiting", LoopOptions{}.max_waiting,
           "requests queued behind the running batch at most; more get 429 with Retry-After", 1, 1 << 20)
      .Int("api.max_body_bytes", d.max_body_bytes, "largest request body (413 above)", 1024, int64_t{1} << 30)
      .Int("api.max_connections", d.max_connections, "connections served at once (one thread each)", 8, 65536)
      .String("api.served_model_name", d.served_model_name,
              "the model name clients send and /v1/models lists")
      .Double("api.shutdown_grace_s", d.shutdown_grace_s,
              "on SIGTERM or Ctrl-C, seconds requests in flight may take to finish before they are cancelled",
              0, 3600);
}

ApiOptions ApiOptionsFromConfig(const Config& c) {
  ApiOptions o;
  o.host = c.GetString("api.host");
  o.port = static_cast<int>(c.GetInt("api.port"));
  o.key = c.GetString("api.key");
  o.max_body_bytes = c.GetInt("api.max_body_bytes");
  o.max_connections = static_cast<int>(c.GetInt("api.max_connections"));
  o.served_model_name = c.GetString("api.served_model_name");
  o.shutdown_grace_s = c.GetDouble("api.shutdown_grace_s");
  return o;
}

LoopOptions LoopOptionsFromConfig(const Config& c) { return {.max_waiting = c.GetInt("api.max_waiting")}; }

absl::StatusOr<std::unique_ptr<ApiServer>> ApiServer::Start(const ApiOptions& options) {
  std::unique_ptr<ApiServer> s(new ApiServer());
  s->options_ = options;
  s->http_ = std::make_unique<httplib::Server>();
  const int threads = std::max(8, options.max_connections);
  s->http_->new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  s->http_->set_payload_max_length(static_cast<size_t>(options.max_body_bytes));
  s->http_->set_read_timeout(10, 0);
  s->http_->set_write_timeout(10, 0);
  s->http_->set_keep_alive_timeout(5);
  s->Routes();
  if (options.port == 0) {
    s->port_ = s->http_->bind_to_any_port(options.host);
  } else {
    s->port_ = s->http_->bind_to_port(options.host, options.port) ? options.port : -1;
  }
  if (s->port_ <= 0) {
    return absl::UnavailableError(
        absl::StrCat("api: cannot listen on ", options.host, ":", options.port,
                     " (api.host, api.port): in use or not an address of this host"));
  }
  httplib::Server* http = s->http_.get();
  s->thread_ = std::thread([http] { http->listen_after_bind(); });
  return s;
}

ApiServer::~ApiServer() { Stop(); }

void ApiServer::SetLoop(EngineLoop* loop, ServerMetrics* metrics) {
  metrics_ = metrics;
  loop_ = loop;
}

void ApiServer::Draining() { draining_ = true; }

void ApiServer::Stop() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

void ApiServer::Routes() {
  httplib::Server& h = *http_;
  h.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (options_.key.empty()) return httplib::Server::HandlerResponse::Unhandled;
    if (!absl::StartsWith(req.path, "/v1/") && req.path != "/metrics")
      return httplib::Server::HandlerResponse::Unhandled;
    const std::string auth = req.get_header_value("Authorization");
    if (!absl::StartsWith(auth, "Bearer ") || !ConstantTimeEquals(auth.substr(7), options_.key)) {
      SendError(res, 401, "missing or wrong API key (Authorization: Bearer <api.key>)");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  h.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 404)
      SendError(res, 404, absl::StrCat("no route ", req.method, " ", req.path));
    else if (res.status == 413)
      SendError(res, 413, "the request body is larger than api.max_body_bytes");
    else
      SendError(res, res.status, absl::StrCat("HTTP ", res.status));
  });
  h.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
    SendError(res, 500, "internal error");
  });
  h.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    EngineLoop* loop = loop_;
    if (loop == nullptr) return SendError(res, 503, "loading the model");
    if (draining_) return SendError(res, 503, "shutting down");
    if (!loop->stats().healthy) return SendError(res, 503, "the engine failed");
    res.set_content("ok\n", "text/plain");
  });
  h.Get("/version", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(json{{"version", TANDEM_VERSION}}.dump(), "application/json");
  });
  h.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    EngineLoop* loop = loop_;
    json m = {{"id", options_.served_model_name},
              {"object", "model"},
              {"created", NowUnix()},
              {"owned_by", "tandem"}};
    if (loop) m["max_model_len"] = loop->spec().max_position;
    res.set_content(json{{"object", "list"}, {"data", json::array({m})}}.dump(), "application/json");
  });
  h.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    EngineLoop* loop = loop_;
    ServerMetrics* metrics = metrics_;
    if (loop == nullptr || metrics == nullptr) return SendError(res, 503, "loading the model");
    res.set_content(metrics->Render(loop->stats(), options_.served_model_name), "text/plain; version=0.0.4");
  });
  h.Post("/v1/chat/completions", [](const httplib::Request&, httplib::Response& res) {
    SendError(res, 400, "chat needs a tokenizer and a chat template; this server has none yet", "messages");
  });
  h.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    EngineLoop* loop = loop_;
    if (loop == nullptr) return SendError(res, 503, "loading the model");
    if (draining_) return SendError(res, 503, "shutting down");
    json body = json::parse(req.body, nullptr, false);
    if (body.is_discarded()) return SendError(res, 400, "the body is not valid JSON");
    if (!body.is_object()) return SendError(res, 400, "the body must be a JSON object");
    if (!body.contains("model") || !body["model"].is_string())
      return SendError(res, 400, "model is required", "model");
    if (body["model"].get<std::string>() != options_.served_model_name)
      return SendError(
          res, 404, absl::StrCat("model \"", body["model"].get<std::string>(), "\" does not exist"), "model");
    Completion c;
    if (std::optional<FieldError> e = ParseCompletion(body, options_, loop->spec(), &c))
      return SendError(res, 400, e->message, e->param);
    auto call = std::make_shared<Call>();
    call->loop = loop;
    call->created = NowUnix();
    const uint64_t base_seed = c.seed ? *c.seed : std::random_device{}();
    for (const std::vector<int32_t>& prompt : c.prompts) {
      for (int64_t i = 0; i < c.n; ++i) {
        GenerationRequest r;
        r.prompt = prompt;
        r.max_tokens = c.max_tokens;
        r.ignore_eos = c.ignore_eos;
        r.sampling.temperature = static_cast<float>(c.temperature);
        r.sampling.top_p = static_cast<float>(c.top_p);
        r.sampling.top_k = static_cast<int32_t>(c.top_k);
        r.sampling.seed = base_seed + static_cast<uint64_t>(i);
        absl::StatusOr<std::shared_ptr<RequestStream>> s = loop->Submit(std::move(r));
        if (!s.ok()) {
          call->done.assign(call->streams.size(), false);
          call->CancelAll();  // nothing half-applied
          if (absl::IsResourceExhausted(s.status())) {
            res.set_header("Retry-After", "1");
            return SendError(res, 429, std::string(s.status().message()));
          }
          if (absl::IsUnavailable(s.status())) return SendError(res, 503, std::string(s.status().message()));
          return SendError(res, 400, std::string(s.status().message()), "prompt");
        }
        call->streams.push_back(*std::move(s));
      }
    }
    call->done.assign(call->streams.size(), false);
    call->results.resize(call->streams.size());
    call->id = absl::StrCat("cmpl-", call->streams.front()->key());
    const std::string model = options_.served_model_name;
    if (!c.stream) {
      for (size_t i = 0; i < call->streams.size(); ++i) {
        while (!call->done[i]) {
          std::optional<StreamEvent> e = call->streams[i]->Next(absl::InfiniteFuture());
          if (!e || !e->done) continue;
          call->done[i] = true;
          if (!e->error.ok()) {
            call->CancelAll();
            return SendError(res, 500, absl::StrCat("the engine failed: ", e->error.message()));
          }
          call->results[i] = std::move(e->result);
        }
      }
      json choices = json::array();
      int64_t prompt_tokens = 0, completion = 0, cached = 0;
      for (size_t i = 0; i < call->results.size(); ++i) {
        const GenerationResult& r = call->results[i];
        json ch = {{"index", i},
                   {"text", ""},
                   {"token_ids", r.token_ids},
                   {"finish_reason", r.finish_reason},
                   {"logprobs", c.logprobs ? LogprobsJson(r.token_ids, r.logprobs) : json(nullptr)}};
        choices.push_back(ch);
        if (i % static_cast<size_t>(c.n) == 0) {
          prompt_tokens += r.prompt_tokens;
          cached += r.cached_tokens;
        }
        completion += static_cast<int64_t>(r.token_ids.size());
      }
      json out = {{"id", call->id},           {"object", "text_completion"},
                  {"created", call->created}, {"model", model},
                  {"choices", choices},       {"usage", Usage(prompt_tokens, completion, cached)}};
      res.set_content(out.dump(), "application/json");
      return;
    }
    const bool logprobs = c.logprobs, include_usage = c.include_usage;
    const size_t per_prompt = static_cast<size_t>(c.n);
    res.set_chunked_content_provider(
        "text/event-stream",
        [call, model, logprobs, include_usage, per_prompt](size_t, httplib::DataSink& sink) {
          auto send = [&](const json& j) {
            const std::string line = absl::StrCat("data: ", j.dump(), "\n\n");
            return sink.write(line.data(), line.size());
          };
          auto chunk = [&](size_t index, const std::vector<int32_t>& tokens, const std::vector<float>& lp,
                           const json& finish) {
            json ch = {{"index", index},
                       {"text", ""},
                       {"token_ids", tokens},
                       {"finish_reason", finish},
                       {"logprobs", logprobs ? LogprobsJson(tokens, lp) : json(nullptr)}};
            return send({{"id", call->id},
                         {"object", "text_completion"},
                         {"created", call->created},
                         {"model", model},
                         {"choices", json::array({ch})}});
          };
          // One pass over the streams: whatever events are ready, or a keep-alive comment after a
          // second of silence (a write is how a disconnected client is noticed).
          const absl::Time until = absl::Now() + absl::Seconds(1);
          bool wrote = false, all_done = true;
          for (size_t i = 0; i < call->streams.size(); ++i) {
            if (call->done[i]) continue;
            const absl::Duration slice = std::max(
                absl::ZeroDuration(), (until - absl::Now()) / static_cast<int64_t>(call->streams.size()));
            while (std::optional<StreamEvent> e =
                       call->streams[i]->Next(absl::Now() + (wrote ? absl::ZeroDuration() : slice))) {
              wrote = true;
              if (e->done) {
                call->done[i] = true;
                if (!e->error.ok()) {
                  send({{"error",
                         {{"message", absl::StrCat("the engine failed: ", e->error.message())},
                          {"type", "server_error"},
                          {"code", 500}}}});
                  call->CancelAll();
                  sink.done();
                  return true;
                }
                if (!chunk(i, {}, {}, e->result.finish_reason)) {
                  call->CancelAll();
                  return false;
                }
                call->results[i] = std::move(e->result);
                break;
              }
              if (!chunk(i, e->tokens, e->logprobs, nullptr)) {
                call->CancelAll();
                return false;
              }
            }
            if (!call->done[i]) all_done = false;
          }
          if (!all_done) {
            if (!wrote && !sink.write(": keep-alive\n\n", 14)) {
              call->CancelAll();
              return false;
            }
            return true;
          }
          if (include_usage) {
            int64_t prompt_tokens = 0, completion = 0, cached = 0;
            for (size_t i = 0; i < call->results.size(); ++i) {
              if (i % per_prompt == 0) {
                prompt_tokens += call->results[i].prompt_tokens;
                cached += call->results[i].cached_tokens;
              }
              completion += static_cast<int64_t>(call->results[i].token_ids.size());
            }
            send({{"id", call->id},
                  {"object", "text_completion"},
                  {"created", call->created},
                  {"model", model},
                  {"choices", json::array()},
                  {"usage", Usage(prompt_tokens, completion, cached)}});
          }
          const std::string done = "data: [DONE]\n\n";
          sink.write(done.data(), done.size());
          sink.done();
          return true;
        },
        [call](bool success) {
          if (!success) call->CancelAll();
        });
  });
}

}  // namespace tandem::server
