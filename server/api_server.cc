#include "server/api_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <chrono>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/json_depth.h"
#include "common/log.h"
#include "nlohmann/json.hpp"
#include "text/text_model.h"
#include "tokenizer/tokenizer.h"

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

// The HTTP status and message of a request that ended with an error: the engine's failure (503:
// the server takes no more requests, so the client should go elsewhere; the message says why, e.g.
// the rank that was lost), or the request's own (GenerationResult::error): 503 when it cannot be
// served now (a lost memory rank left no rank that can hold it), 400 for the caller's input.
std::pair<int, std::string> EndedWithError(const StreamEvent& e) {
  const std::string message(e.error.message());
  if (e.engine_failed) return {503, absl::StrCat("the engine failed: ", message)};
  if (absl::IsUnavailable(e.error)) return {503, message};
  if (absl::IsInvalidArgument(e.error) || absl::IsResourceExhausted(e.error)) return {400, message};
  return {500, message};
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

// One API call, parsed: the prompts (token ids; text already encoded) and the sampling fields.
struct Completion {
  bool chat = false;
  std::vector<std::vector<int32_t>> prompts;
  int64_t max_tokens = 16, top_k = 0, n = 1;
  double temperature = 1.0, top_p = 1.0;
  std::optional<uint64_t> seed;
  bool stream = false, include_usage = false, ignore_eos = false, logprobs = false, echo = false;
  int64_t top_logprobs = 0;  // alternatives per token (completions: logprobs; chat: top_logprobs)
  std::vector<std::string> stop;
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

// The fields both endpoints share (sampling, streaming, stop).
std::optional<FieldError> ParseCommon(const json& body, const ApiOptions& o, const ModelSpec& spec,
                                      const text::TextModel* tm, Completion* c) {
  for (const char* k : {"frequency_penalty", "presence_penalty"}) {
    if (body.contains(k) && !(body[k].is_number() && body[k].get<double>() == 0.0))
      return FieldError{k, absl::StrCat(k, " is not supported (only 0)")};
  }
  if (auto e = Int(body, "max_tokens", 1, spec.max_position, &c->max_tokens)) return e;
  if (c->chat) {
    if (auto e = Int(body, "max_completion_tokens", 1, spec.max_position, &c->max_tokens)) return e;
  }
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
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    const json& so = body["stream_options"];
    if (!so.is_object()) return FieldError{"stream_options", "stream_options must be an object"};
    if (auto e = Bool(so, "include_usage", &c->include_usage))
      return FieldError{"stream_options.include_usage", e->message};
  }
  if (body.contains("user") && !body["user"].is_string()) return FieldError{"user", "user must be a string"};
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& st = body["stop"];
    if (st.is_string()) {
      c->stop.push_back(st.get<std::string>());
    } else if (st.is_array() && st.size() <= 4) {
      for (const json& x : st) {
        if (!x.is_string()) return FieldError{"stop", "stop must be a string or a list of up to 4 strings"};
        c->stop.push_back(x.get<std::string>());
      }
    } else {
      return FieldError{"stop", "stop must be a string or a list of up to 4 strings"};
    }
    for (const std::string& s : c->stop)
      if (s.empty()) return FieldError{"stop", "stop strings must not be empty"};
    if (!c->stop.empty() && tm == nullptr)
      return FieldError{"stop", "stop strings need the model's tokenizer; this model ships none"};
  }
  return std::nullopt;
}

std::optional<FieldError> ParseCompletion(const json& body, const ApiOptions& o, const ModelSpec& spec,
                                          const text::TextModel* tm, Completion* c) {
  static const std::set<std::string> kKnown = {
      "model", "prompt", "max_tokens", "temperature",       "top_p",           "top_k",
      "seed",  "n",      "stream",     "stream_options",    "ignore_eos",      "logprobs",
      "echo",  "stop",   "user",       "frequency_penalty", "presence_penalty"};
  for (const auto& [k, v] : body.items()) {
    if (!kKnown.contains(k)) return FieldError{k, absl::StrCat("unknown field \"", k, "\"")};
  }
  if (auto e = Bool(body, "echo", &c->echo)) return e;
  if (c->echo && tm == nullptr)
    return FieldError{"echo", "echo needs the model's tokenizer (the prompt comes back as text)"};
  if (!body.contains("prompt")) return FieldError{"prompt", "prompt is required"};
  const json& p = body["prompt"];
  auto encode = [&](const std::string& text) -> std::optional<FieldError> {
    if (tm == nullptr)
      return FieldError{"prompt",
                        "text prompts need the model's tokenizer; this model ships none: send token ids"};
    absl::StatusOr<std::vector<int32_t>> ids = tm->EncodePrompt(text);
    if (!ids.ok()) return FieldError{"prompt", absl::StrCat("prompt: ", ids.status().message())};
    if (ids->empty()) return FieldError{"prompt", "prompt: the text encodes to no tokens"};
    c->prompts.push_back(*std::move(ids));
    return std::nullopt;
  };
  if (p.is_string()) {
    if (auto e = encode(p.get<std::string>())) return e;
  } else if (!p.is_array() || p.empty()) {
    return FieldError{"prompt",
                      "prompt must be text, a list of texts, token ids or a list of token id lists"};
  } else if (p[0].is_string()) {
    for (const json& one : p) {
      if (!one.is_string()) return FieldError{"prompt", "prompt: mixes texts and other values"};
      if (auto e = encode(one.get<std::string>())) return e;
    }
  } else if (p[0].is_array()) {
    for (const json& one : p) {
      if (!one.is_array()) return FieldError{"prompt", "prompt: mixes token ids and lists"};
      c->prompts.emplace_back();
      if (auto e = TokenList(one, spec.vocab_size, &c->prompts.back())) return e;
    }
  } else {
    c->prompts.emplace_back();
    if (auto e = TokenList(p, spec.vocab_size, &c->prompts.back())) return e;
  }
  if (body.contains("logprobs") && !body["logprobs"].is_null()) {
    if (Int(body, "logprobs", 0, kMaxTopLogprobs, &c->top_logprobs))
      return FieldError{"logprobs", absl::StrCat("logprobs must be an integer in [0, ", kMaxTopLogprobs,
                                                 "]: the chosen token's log-probability and that many "
                                                 "alternatives")};
    c->logprobs = true;
  }
  if (c->echo && c->logprobs)
    return FieldError{"echo",
                      "echo with logprobs is not supported: the engine computes log-probabilities only "
                      "for generated tokens, not for the prompt's; send echo or logprobs, not both"};
  return ParseCommon(body, o, spec, tm, c);
}

std::optional<FieldError> ParseChat(const json& body, const ApiOptions& o, const ModelSpec& spec,
                                    const text::TextModel* tm, Completion* c) {
  static const std::set<std::string> kKnown = {"model",
                                               "messages",
                                               "max_tokens",
                                               "max_completion_tokens",
                                               "temperature",
                                               "top_p",
                                               "top_k",
                                               "seed",
                                               "n",
                                               "stream",
                                               "stream_options",
                                               "ignore_eos",
                                               "logprobs",
                                               "top_logprobs",
                                               "stop",
                                               "user",
                                               "frequency_penalty",
                                               "presence_penalty"};
  c->chat = true;
  for (const auto& [k, v] : body.items()) {
    if (!kKnown.contains(k)) return FieldError{k, absl::StrCat("unknown field \"", k, "\"")};
  }
  if (tm == nullptr || !tm->has_chat_template())
    return FieldError{"messages",
                      "chat needs the model's tokenizer and chat template; this model ships none"};
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
    return FieldError{"messages", "messages must be a non-empty list"};
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < body["messages"].size(); ++i) {
    const json& m = body["messages"][i];
    const std::string where = absl::StrCat("messages[", i, "]");
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      return FieldError{where, absl::StrCat(where, " must be an object with a string role")};
    std::string content;
    if (m.contains("content") && m["content"].is_string()) {
      content = m["content"].get<std::string>();
    } else if (m.contains("content") && m["content"].is_array()) {
      for (const json& part : m["content"]) {
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
            !part["text"].is_string())
          return FieldError{where, absl::StrCat(where, ".content: only text parts are supported")};
        content += part["text"].get<std::string>();
      }
    } else if (!(m.contains("content") && m["content"].is_null())) {
      return FieldError{where, absl::StrCat(where, ".content must be a string or a list of text parts")};
    }
    messages.push_back({m["role"].get<std::string>(), std::move(content)});
  }
  absl::StatusOr<std::vector<int32_t>> ids = tm->EncodeChat(messages);
  if (!ids.ok()) return FieldError{"messages", absl::StrCat("messages: ", ids.status().message())};
  if (ids->empty()) return FieldError{"messages", "messages: the chat encodes to no tokens"};
  c->prompts.push_back(*std::move(ids));
  if (auto e = Bool(body, "logprobs", &c->logprobs))
    return FieldError{"logprobs", "logprobs must be true or false (top_logprobs asks for alternatives)"};
  if (body.contains("top_logprobs") && !body["top_logprobs"].is_null()) {
    if (Int(body, "top_logprobs", 0, kMaxTopLogprobs, &c->top_logprobs))
      return FieldError{"top_logprobs",
                        absl::StrCat("top_logprobs must be an integer in [0, ", kMaxTopLogprobs, "]")};
    if (!c->logprobs) return FieldError{"top_logprobs", "top_logprobs needs logprobs: true"};
  }
  return ParseCommon(body, o, spec, tm, c);
}

int64_t NowUnix() { return absl::ToUnixSeconds(absl::Now()); }

// A token as the API shows it: its text through the model's tokenizer (bytes that are not UTF-8 on
// their own become U+FFFD, as in any decode), or its id in decimal without one.
std::string TokenText(const text::TextModel* tm, int32_t id) {
  if (tm == nullptr) return absl::StrCat(id);
  const int32_t one[] = {id};
  absl::StatusOr<std::string> t = tm->tokenizer().Decode(one, /*skip_special=*/false);
  return t.ok() ? *std::move(t) : absl::StrCat(id);
}

// The token's raw bytes (chat's `bytes`): null without a tokenizer.
json TokenBytes(const text::TextModel* tm, int32_t id) {
  if (tm == nullptr) return nullptr;
  const int32_t one[] = {id};
  absl::StatusOr<std::string> b = tm->tokenizer().DecodeBytes(one, /*skip_special=*/false);
  if (!b.ok()) return nullptr;
  json out = json::array();
  for (unsigned char ch : *b) out.push_back(static_cast<int>(ch));
  return out;
}

// `logprobs` of a choice or chunk. Chat: {"content": [{token, logprob, bytes, top_logprobs: [{token,
// logprob, bytes}]}]}. Completions (the legacy format): {tokens, token_logprobs, top_logprobs: one
// {token: logprob} object per token (a JSON object has no order: keys come out sorted, not by
// probability; two alternatives with the same text keep the more probable), text_offset}. `top` is
// empty or one list per token.
json LogprobsJson(const std::vector<int32_t>& tokens, const std::vector<float>& lp,
                  const std::vector<std::vector<TopLogprob>>& top, bool chat, const text::TextModel* tm) {
  static const std::vector<TopLogprob> kNone;
  auto alternatives = [&](size_t i) -> const std::vector<TopLogprob>& {
    return top.empty() ? kNone : top[i];
  };
  if (chat) {
    json content = json::array();
    for (size_t i = 0; i < tokens.size(); ++i) {
      json alts = json::array();
      for (const TopLogprob& a : alternatives(i))
        alts.push_back(
            {{"token", TokenText(tm, a.token)}, {"logprob", a.logprob}, {"bytes", TokenBytes(tm, a.token)}});
      content.push_back({{"token", TokenText(tm, tokens[i])},
                         {"logprob", lp[i]},
                         {"bytes", TokenBytes(tm, tokens[i])},
                         {"top_logprobs", alts}});
    }
    return {{"content", content}};
  }
  json ts = json::array(), ls = json::array(), tops = json::array();
  for (size_t i = 0; i < tokens.size(); ++i) {
    ts.push_back(TokenText(tm, tokens[i]));
    ls.push_back(lp[i]);
    json alts = json::object();
    for (const TopLogprob& a : alternatives(i)) {
      const std::string key = TokenText(tm, a.token);
      if (!alts.contains(key)) alts[key] = a.logprob;
    }
    tops.push_back(alts);
  }
  return {{"tokens", ts}, {"token_logprobs", ls}, {"top_logprobs", tops}, {"text_offset", json::array()}};
}

json Usage(int64_t prompt, int64_t completion, int64_t cached) {
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

// One choice of a call: its request's stream, and its text as it grows (decoded incrementally;
// a stop string cancels the request and ends the text before it).
struct Choice {
  std::shared_ptr<RequestStream> stream;
  std::string echo;  // the prompt's text, put before the completion (echo)
  std::unique_ptr<tokenizer::IncrementalDecoder> decoder;
  std::unique_ptr<text::StopMatcher> stop;
  bool done = false, first = true;
  GenerationResult result;
  std::string finish_reason;
};

// What one event adds to a choice.
struct Delta {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<std::vector<TopLogprob>> top_logprobs;  // empty, or one list per token
  std::string text;
  bool finished = false;
};

// The requests of one API call, as submitted to the loop; cancelled together.
struct Call {
  EngineLoop* loop = nullptr;
  std::vector<Choice> choices;
  std::string id;
  int64_t created = 0;
  size_t per_prompt = 1;
  void CancelAll() {
    for (Choice& c : choices)
      if (!c.done) loop->Cancel(c.stream->key());
  }
  // Folds an event into choice `i`. A stop string seen in the text cancels the request; the
  // tokens after the one that completed it are not reported.
  Delta Apply(size_t i, StreamEvent& e) {
    Choice& c = choices[i];
    Delta d;
    const bool stopped_before = c.stop && c.stop->stopped();
    if (!stopped_before) {
      for (size_t k = 0; k < e.tokens.size(); ++k) {
        d.tokens.push_back(e.tokens[k]);
        d.logprobs.push_back(e.logprobs[k]);
        if (k < e.top_logprobs.size()) d.top_logprobs.push_back(std::move(e.top_logprobs[k]));
        if (c.decoder) {
          absl::StatusOr<std::string> piece = c.decoder->Add(e.tokens[k]);
          if (piece.ok()) d.text += c.stop ? c.stop->Add(*piece) : *piece;
          if (c.stop && c.stop->stopped()) {
            loop->Cancel(c.stream->key());
            break;
          }
        }
      }
    }
    if (e.done) {
      c.done = true;
      d.finished = true;
      const bool stopped = c.stop && c.stop->stopped();
      if (!stopped && c.decoder) {
        const std::string tail = c.decoder->Flush();
        d.text += c.stop ? c.stop->Add(tail) + c.stop->Flush() : tail;
      }
      c.finish_reason = stopped ? "stop" : e.result.finish_reason;
      c.result = std::move(e.result);
    }
    return d;
  }
  json UsageJson() const {
    int64_t prompt_tokens = 0, completion = 0, cached = 0;
    for (size_t i = 0; i < choices.size(); ++i) {
      if (i % per_prompt == 0) {
        prompt_tokens += choices[i].result.prompt_tokens;
        cached += choices[i].result.cached_tokens;
      }
      completion += static_cast<int64_t>(choices[i].result.token_ids.size());
    }
    return Usage(prompt_tokens, completion, cached);
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
  s->http_->set_tcp_nodelay(true);  // one SSE event per step: never held back for an ACK (Nagle)
  s->Routes();
  // The packaged cpp-httplib listens with a backlog of 5: a burst of clients overflows it and the
  // dropped SYNs come back a second later (measured: 64 concurrent streams, TTFT 1.05 s). The
  // listening socket is taken here and given a real backlog once bound.
  auto listen_fd = std::make_shared<socket_t>(INVALID_SOCKET);
  s->http_->set_socket_options([listen_fd](socket_t sock) {
    httplib::default_socket_options(sock);
    *listen_fd = sock;
  });
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
  if (*listen_fd != INVALID_SOCKET) ::listen(*listen_fd, std::max(128, options.max_connections));
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
    if (!loop->stats().healthy) {
      return SendError(res, 503, absl::StrCat("the engine failed: ", loop->failure().message()));
    }
    if (draining_) return SendError(res, 503, "shutting down");
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
  h.Post("/v1/completions",
         [this](const httplib::Request& req, httplib::Response& res) { Complete(req, res, false); });
  h.Post("/v1/chat/completions",
         [this](const httplib::Request& req, httplib::Response& res) { Complete(req, res, true); });
}

void ApiServer::Complete(const httplib::Request& req, httplib::Response& res, bool chat) {
  EngineLoop* loop = loop_;
  if (loop == nullptr) return SendError(res, 503, "loading the model");
  if (draining_) return SendError(res, 503, "shutting down");
  if (absl::Status deep = CheckJsonDepth(req.body); !deep.ok())
    return SendError(res, 400, std::string(deep.message()));
  json body = json::parse(req.body, nullptr, false);
  if (body.is_discarded()) return SendError(res, 400, "the body is not valid JSON");
  if (!body.is_object()) return SendError(res, 400, "the body must be a JSON object");
  if (!body.contains("model") || !body["model"].is_string())
    return SendError(res, 400, "model is required", "model");
  if (body["model"].get<std::string>() != options_.served_model_name)
    return SendError(
        res, 404, absl::StrCat("model \"", body["model"].get<std::string>(), "\" does not exist"), "model");
  Completion c;
  const std::optional<FieldError> bad = chat ? ParseChat(body, options_, loop->spec(), text_, &c)
                                             : ParseCompletion(body, options_, loop->spec(), text_, &c);
  if (bad) return SendError(res, 400, bad->message, bad->param);
  auto call = std::make_shared<Call>();
  call->loop = loop;
  call->created = NowUnix();
  call->per_prompt = static_cast<size_t>(c.n);
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
      r.top_logprobs = static_cast<int32_t>(c.top_logprobs);
      absl::StatusOr<std::shared_ptr<RequestStream>> s = loop->Submit(std::move(r));
      if (!s.ok()) {
        call->CancelAll();  // nothing half-applied
        if (absl::IsResourceExhausted(s.status())) {
          res.set_header("Retry-After", "1");
          return SendError(res, 429, std::string(s.status().message()));
        }
        if (absl::IsUnavailable(s.status())) return SendError(res, 503, std::string(s.status().message()));
        return SendError(res, 400, std::string(s.status().message()), chat ? "messages" : "prompt");
      }
      Choice ch;
      ch.stream = *std::move(s);
      if (c.echo) {
        absl::StatusOr<std::string> p = text_->tokenizer().Decode(prompt, /*skip_special=*/true);
        if (p.ok()) ch.echo = *std::move(p);
      }
      if (text_ != nullptr) ch.decoder = std::make_unique<tokenizer::IncrementalDecoder>(text_->tokenizer());
      if (!c.stop.empty()) ch.stop = std::make_unique<text::StopMatcher>(c.stop);
      call->choices.push_back(std::move(ch));
    }
  }
  call->id = absl::StrCat(chat ? "chatcmpl-" : "cmpl-", call->choices.front().stream->key());
  const std::string model = options_.served_model_name;
  const bool logprobs = c.logprobs, include_usage = c.include_usage;
  const char* object = chat ? "chat.completion" : "text_completion";
  if (!c.stream) {
    std::vector<std::string> texts(call->choices.size());
    std::vector<std::vector<float>> lps(call->choices.size());
    std::vector<std::vector<std::vector<TopLogprob>>> tops(call->choices.size());
    std::vector<std::vector<int32_t>> toks(call->choices.size());
    for (size_t i = 0; i < call->choices.size(); ++i) {
      texts[i] = call->choices[i].echo;
      while (!call->choices[i].done) {
        std::optional<StreamEvent> e = call->choices[i].stream->Next(absl::InfiniteFuture());
        if (!e) continue;
        if (e->done && !e->error.ok()) {
          call->choices[i].done = true;
          call->CancelAll();
          const auto [status, message] = EndedWithError(*e);
          return SendError(res, status, message);
        }
        Delta d = call->Apply(i, *e);
        texts[i] += d.text;
        toks[i].insert(toks[i].end(), d.tokens.begin(), d.tokens.end());
        lps[i].insert(lps[i].end(), d.logprobs.begin(), d.logprobs.end());
        for (std::vector<TopLogprob>& t : d.top_logprobs) tops[i].push_back(std::move(t));
      }
    }
    json choices = json::array();
    for (size_t i = 0; i < call->choices.size(); ++i) {
      json ch = {
          {"index", i},
          {"finish_reason", call->choices[i].finish_reason},
          {"token_ids", toks[i]},
          {"logprobs", logprobs ? LogprobsJson(toks[i], lps[i], tops[i], chat, text_) : json(nullptr)}};
      if (chat) {
        ch["message"] = {{"role", "assistant"}, {"content", texts[i]}};
      } else {
        ch["text"] = texts[i];
      }
      choices.push_back(ch);
    }
    json out = {{"id", call->id}, {"object", object},   {"created", call->created},
                {"model", model}, {"choices", choices}, {"usage", call->UsageJson()}};
    res.set_content(out.dump(), "application/json");
    return;
  }
  const char* chunk_object = chat ? "chat.completion.chunk" : "text_completion";
  res.set_chunked_content_provider(
      "text/event-stream",
      [call, model, logprobs, include_usage, chat, chunk_object, tm = text_](size_t,
                                                                             httplib::DataSink& sink) {
        auto send = [&](const json& j) {
          const std::string line = absl::StrCat("data: ", j.dump(), "\n\n");
          return sink.write(line.data(), line.size());
        };
        auto chunk = [&](size_t index, const Delta& d, const json& finish) {
          Choice& c = call->choices[index];
          json ch = {{"index", index},
                     {"token_ids", d.tokens},
                     {"finish_reason", finish},
                     {"logprobs", logprobs ? LogprobsJson(d.tokens, d.logprobs, d.top_logprobs, chat, tm)
                                           : json(nullptr)}};
          std::string text = d.text;
          if (!c.echo.empty()) {
            text = c.echo + text;
            c.echo.clear();
          }
          if (chat) {
            json delta = json::object();
            if (c.first) delta["role"] = "assistant";
            if (!text.empty() || finish.is_null()) delta["content"] = text;
            ch["delta"] = delta;
          } else {
            ch["text"] = text;
          }
          c.first = false;
          return send({{"id", call->id},
                       {"object", chunk_object},
                       {"created", call->created},
                       {"model", model},
                       {"choices", json::array({ch})}});
        };
        // One pass over the choices: whatever events are ready, or a keep-alive comment after a
        // second of silence (a write is how a disconnected client is noticed).
        const absl::Time until = absl::Now() + absl::Seconds(1);
        bool wrote = false, all_done = true;
        const int64_t n = static_cast<int64_t>(call->choices.size());
        for (size_t i = 0; i < call->choices.size(); ++i) {
          if (call->choices[i].done) continue;
          const absl::Duration slice = std::max(absl::ZeroDuration(), (until - absl::Now()) / n);
          while (std::optional<StreamEvent> e =
                     call->choices[i].stream->Next(absl::Now() + (wrote ? absl::ZeroDuration() : slice))) {
            wrote = true;
            if (e->done && !e->error.ok()) {
              call->choices[i].done = true;
              const auto [status, message] = EndedWithError(*e);
              send({{"error", {{"message", message}, {"type", ErrorType(status)}, {"code", status}}}});
              call->CancelAll();
              sink.done();
              return true;
            }
            const Delta d = call->Apply(i, *e);
            const bool ok = d.finished ? (d.tokens.empty() && d.text.empty() && call->choices[i].echo.empty()
                                              ? true
                                              : chunk(i, d, nullptr)) &&
                                             chunk(i, Delta{}, call->choices[i].finish_reason)
                                       : (d.tokens.empty() && d.text.empty() ? true : chunk(i, d, nullptr));
            if (!ok) {
              call->CancelAll();
              return false;
            }
            if (d.finished) break;
          }
          if (!call->choices[i].done) all_done = false;
        }
        if (!all_done) {
          if (!wrote && !sink.write(": keep-alive\n\n", 14)) {
            call->CancelAll();
            return false;
          }
          return true;
        }
        if (include_usage) {
          send({{"id", call->id},
                {"object", chunk_object},
                {"created", call->created},
                {"model", model},
                {"choices", json::array()},
                {"usage", call->UsageJson()}});
        }
        const std::string done = "data: [DONE]\n\n";
        sink.write(done.data(), done.size());
        sink.done();
        return true;
      },
      [call](bool success) {
        if (!success) call->CancelAll();
      });
}

}  // namespace tandem::server
